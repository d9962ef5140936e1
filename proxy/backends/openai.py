"""A plain OpenAI-compatible server (or any server that answers no load endpoint): the proxy
counts its own requests there as its load and checks it is alive on GET /health."""

from __future__ import annotations

from proxy.backends.base import Backend


class OpenAICompatible(Backend):
    kind = "openai"
