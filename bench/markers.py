"""Benchmarks write their results into docs/ between a pair of HTML comment markers; the sweeps
that do share their command line (`sweep_parser`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def sweep_parser(module: str, doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """The command line of a sweep that writes docs/: `--quick` (a smoke test: `quick_help`),
    `--jobs` (worker processes, 2 at most by default) and `--no-write` (print the results)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--no-write", action="store_true", help="print the results instead of writing docs/")
    return parser


def write_section(doc: Path, section: str, start: str, end: str, title: str = "Results") -> None:
    """Replace what lies between `start` and `end` in `doc` with `section`; a page without the
    markers gets them appended under a `## {title}` heading (created if missing)."""
    text = doc.read_text() if doc.exists() else f"# {doc.stem.capitalize()}\n"
    if start not in text or end not in text:
        text = text.rstrip() + f"\n\n## {title}\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{section}\n{end}{tail}")
