"""The repository stands alone: nothing in it refers to a folder beside the checkout.

A fresh clone has only what git tracks, so no tracked file may name the workspace's shared
folder (its spec, its data) by any path, relative or absolute. The corpora the README, the
tests and the benches read live in examples/data (tests/support/corpora.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OUTSIDE = re.compile(
    r"\.\./shared\b"  # a relative path up and into it
    r"|/work/+shared\b"  # the workspace's absolute path
    r"|\bshared/+(?:data|SPEC|STYLE|hooks)\b"  # its files, from anywhere
    r"|/\s*[\"']shared[\"']|[\"']shared[\"']\s*/"  # a path built in Python, part by part
    r"|DILOCO_SHARED_DATA\b"  # the variable that pointed the tests there
)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    files = [REPO / n.decode() for n in names if n]
    return [f for f in files if f.is_file() and b"\0" not in f.read_bytes()[:8192]]


def outside_references(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def test_the_pattern_finds_every_way_of_naming_the_shared_folder_and_nothing_else():
    bad = [
        "see ../shared/SPEC.md",
        "diloco data prepare ../../shared/data/tinyshakespeare.txt",
        "Path('/work/shared/data')",
        "REPO.parent / 'shared' / 'data'",
        'Path(__file__).parents[2] / "shared"',
        "export DILOCO_SHARED_DATA=/tmp",
        "open('shared/data/input.txt')",
    ]
    fine = [
        "shared memory",
        "a 8.0 GiB budget shared by the concurrent closes",
        "2 cores shared with other work",
        "the shared Tiny Shakespeare corpus",
        "shared_data = 1",
        "tmp_path / 'shared-data'",
    ]
    assert [line for line in bad if not outside_references(line)] == []
    assert [line for line in fine if outside_references(line)] == []


def test_no_tracked_file_refers_to_the_shared_folder_outside_the_repository():
    # this file names what it forbids, in its examples
    files = [f for f in tracked_text_files() if f != Path(__file__).resolve()]
    assert any(f.name == "README.md" for f in files)  # the walk sees the files it must
    found = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
        if outside_references(line)
    ]
    assert found == [], "\n".join(found)


def test_the_shipped_corpora_are_tracked_with_their_licence_note():
    from tests.support.corpora import DATA, EXCERPT, TINYSHAKESPEARE

    tracked = {f.relative_to(REPO) for f in tracked_text_files()}
    for path in (TINYSHAKESPEARE, EXCERPT, DATA / "README.md"):
        assert path.relative_to(REPO) in tracked, path
    note = (DATA / "README.md").read_text()
    assert "public domain" in note.lower() and TINYSHAKESPEARE.name in note
