"""The corpora shipped in the repository (examples/data; its README.md says where they come
from and under which licence). Tests and benches name them from here, so a fresh clone has
everything they read."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
TINYSHAKESPEARE = DATA / "tinyshakespeare.txt"  # 1,115,394 bytes, char-rnn's distribution
EXCERPT = DATA / "shakespeare-excerpt.txt"  # its first 300,000 bytes
