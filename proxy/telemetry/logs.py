"""One JSON line per request on stdout (`RequestLog`), never a prompt or a completion; and the
formats of the other log lines, on stderr (`log_formatter`: text or JSON, SPECROUTE_LOG_FORMAT).

Written straight to the stream, not through `logging`: a LogRecord per request (caller lookup,
thread and process names, a lock, a flush) cost about ten times the line itself, a few percent
of the proxy's CPU per request. Each line is one write of well under PIPE_BUF bytes, so lines from
one process never interleave.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, BinaryIO

import orjson


class RequestLog:
    def __init__(self, stream: BinaryIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout.buffer

    def write(self, record: dict[str, Any]) -> None:
        self.stream.write(orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE))
        self.stream.flush()


class TextLogFormatter(logging.Formatter):
    """A log record as `2026-12-06T15:24:17.123Z LEVEL logger: message` (UTC, as the request
    log's `ts`), with `source` before the logger when given (the span export process's lines)."""

    converter = staticmethod(time.gmtime)

    def __init__(self, source: str = "") -> None:
        where = f"{source} " if source else ""
        super().__init__(f"%(asctime)s.%(msecs)03dZ %(levelname)s {where}%(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")


class JsonLogFormatter(logging.Formatter):
    """A log record as one JSON object: `ts` (seconds since the epoch, as the request log's),
    `level`, `logger`, `message`, `exception` (its traceback) when there is one, and `source`
    when given (the span export process's lines)."""

    def __init__(self, source: str = "") -> None:
        super().__init__()
        self.source = source

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.source:
            line["source"] = self.source
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def log_formatter(fmt: str, source: str = "") -> logging.Formatter:
    """The formatter of SPECROUTE_LOG_FORMAT `fmt` (text or json)."""
    return JsonLogFormatter(source) if fmt == "json" else TextLogFormatter(source)
