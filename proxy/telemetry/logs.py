"""One JSON line per request on the "specroute.request" logger. Never a prompt or a completion."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

LOGGER_NAME = "specroute.request"


def request_logger() -> logging.Logger:
    """The request logger, writing bare JSON lines to stdout unless the host app configured it."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # the line is already complete; root handlers would re-wrap it
    return logger


def write(logger: logging.Logger, record: dict[str, Any]) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info(orjson.dumps(record, default=str).decode())
