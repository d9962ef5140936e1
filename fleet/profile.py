"""Step-time profiles: how long one engine iteration takes, loaded from small data files.

A profile answers three questions, all in milliseconds of GPU time:
- `target_ms(batch, tokens_per_seq, context)`: one forward step of the target model over
  `batch` sequences of `tokens_per_seq` new tokens each (1 for plain decode, k+1 to verify k
  drafts), with `context` tokens of KV cache per sequence;
- `draft_ms(batch, context)`: one EAGLE-3 draft step over the batch;
- `prefill_ms(tokens)`: one prefill iteration over `tokens` prompt tokens (all sequences).

Profiles are JSON files in fleet/profiles/ (built in) or anywhere on disk (pass a path); see
docs/twin.md for the format. Three step kinds exist: `table` (a measured CSV, interpolated),
`affine` (fixed + per-token) and `moe` (fixed + expert coverage + per-token).
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

# No draft step is given for the formula presets: 1.0 ms per draft step
# (speculation-facts section 3.3) unless the file says otherwise.
DEFAULT_DRAFT_STEP_MS = 1.0


class StepModel(Protocol):
    def target_ms(self, batch: int, tokens_per_seq: int, context: float) -> float: ...

    def draft_ms(self, batch: int, context: float) -> float: ...


@dataclass(frozen=True)
class Overheads:
    """An engine's costs per step beyond the GPU table's, in ms (docs/twin.md, "Engine overheads").

    A speculative SGLang server runs the draft model's extend step after each verify, samples and
    updates its tree, and schedules without the overlap scheduler, so its CPU time per step adds
    to the GPU's; a plain server's overlap scheduler hides most of its own.
    """

    per_verify_step_ms: float = 0.0
    per_draft_step_ms: float = 0.0
    per_step_ms: float = 0.0
    per_request_ms: float = 0.0
    """Scheduling cost per running request per step (it grows with the batch)."""

    def step_ms(self, batch: int, num_steps: int) -> float:
        """The overhead of one step of `batch` requests; `num_steps` drafts (0: a plain decode)."""
        verify = self.per_verify_step_ms if num_steps > 0 else 0.0
        return verify + num_steps * self.per_draft_step_ms + self.per_step_ms + self.per_request_ms * batch

    @classmethod
    def parse(cls, doc: dict[str, Any] | None, where: str = "overheads") -> Overheads:
        doc = dict(doc or {})
        unknown = set(doc) - {"per_verify_step_ms", "per_draft_step_ms", "per_step_ms", "per_request_ms"}
        if unknown:
            raise ValueError(f"unknown overhead field(s) {sorted(unknown)}")
        return cls(**{name: cost_ms(value, f"{where}.{name}") for name, value in doc.items()})


NO_OVERHEADS = Overheads()


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    step: StepModel
    prefill_fixed_ms: float
    prefill_per_token_ms: float
    prefill_uses_step: bool
    """True when a prefill iteration is costed by the step formula with N = prompt tokens."""
    spec_prefill_factor: float
    """A spec server's prefill also runs the draft model over the prompt ("draft extend")."""
    defaults: dict[str, Any]
    spec_overheads: Overheads = NO_OVERHEADS
    base_overheads: Overheads = NO_OVERHEADS
    measured_alpha: float | None = None
    """The acceptance `specroute profile` measured on a speculative server (its `measured.alpha`);
    None for a built-in profile, whose `defaults.mean_alpha` is only the twin's setting."""

    def overhead_ms(self, batch: int, num_steps: int) -> float:
        """Engine overheads of one decode step (speculative when `num_steps` > 0)."""
        overheads = self.spec_overheads if num_steps > 0 else self.base_overheads
        return overheads.step_ms(batch, num_steps)

    def target_ms(self, batch: int, tokens_per_seq: int, context: float) -> float:
        return self.step.target_ms(batch, tokens_per_seq, context)

    def draft_ms(self, batch: int, context: float) -> float:
        return self.step.draft_ms(batch, context)

    def base_step_ms(self, batch: int, context: float) -> float:
        """One plain decode step: target(B, 1, L), plus the engine's overheads."""
        return self.step.target_ms(batch, 1, context) + self.base_overheads.step_ms(batch, 0)

    def spec_step_ms(self, batch: int, num_steps: int, context: float) -> float:
        """One speculative step: k draft steps, then a verify step of k+1 tokens per sequence,
        plus the engine's overheads."""
        return (
            num_steps * self.step.draft_ms(batch, context)
            + self.step.target_ms(batch, num_steps + 1, context)
            + self.spec_overheads.step_ms(batch, num_steps)
        )

    def prefill_ms(self, tokens: int, speculative: bool = False) -> float:
        if self.prefill_uses_step:
            ms = self.step.target_ms(1, max(tokens, 1), float(tokens))
        else:
            ms = self.prefill_fixed_ms + self.prefill_per_token_ms * tokens
        return ms * self.spec_prefill_factor if speculative else ms


@dataclass(frozen=True)
class AffineStep:
    """T(N) = fixed + per_token * N, N = tokens in the step (B*(k+1) to verify, B for base)."""

    fixed_ms: float
    per_token_ms: float
    draft_step_ms: float

    def target_ms(self, batch: int, tokens_per_seq: int, context: float) -> float:
        return self.fixed_ms + self.per_token_ms * batch * tokens_per_seq

    def draft_ms(self, batch: int, context: float) -> float:
        return self.draft_step_ms


@dataclass(frozen=True)
class MoeStep:
    """T(N) = fixed + expert_ms * U(N) + per_token * N, U(N) = 1 - (1 - active/experts)^N."""

    fixed_ms: float
    expert_ms: float
    experts: int
    active_experts: int
    per_token_ms: float
    draft_step_ms: float

    def target_ms(self, batch: int, tokens_per_seq: int, context: float) -> float:
        n = batch * tokens_per_seq
        touched = 1.0 - (1.0 - self.active_experts / self.experts) ** n
        return self.fixed_ms + self.expert_ms * touched + self.per_token_ms * n

    def draft_ms(self, batch: int, context: float) -> float:
        return self.draft_step_ms


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the points; linear extrapolation from the two end points."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class TableStep:
    """A measured table ms(kind, B, T, L), interpolated linearly over B, then T, then L.

    Beyond the table every axis extrapolates linearly from its last two points (past the
    largest B the step is compute-bound and grows linearly with tokens; past the largest L
    attention grows linearly with context). A context row that stops early (L=4096 ends at
    B=128) extrapolates along B the same way. Results never drop below the smallest
    measured step, so a short context cannot extrapolate to a free step.
    """

    def __init__(self, rows: list[tuple[str, int, int, int, float]]):
        # grid[kind][L][T] = (Bs, ms)
        grid: dict[str, dict[int, dict[int, tuple[list[float], list[float]]]]] = {}
        for kind, b, t, length, ms in sorted(rows):
            bs, values = grid.setdefault(kind, {}).setdefault(length, {}).setdefault(t, ([], []))
            bs.append(float(b))
            values.append(ms)
        if "target" not in grid:
            raise ValueError("a step table needs rows of kind 'target'")
        self._grid = grid
        self._floor = {kind: min(min(v) for per_l in g.values() for _, v in per_l.values()) for kind, g in grid.items()}
        self._memo: dict[tuple[str, int, int, int], float] = {}

    def _at(self, kind: str, batch: int, tokens_per_seq: int, context: float) -> float:
        per_l = self._grid[kind]
        ls = sorted(per_l)
        by_l = []
        for length in ls:
            per_t = per_l[length]
            ts = sorted(per_t)
            by_t = [_interp(*per_t[t], float(batch)) for t in ts]
            by_l.append(_interp([float(t) for t in ts], by_t, float(tokens_per_seq)))
        value = _interp([float(length) for length in ls], by_l, context)
        return max(value, self._floor[kind])

    def _cached(self, kind: str, batch: int, tokens_per_seq: int, context: float) -> float:
        # Context is bucketed down to 16 tokens: the table is smooth in L and the memo stays small.
        bucket = int(context) >> 4
        key = (kind, batch, tokens_per_seq, bucket)
        value = self._memo.get(key)
        if value is None:
            value = self._at(kind, batch, tokens_per_seq, float(bucket << 4))
            if len(self._memo) < 200_000:
                self._memo[key] = value
        return value

    def target_ms(self, batch: int, tokens_per_seq: int, context: float) -> float:
        return self._cached("target", batch, tokens_per_seq, context)

    def draft_ms(self, batch: int, context: float) -> float:
        if "draft" not in self._grid:
            return DEFAULT_DRAFT_STEP_MS
        return self._cached("draft", batch, 1, context)


def read_step_table(path: Path) -> TableStep:
    """The table at `path`; ValueError naming the file (its absolute path: a relative one is
    resolved against the profile's folder, which the user may not have in mind) when it cannot
    be read or holds rows that are not `kind,B,T,L,ms`."""
    shown = str(path.absolute())
    try:
        with path.open(newline="", encoding="utf-8") as f:
            lines = [line for line in f if line.strip() and not line.startswith("#")]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"cannot read the step table {path.name!r}, looked for at {shown} ({describe_error(exc)}); "
            "a profile's table file is read from the folder of its JSON: copy the CSV beside it"
        ) from None
    rows = []
    try:
        for row in csv.DictReader(lines):
            rows.append((row["kind"], int(row["B"]), int(row["T"]), int(row["L"]), float(row["ms"])))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad step table {shown}: rows must be kind,B,T,L,ms ({describe_error(exc)})") from None
    for kind, b, t, length, ms in rows:
        # A target step takes time; a draft row may be 0 (specroute profile writes 0 where the
        # spec step was measured whole, its drafts inside the target rows).
        bad_ms = not math.isfinite(ms) or ms < 0 or (kind == "target" and ms == 0)
        if bad_ms or b < 1 or t < 1 or length < 0:
            raise ValueError(
                f"bad step table {shown}: row {kind},{b},{t},{length},{ms} (B and T >= 1, L >= 0, "
                "ms finite, > 0 for a target step and >= 0 for a draft step)"
            )
    return TableStep(rows)


def describe_error(exc: BaseException) -> str:
    """An exception as a short phrase: its type and, for an OSError, its reason alone (its
    message repeats the file name already in ours)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def builtin_names() -> list[str]:
    folder = resources.files("fleet") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (see builtin_names()) or a JSON file by path."""
    path = Path(name_or_path)
    # exists(), not is_file(): a directory or an unreadable file named *.json is the user's
    # file, to be said why it cannot be read, not "not found".
    if not (path.suffix == ".json" and path.exists()):
        candidate = Path(str(resources.files("fleet") / "profiles" / f"{name_or_path}.json"))
        if not candidate.is_file():
            if path.suffix == ".json":
                raise ValueError(f"profile file {name_or_path!r} not found")
            raise ValueError(
                f"unknown profile {name_or_path!r}: use one of {', '.join(builtin_names())} or a path to a .json file"
            )
        path = candidate
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read profile file {name_or_path!r} ({describe_error(exc)})") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"profile file {name_or_path!r} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"profile file {name_or_path!r} is not a JSON object")
    return parse_profile(doc, path.parent)


def cost_ms(value: Any, field: str, *, positive: bool = False) -> float:
    """A profile's time or cost `value` as a float; ValueError naming `field` unless it is a
    finite number >= 0 (> 0 when `positive`). A negative or NaN cost made every prediction
    negative or null, and JSON as Python reads it takes NaN and Infinity."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"bad profile file: {field} is {value!r}, not a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"bad profile file: {field} is {value!r}, not a number") from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"bad profile file: {field} is {number!r}; it must be a finite number {bound}")
    return number


def count(value: Any, field: str, least: int) -> int:
    """A profile's whole number `value`; ValueError naming `field` unless it is >= `least`."""
    number = cost_ms(value, field) if not isinstance(value, int) or isinstance(value, bool) else float(value)
    if number != int(number) or number < least:
        raise ValueError(f"bad profile file: {field} is {value!r}; it must be a whole number >= {least}")
    return int(number)


def section(value: Any, field: str) -> dict[str, Any]:
    """A profile's JSON object at `field` (absent: empty); ValueError naming it otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"bad profile file: {field} is {type(value).__name__} {value!r:.40}; it must be a JSON object")
    return value


def required(doc: dict[str, Any], key: str, where: str) -> Any:
    """`doc[key]`; ValueError naming the field's path when it is missing."""
    if key not in doc:
        raise ValueError(f"bad profile file: {where}{key} is missing")
    return doc[key]


def parse_profile(doc: dict[str, Any], folder: Path) -> Profile:
    """The profile `doc` describes (its table file, if any, read from `folder`); ValueError naming
    the field when one is missing, of the wrong type or out of bounds: every time and cost finite
    and >= 0, a target step of one token > 0 (a free step makes the twin spin and every
    prediction zero)."""
    step_doc = section(required(doc, "step", ""), "step")
    kind = required(step_doc, "kind", "step.")
    draft = cost_ms(doc.get("draft_step_ms", DEFAULT_DRAFT_STEP_MS), "draft_step_ms")
    step: StepModel
    if kind == "table":
        table = required(step_doc, "file", "step.")
        if not isinstance(table, str):
            raise ValueError(f"bad profile file: step.file is {table!r}; it must be a file name")
        step = read_step_table(folder / table)
    elif kind == "affine":
        step = AffineStep(
            cost_ms(required(step_doc, "fixed_ms", "step."), "step.fixed_ms"),
            cost_ms(required(step_doc, "per_token_ms", "step."), "step.per_token_ms"),
            draft,
        )
    elif kind == "moe":
        experts = count(required(step_doc, "experts", "step."), "step.experts", 1)
        active = count(required(step_doc, "active_experts", "step."), "step.active_experts", 0)
        if active > experts:
            raise ValueError(f"bad profile file: step.active_experts ({active}) exceeds step.experts ({experts})")
        step = MoeStep(
            cost_ms(required(step_doc, "fixed_ms", "step."), "step.fixed_ms"),
            cost_ms(required(step_doc, "expert_ms", "step."), "step.expert_ms"),
            experts,
            active,
            cost_ms(required(step_doc, "per_token_ms", "step."), "step.per_token_ms"),
            draft,
        )
    else:
        raise ValueError(f"bad profile file: unknown step.kind {kind!r} (table, affine, moe)")
    if not step.target_ms(1, 1, 0.0) > 0:
        raise ValueError(f"bad profile file: the {kind} step of one token costs 0 ms; a step takes time")
    prefill = section(doc.get("prefill"), "prefill")
    uses_step = prefill.get("kind") == "step"
    overheads = section(doc.get("overheads"), "overheads")
    return Profile(
        name=str(required(doc, "name", "")),
        description=str(doc.get("description", "")),
        step=step,
        prefill_fixed_ms=0.0 if uses_step else cost_ms(required(prefill, "fixed_ms", "prefill."), "prefill.fixed_ms"),
        prefill_per_token_ms=0.0
        if uses_step
        else cost_ms(required(prefill, "per_token_ms", "prefill."), "prefill.per_token_ms"),
        prefill_uses_step=uses_step,
        spec_prefill_factor=cost_ms(doc.get("spec_prefill_factor", 1.0), "spec_prefill_factor", positive=True),
        defaults=_defaults(section(doc.get("defaults"), "defaults")),
        spec_overheads=Overheads.parse(section(overheads.get("spec"), "overheads.spec"), "overheads.spec"),
        base_overheads=Overheads.parse(section(overheads.get("base"), "overheads.base"), "overheads.base"),
        measured_alpha=_measured_alpha(section(doc.get("measured"), "measured")),
    )


def _defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """The twin's defaults, the two it reads checked (`specroute sim` refused a bad one with a
    message naming no field, where the proxy took the file)."""
    checked = dict(defaults)
    if "mean_alpha" in checked:
        alpha = cost_ms(checked["mean_alpha"], "defaults.mean_alpha")
        if alpha > 1.0:
            raise ValueError(f"bad profile file: defaults.mean_alpha is {alpha!r}; it must be within [0, 1]")
        checked["mean_alpha"] = alpha
    if "num_steps" in checked:  # 0: not known (`specroute profile` on a server that did not say)
        checked["num_steps"] = count(checked["num_steps"], "defaults.num_steps", 0)
    return checked


def _measured_alpha(measured: dict[str, Any]) -> float | None:
    value = measured.get("alpha")
    if value is None:
        return None
    alpha = cost_ms(value, "measured.alpha")
    if alpha > 1.0:
        raise ValueError(f"bad profile file: measured.alpha is {alpha!r}; it must be within [0, 1]")
    return alpha


def tokens_per_verify_step(alpha: float, num_steps: int) -> float:
    """tau = (1 - alpha^(k+1)) / (1 - alpha): mean tokens a sequence commits per verify step."""
    if alpha >= 1.0:
        return float(num_steps + 1)
    return (1.0 - alpha ** (num_steps + 1)) / (1.0 - alpha)
