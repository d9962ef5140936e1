"""What one choice carries, step by step: plain text, a JSON document, or a tool call's arguments,
and per-token logprobs when asked.

The engine produces words (sim/text.py), one per token. A choice turns each step's words into
the pieces of its output, one piece per token, so a stream still sends one chunk per step:
- plain text: the words themselves;
- JSON (response_format json_object / json_schema, and a forced tool call's arguments): each token
  writes the next piece of a JSON object, a key or a literal value, or one word of a string value,
  so the text so far is always a prefix of a valid document. When the sequence ends on its own
  ("stop") the document is closed; when max_tokens cuts it ("length") it stays cut, as a real
  model's would.
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from typing import Any

from sim.protocol import ChatCompletionRequest, CompletionRequest, forced_tool, json_schema_of
from sim.text import VOCABULARY

TOKEN = re.compile(r"\s*\S+|\s+")
"""A token of the engine's text: a word with its leading space (sim/text.py)."""

Fields = list[tuple[str, str | None]]
"""A JSON object to write: (key, literal JSON value) or (key, None) for a string of words."""


class JsonDoc:
    """A JSON object written one token at a time: a key opener, a literal value, or one word of a
    string value per token; `counts` gives the words of each string field."""

    __slots__ = ("fields", "counts", "field", "word", "opened", "done")

    def __init__(self, fields: Fields, counts: dict[int, int]):
        self.fields = fields
        self.counts = counts
        self.field = 0
        self.word = 0
        self.opened = False  # the current field's key is written
        self.done = False

    @property
    def length(self) -> int:
        """Tokens in the whole document."""
        return 1 + len(self.fields) + sum(self.counts.get(i, 1) for i in range(len(self.fields)))

    def next(self, word: str) -> str:
        if self.done:
            return ""
        if self.field == len(self.fields):
            self.done = True
            return "{}" if not self.fields else "}"
        key, literal = self.fields[self.field]
        if not self.opened:
            self.opened = True
            return ("{" if self.field == 0 else ", ") + json.dumps(key) + ": "
        if literal is not None:
            self._next_field()
            return literal
        m, j = self.counts[self.field], self.word
        self.word += 1
        if self.word >= m:
            self._next_field()
        return ('"' if j == 0 else " ") + json.dumps(word.strip())[1:-1] + ('"' if j == m - 1 else "")

    def close(self) -> list[str]:
        """The rest of the document, shortest way: an open string is closed, fields not written
        get an empty string (or their literal)."""
        if self.done:
            return []
        out = []
        if self.opened and self.word:
            out.append('"')
            self._next_field()
        while self.field < len(self.fields):
            key, literal = self.fields[self.field]
            if not self.opened:
                out.append(("{" if self.field == 0 else ", ") + json.dumps(key) + ": ")
            out.append(literal if literal is not None else '""')
            self._next_field()
        out.append("{}" if not self.fields else "}")
        self.done = True
        return out

    def _next_field(self) -> None:
        self.field += 1
        self.word = 0
        self.opened = False


def object_fields(schema: dict[str, Any] | None, rng: random.Random, default: str | None) -> Fields:
    """The fields of a JSON object for `schema`: every property, strings as words, the rest as
    plausible literals; `default` names one string field when the schema gives no properties."""
    props = (schema or {}).get("properties")
    if not isinstance(props, dict) or not props:
        return [(default, None)] if default else []
    fields: Fields = []
    for key, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        if schema_type(sub) == "string" and "enum" not in sub and "const" not in sub:
            fields.append((str(key), None))
        else:
            fields.append((str(key), json.dumps(sample_value(sub, rng, depth=0))))
    return fields


def schema_type(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind


def sample_value(schema: dict[str, Any], rng: random.Random, depth: int) -> Any:
    """A plausible value for a (sub)schema."""
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key] and isinstance(schema[key][0], dict):
            return sample_value(schema[key][0], rng, depth)
    kind = schema_type(schema)
    if kind == "integer":
        return rng.randint(int(schema.get("minimum", 0)), int(schema.get("maximum", 100)))
    if kind == "number":
        return round(rng.uniform(float(schema.get("minimum", 0)), float(schema.get("maximum", 100))), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            items = {"type": "string"}
        return [sample_value(items, rng, depth + 1) for _ in range(max(int(schema.get("minItems", 1)), 1))]
    if kind == "object" or "properties" in schema:
        props = schema.get("properties")
        if not isinstance(props, dict):
            props = {}
        if depth > 4:
            return {}
        return {str(k): sample_value(v if isinstance(v, dict) else {}, rng, depth + 1) for k, v in props.items()}
    return rng.choice(VOCABULARY)


def spread(total: int, fields: Fields) -> dict[int, int]:
    """Share `total` words among the string fields, at least one each."""
    strings = [i for i, (_, literal) in enumerate(fields) if literal is None]
    if not strings:
        return {}
    base, extra = divmod(max(total, len(strings)), len(strings))
    return {i: base + (1 if rank < extra else 0) for rank, i in enumerate(strings)}


class Logprobs:
    """Plausible log-probabilities for the tokens of one choice: the sampled token is usually the
    most likely one; the alternatives share the rest of the mass, most likely first."""

    __slots__ = ("rng", "top", "legacy", "offset")

    def __init__(self, rng: random.Random, top: int, legacy: bool):
        self.rng = rng
        self.top = top
        self.legacy = legacy
        self.offset = 0  # legacy text_offset: characters of the completion so far

    def _entry(self, token: str) -> list[tuple[str, float]]:
        rng = self.rng
        p = math.exp(-rng.expovariate(2.5))
        ranked = [(token, max(math.log(p), -20.0))]
        rest = 1.0 - p
        lead = " " if token[:1].isspace() else ""
        while len(ranked) < max(self.top, 1):
            alt = lead + rng.choice(VOCABULARY)
            if any(alt == t for t, _ in ranked):
                continue
            share = rest * rng.uniform(0.3, 0.7)
            rest -= share
            ranked.append((alt, max(math.log(share) if share > 0 else -20.0, -20.0)))
        return ranked

    def render(self, tokens: list[str]) -> dict[str, Any]:
        entries = [self._entry(token) for token in tokens]
        if self.legacy:
            offsets = []
            for token in tokens:
                offsets.append(self.offset)
                self.offset += len(token)
            return {
                "tokens": tokens,
                "token_logprobs": [ranked[0][1] for ranked in entries],
                "top_logprobs": [dict(sorted(ranked, key=lambda e: -e[1])[: self.top]) for ranked in entries],
                "text_offset": offsets,
            }
        return {
            "content": [
                {
                    "token": token,
                    "logprob": ranked[0][1],
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())}
                        for t, lp in sorted(ranked, key=lambda e: -e[1])[: self.top]
                    ],
                }
                for token, ranked in zip(tokens, entries)
            ]
        }


TOOL_ARGUMENT_WORDS = (1, 3)
"""Words in each string argument of a forced tool call (a short, natural call)."""


class ChoiceShape:
    """The output of one choice: feed it each step's engine text, get that step's pieces."""

    __slots__ = ("index", "doc", "tool_name", "tool_id", "logprobs", "output_len", "_fields")

    def __init__(self, request: ChatCompletionRequest | CompletionRequest, index: int, rid: str):
        self.index = index
        seed = request.seed + index if request.seed is not None else f"{rid}:{index}"
        rng = random.Random(seed)
        self.doc: JsonDoc | None = None
        self.tool_name: str | None = None
        self.tool_id: str | None = None
        self.output_len: int | None = None
        """A natural length the engine must use (a forced tool call ends when its call is written)."""
        self._fields: Fields | None = None
        tool = forced_tool(request)
        fmt = request.response_format
        if tool is not None:
            self.tool_name = tool.function.name
            self.tool_id = f"call_{uuid.uuid4().hex[:24]}"
            fields = object_fields(tool.function.parameters, rng, default=None)
            counts = {i: rng.randint(*TOOL_ARGUMENT_WORDS) for i, (_, lit) in enumerate(fields) if lit is None}
            self.doc = JsonDoc(fields, counts)
            self.output_len = self.doc.length
        elif fmt is not None and fmt.type != "text":
            schema = json_schema_of(fmt) if fmt.type == "json_schema" else None
            self._fields = object_fields(schema, rng, default="answer")
        top = None
        if isinstance(request, ChatCompletionRequest):
            if request.logprobs:
                top = request.top_logprobs or 0
        elif request.logprobs:
            top = request.logprobs
        self.logprobs = Logprobs(rng, top, isinstance(request, CompletionRequest)) if top is not None else None

    def bind(self, target_len: int, ends_by_length: bool) -> None:
        """Plan a JSON answer to the sequence's length: it ends with the sequence, or, when the
        sequence will be cut, runs past the cut."""
        if self._fields is not None:
            structure = 1 + len(self._fields) + sum(1 for _, lit in self._fields if lit is not None)
            words = target_len - structure + (1 if ends_by_length else 0)
            self.doc = JsonDoc(self._fields, spread(words, self._fields))

    def feed(self, text: str, done: bool, finish_reason: str | None) -> list[str]:
        """This step's pieces, one per token."""
        tokens = TOKEN.findall(text)
        if self.doc is None:
            return tokens
        pieces = [self.doc.next(word) for word in tokens]
        if done and finish_reason == "stop":
            pieces += self.doc.close()
        return [p for p in pieces if p]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.tool_name is not None else reason

    def render(
        self,
        kind: str,
        pieces: list[str],
        finish_reason: str | None,
        matched_stop: Any,
        *,
        stream: bool,
        first: bool = False,
    ) -> dict[str, Any]:
        """The choice object of a response (stream: of one chunk) carrying `pieces`; `first`: the
        choice's first piece (a tool call's opens with its id and name)."""
        text = "".join(pieces)
        body: dict[str, Any] = {"index": self.index}
        if kind != "chat":
            body["text"] = text
        elif stream:
            delta: dict[str, Any] = {}
            if self.tool_name is None:
                delta["content"] = text
            elif first:
                delta["tool_calls"] = [self._tool_call(text) | {"index": 0}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            body["delta"] = delta
        else:
            calls = [self._tool_call(text)] if self.tool_name is not None else None
            body["message"] = {"role": "assistant", "content": None if calls else text, "reasoning_content": None}
            if calls is not None:  # SGLang's ChatMessage leaves out a None tool_calls
                body["message"]["tool_calls"] = calls
        body["logprobs"] = self.logprobs.render(pieces) if self.logprobs is not None else None
        body["finish_reason"] = self.finish_reason(finish_reason)
        body["matched_stop"] = matched_stop
        return body

    def _tool_call(self, arguments: str) -> dict[str, Any]:
        return {"id": self.tool_id, "type": "function", "function": {"name": self.tool_name, "arguments": arguments}}
