"""Benchmark scripts own sections of docs/benchmarks.md, not the file.

A script's section sits between ``<!-- begin KEY -->`` and ``<!-- end KEY -->``; writing it
again replaces only that span, so one script's run never clobbers another's figures. A
section not there yet goes after the one named by ``after`` (or at the end).
"""

from __future__ import annotations

from pathlib import Path


def markers(key: str) -> tuple[str, str]:
    return f"<!-- begin {key} -->", f"<!-- end {key} -->"


def replace_section(doc: Path, key: str, body: str, *, after: str | None = None) -> None:
    """Write ``body`` as section ``key`` of ``doc`` (created if missing)."""
    begin, end = markers(key)
    block = f"{begin}\n{body.strip()}\n{end}\n"
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].removeprefix("\n")
        text = head + block + tail
    elif after is not None and markers(after)[1] in text:
        head, tail = text.split(markers(after)[1], 1)
        text = head + markers(after)[1] + "\n\n" + block + tail.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")
