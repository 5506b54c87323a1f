"""Small prepared datasets for tests, made with `diloco data prepare`'s own code."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.data.manifest import Manifest
from diloco.data.prepare import PrepareOptions, prepare


def make_dataset(
    folder: Path, *, documents: int = 200, shard_tokens: int = 4096, words: int = 60
) -> Manifest:
    """A byte-level dataset of ``documents`` short jsonl documents in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder.parent / f"{folder.name}-corpus.jsonl"
    lines = []
    for i in range(documents):
        text = " ".join(f"w{(i * 7 + j * 13) % 97}" for j in range(words))
        lines.append(json.dumps({"text": f"document {i}: {text}"}) + "\n")
    corpus.write_text("".join(lines), encoding="utf-8")
    opts = PrepareOptions(shard_tokens=shard_tokens, val_block=1024, val_every=20, val_tokens=4096)
    return prepare([corpus], folder, opts).manifest
