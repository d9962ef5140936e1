"""`specroute profile` against twins: the profile it writes recovers the twin's step times, loads
as SPECROUTE_PROFILE does and seeds the cost model; a busy server is refused.

The twins run on 127.0.0.1 (sim.testing). Batches stop at 32: on a small shared machine the
twin and this client cannot keep up with hundreds of streams of 5 ms steps (the profiler then
leaves such a batch out itself, see test_burst_detection). The Kimi presets run at time scale 2
(their steps are 15-60 ms), the H200 ones in real time (5-12 ms steps).
"""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from fleet.costmodel import seed_from_profile
from fleet.profile import load_profile, tokens_per_verify_step
from proxy.backends import SGLang
from proxy.cli import main
from proxy.profiler import (
    AFFINE_TOLERANCE,
    BatchResult,
    Options,
    ProfileError,
    Profiler,
    Progress,
    Server,
    ServerResult,
    above_the_line,
    alpha_from_accept_length,
    batch_sizes,
    build_profile,
    decode_sizes,
    fit_line,
    public_url,
    run,
    write_profile,
)
from proxy.routing import Router
from proxy.settings import load_settings
from sim.testing import TwinSpec, twin, twins, wait_for

BATCHES = [1, 2, 4, 8, 16, 32]
# Kimi's steps are 3 ms at 4x: a 2-core machine busy with other work then reads 16 streams' chunks
# in bursts (the profiler leaves such a batch out, one CI run lost batch 16 that way); 2x keeps
# its steps near the H200 profiles' at 1x.
SCALES = {"h200-llama8b": 1.0, "h200-llama8b-sglang": 1.0, "kimi-linear": 2.0, "kimi-moe": 2.0}


def recovered_errors(out: Path, original: str) -> dict[str, dict[int, float]]:
    """Relative error of the written profile's step against the original's, per side and batch,
    at the context each batch was measured at."""
    doc = json.loads(out.read_text())
    new, orig = load_profile(str(out)), load_profile(original)
    k = doc["defaults"]["num_steps"]
    errors: dict[str, dict[int, float]] = {}
    for block in doc["measured"]["servers"]:
        decode = block["decode"]
        side = errors.setdefault(block["role"], {})
        for b, ctx in zip(decode["batches"], decode["context_tokens"]):
            if block["role"] == "spec":
                side[b] = new.spec_step_ms(b, k, ctx) / orig.spec_step_ms(b, k, ctx) - 1
            else:
                side[b] = new.base_step_ms(b, ctx) / orig.base_step_ms(b, ctx) - 1
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SCALES))
def test_profile_recovers_the_twins_step_times(name: str, tmp_path: Path) -> None:
    scale = SCALES[name]
    out = tmp_path / f"{name}-measured.json"
    with twins(TwinSpec("spec", name, scale, seed=1), TwinSpec("base", name, scale, seed=2)) as (spec, base):
        rc = run(
            Options(urls=[spec.url, base.url], out=out, batches=BATCHES, prefill_lengths=[256, 1024, 2048], quiet=True)
        )
    assert rc == 0
    errors = recovered_errors(out, name)
    print(name, {side: {b: f"{100 * e:+.2f} %" for b, e in per.items()} for side, per in errors.items()})
    for side in ("spec", "base"):
        # The larger batches may be left out when a busy machine reads their chunks in bursts;
        # every batch measured must be right.
        assert set(errors[side]) >= {1, 2, 4, 8}, (side, errors[side])
        worst = max(abs(e) for e in errors[side].values())
        assert worst <= 0.05, (side, errors[side])

    doc = json.loads(out.read_text())
    measured = doc["measured"]
    assert measured["by"] == "specroute profile" and measured["at"].endswith("Z")
    assert [s["role"] for s in measured["servers"]] == ["spec", "base"]
    assert measured["servers"][0]["url"] == spec.url and measured["servers"][0]["twin"]["time_scale"] == scale
    assert measured["step_kind"] in ("affine", "table") and doc["step"]["kind"] == measured["step_kind"]
    for block in measured["servers"]:
        assert len(block["prefill"]["ttft_ms_min"]) == 3
        assert block["decode"]["batches"] == sorted(block["decode"]["batches"])
    # What was measured is what the written profile gives (the fit's residuals are recorded).
    for residuals in measured["profile_residual_pct"].values():
        assert max(abs(r) for r in residuals) <= 100 * AFFINE_TOLERANCE
    # Acceptance: the twin's mean alpha is 0.64 (per-request Beta draws around it).
    assert 0.5 < doc["defaults"]["mean_alpha"] < 0.75
    assert doc["defaults"]["num_steps"] == 3
    # Prefill: the twin's cost plus the HTTP round trip, scaled with the twin's clock.
    original = load_profile(name)
    for n in (1024, 2048):
        assert load_profile(str(out)).prefill_ms(n) == pytest.approx(original.prefill_ms(n), rel=0.35)

    # It loads as SPECROUTE_PROFILE and seeds the router's cost model like a built-in file.
    seed = seed_from_profile(str(out))
    ref = seed_from_profile(name)
    for b in (1, 8, 16):
        assert seed.target_ms(b, 1) + seed.overhead_ms(b, 0) == pytest.approx(
            ref.target_ms(b, 1) + ref.overhead_ms(b, 0), rel=0.06
        )
    # ... and its acceptance starts the router's estimate (a built-in profile's default does not).
    assert seed.profile.measured_alpha == measured["alpha"] == doc["defaults"]["mean_alpha"]
    assert ref.profile.measured_alpha is None
    router = Router.from_settings(load_settings(spec_urls=["http://127.0.0.1:9"], profile=str(out)))
    assert router.fleet.snapshot(0.0).pools["spec"].alpha == pytest.approx(measured["alpha"], abs=1e-6)


def test_refuses_a_busy_server_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "busy.json"
    with twin("base", "kimi-linear", time_scale=4.0) as base:
        stop = threading.Event()

        def other_traffic() -> None:
            body = {"model": "m", "prompt": "hello", "max_tokens": 20000, "ignore_eos": True, "stream": True}
            with (
                httpx.Client(timeout=60) as client,
                client.stream("POST", base.url + "/v1/completions", json=body) as r,
            ):
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

        worker = threading.Thread(target=other_traffic, daemon=True)
        worker.start()
        try:
            wait_for(
                lambda: httpx.get(base.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] > 0, "other traffic"
            )
            assert main(["profile", "--url", base.url, "--out", str(out), "--quiet"]) == 3
            assert "busy with other traffic" in capsys.readouterr().err
            assert not out.exists()
            forced = ["profile", "--url", base.url, "--out", str(out), "--force", "--quiet", "--batches", "1,2"]
            assert main(forced + ["--prefill-lengths", "256"]) == 0
            assert load_profile(str(out)).base_step_ms(1, 1024) > 0
        finally:
            stop.set()
            worker.join(timeout=30)


@pytest.mark.parametrize("preset", ["kimi-moe-vllm", "kimi-linear-vllm"])
def test_vllm_base_twin_with_its_time_scale(tmp_path: Path, preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM server has no /server_info: its load comes from /metrics, its cap is vLLM's default,
    and a vLLM twin's time scale is given with --time-scale. Without --quiet the run shows its
    progress against the budget on stderr."""
    out = tmp_path / "vllm.json"
    with twins(TwinSpec("base", preset, 2.0, server="vllm")) as (base,):
        rc = main(
            ["profile", "--url", base.url, "--out", str(out), "--time-scale", "2", "--batches", "1,4,16"]
            + ["--prefill-lengths", "256,1024", "--budget-s", "120"]
        )

        async def probed() -> Server:
            profiler = Profiler(Options(urls=[base.url], out=out, quiet=True))
            try:
                return await profiler.probe(base.url)
            finally:
                await profiler.close()

        server = asyncio.run(probed())
    assert rc == 0
    # vLLM's readings carry its default cap, not one it said: what is asked past it is measured.
    assert (server.cap, server.cap_reported) == (256, False)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert any("/120 s" in line and "prefill 1024 tokens" in line for line in progress), progress
    assert any("batch 16" in line for line in progress), progress
    errors = recovered_errors(out, preset)
    assert set(errors) == {"base"}
    assert max(abs(e) for e in errors["base"].values()) <= 0.05, errors
    doc = json.loads(out.read_text())
    assert doc["measured"]["servers"][0]["kind"] == "vllm"
    assert any("no spec server" in note for note in doc["measured"]["notes"])
    # The router predicts up to the cap: what lies past the last batch measured is said to be a guess.
    assert (
        "batches above 16 not measured (its assumed cap is 256): extrapolated" in doc["measured"]["servers"][0]["notes"]
    )


# ---- the pieces, without a server ---------------------------------------------------------


def test_public_url_drops_credentials_and_query() -> None:
    assert public_url("http://user:secret@gpu-a:30001/?key=x") == "http://gpu-a:30001"
    assert public_url("http://u:p@[::1]:30001/") == "http://[::1]:30001"  # brackets kept
    assert public_url("https://gpu-b/sglang/") == "https://gpu-b/sglang"


def test_a_cap_the_server_reported_bounds_the_batches_and_an_assumed_one_does_not() -> None:
    assert decode_sizes(48, True, None, None) == ([1, 2, 4, 8, 16, 32, 48], [])
    assert decode_sizes(48, True, [16, 64, 128], None) == ([16], [64, 128])  # left out, and said
    assert decode_sizes(48, True, None, 1024) == ([1, 2, 4, 8, 16, 32, 48], [])
    # vLLM says no cap: its default of 256 is assumed, and what the user asks for past it is measured
    assert decode_sizes(256, False, None, None)[0][-1] == 256
    assert decode_sizes(256, False, None, 1024) == ([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], [])
    assert decode_sizes(256, False, [512, 768], None) == ([512, 768], [])


def test_batch_sizes_go_up_to_the_cap() -> None:
    assert batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert batch_sizes(1) == [1]


def test_fit_and_alpha() -> None:
    a, b = fit_line([1.0, 2.0, 4.0, 8.0], [15.72, 16.02, 16.62, 17.82])
    assert a == pytest.approx(15.42) and b == pytest.approx(0.30)
    for alpha in (0.3, 0.64, 0.9):
        assert alpha_from_accept_length(tokens_per_verify_step(alpha, 3), 3) == pytest.approx(alpha, abs=1e-6)


def _result(role: str, points: dict[int, float]) -> ServerResult:
    server = Server(
        f"http://u:p@{role}:1", f"http://{role}:1", "sglang", SGLang("/v1/loads"), "m", role == "spec", 3, 48
    )
    result = ServerResult(server, prefill_tokens=[256, 1024], prefill_raw_ms=[[30.0], [70.0]])
    for b, ms in points.items():
        result.batches.append(BatchResult(b, ms, ms, 10 * b, 30, 1030.0, 2.3 if role == "spec" else 1.0, 1.0))
    if role == "spec":
        result.accept_counters = tokens_per_verify_step(0.64, 3)
    return result


def test_an_affine_fleet_gets_the_affine_kind_and_a_nonlinear_one_a_table(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    linear = load_profile("kimi-linear")
    spec = _result("spec", {b: linear.spec_step_ms(b, 3, 1024) for b in BATCHES})
    base = _result("base", {b: linear.base_step_ms(b, 1024) for b in BATCHES})
    doc, rows = build_profile([spec, base], "lin", datetime.now(UTC), 10.0, 240.0)
    assert rows is None and doc["step"]["kind"] == "affine"
    assert doc["step"]["fixed_ms"] == pytest.approx(15.42) and doc["step"]["per_token_ms"] == pytest.approx(0.30)
    assert doc["overheads"]["spec"]["per_verify_step_ms"] == pytest.approx(3.0)  # the 3 draft steps of 1 ms
    assert doc["defaults"]["mean_alpha"] == pytest.approx(0.64, abs=1e-3)
    assert "u:p" not in json.dumps(doc)
    profile = write_profile(doc, rows, tmp_path / "lin.json")
    for b in BATCHES:
        assert profile.spec_step_ms(b, 3, 1024) == pytest.approx(linear.spec_step_ms(b, 3, 1024), rel=1e-3)

    moe = load_profile("kimi-moe")
    spec = _result("spec", {b: moe.spec_step_ms(b, 3, 1024) for b in BATCHES})
    base = _result("base", {b: moe.base_step_ms(b, 1024) for b in BATCHES})
    doc, rows = build_profile([spec, base], "moe", datetime.now(UTC), 10.0, 240.0)
    assert rows is not None and doc["step"]["kind"] == "table"
    profile = write_profile(doc, rows, tmp_path / "moe.json")
    assert (tmp_path / "moe-step-ms.csv").is_file()
    for b in BATCHES:
        assert profile.spec_step_ms(b, 3, 1024) == pytest.approx(moe.spec_step_ms(b, 3, 1024), rel=1e-4)
        assert profile.base_step_ms(b, 1024) == pytest.approx(moe.base_step_ms(b, 1024), rel=1e-4)
    assert load_profile(str(tmp_path / "moe.json")).name == "moe"


def test_batches_left_out_for_bursts_are_a_note_of_the_whole_profile() -> None:
    """A user's probe: on a busy machine base batch 32 came in bursts and the profile rested on
    batches up to 16, said only in a progress line and the server's own notes."""
    from datetime import UTC, datetime

    linear = load_profile("kimi-linear")
    spec = _result("spec", {b: linear.spec_step_ms(b, 3, 1024) for b in BATCHES})
    base = _result("base", {b: linear.base_step_ms(b, 1024) for b in BATCHES if b <= 16})
    base.unreliable = [BatchResult(32, 9.0, 2.0, 30, 32, 1024.0, 1.0, 1.0, bursty=True)]
    base.skipped = [64, 128]
    doc, _ = build_profile([spec, base], "busy", datetime.now(UTC), 10.0, 240.0)
    [note] = [n for n in doc["measured"]["notes"] if "bursts" in n]
    assert note.startswith("base ") and "batches 32, 64, 128 left out" in note and "past batch 16 extrapolated" in note
    quiet, _ = build_profile([spec, _result("base", {1: 5.0, 2: 5.1})], "quiet", datetime.now(UTC), 1.0, 240.0)
    assert not any("bursts" in n for n in quiet["measured"]["notes"])


def test_the_key_can_come_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--api-key-file keeps the servers' key out of ps and shell history; a file without one stops
    the run before any server is asked."""
    from proxy.profiler import read_key_file

    keys = tmp_path / "key"
    keys.write_text("\n  sk-live-1  \nsk-other\n")
    assert read_key_file(keys) == "sk-live-1"
    keys.write_text("\n \n")
    out = tmp_path / "p.json"
    assert main(["profile", "--url", "http://127.0.0.1:1", "--out", str(out), "--api-key-file", str(keys)]) == 2
    assert "holds no key" in capsys.readouterr().err and not out.exists()


def test_an_out_path_that_cannot_be_written_stops_the_run_before_it_measures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's probe: --out under a path that cannot be written measured for the whole budget,
    then lost it all in a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "p.json"
    # An unreachable server: asked at all, the run would fail otherwise (exit 1), and later.
    assert main(["profile", "--url", "http://127.0.0.1:1", "--out", str(out), "--quiet"]) == 2
    # The reason names the path's part that is a file (a review saw "File exists").
    assert f"cannot write {out}" in (said := capsys.readouterr().err) and f"{blocker} is not a folder" in said, said
    assert main(["profile", "--url", "http://127.0.0.1:1", "--out", str(blocker / "deeper" / "p.json"), "--quiet"]) == 2
    assert f"{blocker / 'deeper'} is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [["--budget-s", "-5"], ["--budget-s", "nan"], ["--batches", "3,0,-1"], ["--batches", ","], ["--max-batch", "0"]],
)
def test_nonsense_options_are_a_usage_error(bad: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A negative budget measured one batch and wrote a flat profile; 0 and -1 in --batches were
    dropped without a word."""
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as stopped:
        main(["profile", "--url", "http://127.0.0.1:1", "--out", str(out), *bad])
    assert stopped.value.code == 2 and bad[0] in capsys.readouterr().err and not out.exists()


def test_a_batch_read_long_is_the_one_measured_again() -> None:
    """Interference only adds time: a step off the line through the others is measured again."""

    def batch(b: int, step_ms: float) -> BatchResult:
        return BatchResult(b, step_ms, step_ms, 30, 32, 1024.0, 1.0, 1.0)

    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    line = [batch(b, 10.0 + 0.2 * b) for b in sizes]
    convex = [batch(b, 10.0 + 0.2 * b + 0.002 * b * b) for b in sizes]
    knee = [batch(b, 10.0 + (0.05 * b if b <= 32 else 1.6 + 0.4 * (b - 32))) for b in sizes]
    for curve in (line, convex, knee):  # what GPUs show: nothing to measure again
        assert above_the_line(curve) == []
    slow = [*line[:3], batch(8, 1.13 * (10.0 + 0.2 * 8)), *line[4:]]
    assert [b.batch for b in above_the_line(slow)] == [8]
    assert above_the_line(line[:2]) == []  # no batch between two others


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("server", "preset"), [("sglang", "kimi-moe"), ("vllm", "kimi-moe-vllm")])
def test_a_data_parallel_server_is_measured_one_engine_at_a_time(tmp_path: Path, server: str, preset: str) -> None:
    """A server of two data-parallel ranks spreads its requests (SGLang's in turn, vLLM's to the
    least loaded): 32 streams were two batches of 16, measured as one of 32. Every stream goes
    to rank 0 (x-data-parallel-rank, which both read): the batch measured is one engine's, and
    the cap written is one engine's."""
    out = tmp_path / "dp.json"
    spec = TwinSpec("base", preset, 2.0, server=server, args=("--data-parallel-size", "2"))
    with twins(spec) as (base,):
        scale = None if server == "sglang" else 2.0  # a vLLM twin says no scale: told, as a user would
        rc = run(
            Options(
                urls=[base.url],
                out=out,
                batches=[1, 8, 32, 64],
                prefill_lengths=[256, 1024],
                quiet=True,
                time_scale=scale,
            )
        )
    assert rc == 0
    errors = recovered_errors(out, preset)["base"]
    print({b: f"{100 * e:+.2f} %" for b, e in errors.items()})
    assert set(errors) >= {1, 8} and max(abs(e) for e in errors.values()) <= 0.05, errors
    block = json.loads(out.read_text())["measured"]["servers"][0]
    assert block["max_running_requests"] == 256 and block["data_parallel_ranks"]["ranks"] == 2


def test_a_table_of_one_side_derives_the_other_from_the_lines(tmp_path: Path) -> None:
    """A review's probe: a base server alone, measured as a table, repeated its steps for the spec
    side, so the router saw speculation as free (spec's step 19 ms at batch 8 where the twin's is
    37). The side not measured is the measured one scaled by the two sides' lines, as the affine
    kind derives them."""
    from datetime import UTC, datetime

    moe = load_profile("kimi-moe")
    base = _result("base", {b: moe.base_step_ms(b, 1024) for b in BATCHES})
    doc, rows = build_profile([base], "base-only", datetime.now(UTC), 10.0, 240.0)
    assert rows is not None and doc["step"]["kind"] == "table"
    profile = write_profile(doc, rows, tmp_path / "base-only.json")
    fixed, per_token = fit_line([float(b) for b in BATCHES], [moe.base_step_ms(b, 1024) for b in BATCHES])
    for b in BATCHES:
        assert profile.base_step_ms(b, 1024) == pytest.approx(moe.base_step_ms(b, 1024), rel=1e-4)
        measured = moe.base_step_ms(b, 1024)  # scaled by the lines' ratio: the curve's shape kept
        derived = measured * (fixed + per_token * 4 * b) / (fixed + per_token * b)
        assert profile.spec_step_ms(b, 3, 1024) == pytest.approx(derived, rel=1e-3)
        assert profile.spec_step_ms(b, 3, 1024) > profile.base_step_ms(b, 1024)
    assert any("no spec server measured" in note for note in doc["measured"]["notes"])
    # The other way: a spec server alone. Off the curve, a line put base above spec at small
    # batches (22.1 ms against spec's 21.0 at batch 1 on kimi-moe): the router would have seen
    # speculation as cheaper than plain decoding.
    spec = _result("spec", {b: moe.spec_step_ms(b, 3, 1024) for b in BATCHES})
    doc, rows = build_profile([spec], "spec-only", datetime.now(UTC), 10.0, 240.0)
    assert rows is not None
    profile = write_profile(doc, rows, tmp_path / "spec-only.json")
    for b in BATCHES:
        assert profile.base_step_ms(b, 1024) < profile.spec_step_ms(b, 3, 1024), b
    # A spec server that names no draft steps: 3 assumed, said (the table divided by zero).
    spec.server.num_steps = 0
    doc, rows = build_profile([spec], "no-k", datetime.now(UTC), 10.0, 240.0)
    assert write_profile(doc, rows, tmp_path / "no-k.json").name == "no-k"
    assert any("3 assumed" in note for note in doc["measured"]["notes"])


def test_each_run_sends_prompts_of_its_own() -> None:
    """A review's probe: every run sent the same "random" prompts (seed 0), so a second run against
    the same server timed its prefill from the prefix cache: 0.00035 ms a token against 0.0256."""
    runs = [Profiler(Options(urls=[], out=Path("p.json"))) for _ in range(2)]
    try:
        assert runs[0].prompt(64) != runs[1].prompt(64)
        seeded = [Profiler(Options(urls=[], out=Path("p.json"), seed=5)) for _ in range(2)]
        assert seeded[0].prompt(64) == seeded[1].prompt(64)  # asked for, the same ones
    finally:
        for profiler in runs + seeded:
            asyncio.run(profiler.close())


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://h:99999", "Port out of range"),
        ("http://user:secret@[::1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:30000?token=secret", "has a query"),
        ("localhost:30000", "not an http:// or https:// URL"),
        ("http://user:secret@gpu-a:30000", "carries credentials"),
        ("http://gpu-a:30000/v1", "ends in /v1"),
    ],
)
def test_a_url_that_is_no_base_url_is_one_line(url: str, said: str, tmp_path: Path, capsys) -> None:
    """A review's probe: each was a traceback (the query one after asking /v1/models?token=X/...).
    The check is the one the pools' URLs get (`proxy.settings.server_url_problem`)."""
    assert main(["profile", "--url", url, "--out", str(tmp_path / "p.json"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and said in err and "secret" not in err


def test_a_server_that_is_no_llm_server_or_goes_away_is_one_line(tmp_path: Path, capsys) -> None:
    """A review's probe: a static page answering /v1/models, and a server killed mid-stream, each
    ended the run in a traceback."""
    from proxy_faults import FaultServer

    with FaultServer("drop", probe="/get_load") as gone:
        server = Server(gone.url, gone.url, "sglang", SGLang("/v1/loads"), "m", False, 0, 48)
        profiler = Profiler(Options(urls=[gone.url], out=tmp_path / "p.json"))

        async def one() -> None:
            try:
                await profiler.stream(server, 16, 1)
            finally:
                await profiler.close()

        with pytest.raises(ProfileError, match="/v1/completions: RemoteProtocolError"):
            asyncio.run(one())
    with FaultServer("echo", probe="/v1/models", load_text="<html>a web UI</html>") as page:
        assert main(["profile", "--url", page.url, "--out", str(tmp_path / "p.json"), "--quiet"]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "no list of models" in err


def test_an_out_path_that_is_a_folder_or_unwritable_is_said_before_measuring(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "p.json"
    folder.mkdir()
    assert main(["profile", "--url", "http://127.0.0.1:1", "--out", str(folder), "--quiet"]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["profile", "--url", "http://127.0.0.1:1", "--out", "/proc/p.json", "--quiet"]) == 2
    assert "not writable" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_ctrl_c_says_so_writes_nothing_and_frees_the_servers_streams(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    with twin("base", "kimi-linear", time_scale=4.0) as base:
        argv = [sys.executable, "-m", "proxy.cli", "profile", "--url", base.url, "--out", str(out)]
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        try:
            running = base.url + "/v1/loads"
            wait_for(lambda: httpx.get(running).json()["loads"][0]["num_running_reqs"] > 0, "the profiler's streams")
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == 130
        assert "interrupted after" in err and "nothing written" in err and "Traceback" not in err
        assert not out.exists()
        wait_for(lambda: httpx.get(running).json()["loads"][0]["num_running_reqs"] == 0, "the streams closed")


def test_progress_shows_a_short_budget_as_it_is() -> None:
    shown = io.StringIO()
    Progress(0.5, out=shown).line("x")
    Progress(240, out=shown).line("y")
    assert "/0.5 s  x" in shown.getvalue() and "/240 s  y" in shown.getvalue()
