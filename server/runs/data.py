"""A run's data: the uploaded text file becomes a validation blob and training shard blobs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.config import RunConfig
from diloco.data import DataError, load_tokens, split_tokens
from server.errors import InvalidData
from server.storage import Storage


def val_key(run_id: str) -> str:
    return f"runs/{run_id}/data/val.bin"


def shard_key(run_id: str, index: int) -> str:
    return f"runs/{run_id}/data/shard-{index}.bin"


def _put(storage: Storage, key: str, tensor: torch.Tensor) -> dict[str, Any]:
    raw = tensor.contiguous().numpy().tobytes()
    with storage.writer(key) as w:
        w.write(raw)
        w.commit()
    return {"sha256": hashlib.sha256(raw).hexdigest(), "nbytes": len(raw)}


def split_and_store(
    storage: Storage, *, run_id: str, cfg: RunConfig, source: Path, n_shards: int
) -> dict[str, Any]:
    """Split ``source`` as the config says and store the parts; returns what the run row keeps."""
    try:
        tokens = load_tokens(source)
        ds = split_tokens(
            tokens,
            val_fraction=cfg.data.val_fraction,
            n_shards=n_shards,
            block_size=cfg.model.block_size,
            chunk_size=cfg.data.chunk_size,
        )
    except DataError as err:
        raise InvalidData(f"data: {err}") from None
    _put(storage, val_key(run_id), ds.val)
    shards = [_put(storage, shard_key(run_id, i), s) for i, s in enumerate(ds.shards)]
    return {
        "shards": shards,
        "n_shards": len(shards),
        "chunk_len": ds.chunk_len,
        "train_tokens": ds.train_tokens,
        "val_tokens": int(ds.val.numel()),
    }


def load_val(storage: Storage, run_id: str) -> torch.Tensor:
    raw = storage.read_bytes(val_key(run_id))
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
