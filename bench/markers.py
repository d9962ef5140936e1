"""Benchmarks write their results into docs/ between a pair of HTML comment markers."""

from __future__ import annotations

from pathlib import Path


def write_section(doc: Path, section: str, start: str, end: str, title: str = "Results") -> None:
    """Replace what lies between `start` and `end` in `doc` with `section`; a page without the
    markers gets them appended under a `## {title}` heading (created if missing)."""
    text = doc.read_text() if doc.exists() else f"# {doc.stem.capitalize()}\n"
    if start not in text or end not in text:
        text = text.rstrip() + f"\n\n## {title}\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{section}\n{end}{tail}")
