"""One JSON line per request on stdout. Never a prompt or a completion.

Written straight to the stream, not through `logging`: a LogRecord per request (caller lookup,
thread and process names, a lock, a flush) cost about ten times the line itself, a few percent
of the proxy's CPU per request. Each line is one write of well under PIPE_BUF bytes, so lines from
one process never interleave.
"""

from __future__ import annotations

import sys
from typing import Any, BinaryIO

import orjson


class RequestLog:
    def __init__(self, stream: BinaryIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout.buffer

    def write(self, record: dict[str, Any]) -> None:
        self.stream.write(orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE))
        self.stream.flush()
