"""Server kinds behind one seam: each module knows one kind's endpoints and reads its answers
into the fleet model's readings (fleet/readings.py). proxy/poller.py does the I/O.

Adding a kind is one new module with a `Backend` subclass, plus its line in `KINDS` (the order
in which a server's answers are tried against the kinds when it is learned).
"""

from __future__ import annotations

from proxy.backends.base import Backend
from proxy.backends.openai import OpenAICompatible
from proxy.backends.sglang import SGLang
from proxy.backends.vllm import VLLM

KINDS: tuple[type[Backend], ...] = (SGLang, VLLM, OpenAICompatible)


def load_paths() -> tuple[str, ...]:
    """Every kind's load endpoints, once each, in the order they are tried when learning."""
    paths: list[str] = []
    for kind in KINDS:
        paths += [path for path in kind.load_paths if path not in paths]
    return tuple(paths)


def describers() -> tuple[type[Backend], ...]:
    """The kinds that describe themselves (an `info_path`), in `KINDS` order."""
    return tuple(kind for kind in KINDS if kind.info_path)


def recognise(path: str, text: str) -> Backend | None:
    """The kind whose load endpoint `path` gave this 200 answer, set up to poll it; None if no
    kind reads it."""
    for kind in KINDS:
        if path in kind.load_paths and kind.recognises(path, text):
            return kind(path)
    return None


__all__ = ["KINDS", "Backend", "OpenAICompatible", "SGLang", "VLLM", "describers", "load_paths", "recognise"]
