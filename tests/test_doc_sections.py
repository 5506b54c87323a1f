"""bench/doc_sections.py: a benchmark script rewrites its own section of docs/benchmarks.md
and nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

from .support.cli import REPO

sys.path.insert(0, str(REPO / "bench"))
from doc_sections import replace_section

GPT_BEGIN, ATTACKS_BEGIN = "<!-- begin convergence-gpt -->", "<!-- begin attacks -->"


def test_rewriting_a_section_leaves_every_other_byte_as_it_was(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    replace_section(doc, "convergence-gpt", "## GPT\n\nold table\n")
    replace_section(doc, "attacks", "## Attacks\n\nfigures\n")
    # text written by hand around and between the sections
    doc.write_text("# Benchmarks\n\nintro by hand\n\n" + doc.read_text().split("\n", 2)[2]
                   + "\nnotes by hand\n")  # fmt: skip
    before = doc.read_text()

    replace_section(doc, "convergence-llama", "## Llama\n\nnew\n", after="convergence-gpt")
    replace_section(doc, "convergence-gpt", "## GPT\n\nnew table, longer\nand more\n")

    after = doc.read_text()
    assert "old table" not in after and "new table, longer\nand more" in after
    # the llama section sits right after the GPT's, before the attacks
    assert after.index("## GPT") < after.index("## Llama") < after.index("## Attacks")
    # everything before the GPT section and from the attacks section on is unchanged
    for text in (before, after):
        assert text.count(GPT_BEGIN) == 1 and text.count(ATTACKS_BEGIN) == 1
    assert after.split(GPT_BEGIN)[0] == before.split(GPT_BEGIN)[0]
    assert after.split(ATTACKS_BEGIN)[1] == before.split(ATTACKS_BEGIN)[1]
    assert after.startswith("# Benchmarks\n\nintro by hand\n") and after.endswith("notes by hand\n")


def test_the_real_doc_has_each_benchmark_section_once() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    begins = [line for line in text.splitlines() if line.startswith("<!-- begin ")]
    keys = [line.removeprefix("<!-- begin ").removesuffix(" -->") for line in begins]
    assert len(keys) == len(set(keys)) and "convergence-llama" in keys
    for key in keys:
        assert text.count(f"<!-- end {key} -->") == 1
