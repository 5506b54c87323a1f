"""A run's data: the uploaded text file becomes a validation blob and training shard blobs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.config import RunConfig
from diloco.data.manifest import token_dtype
from diloco.data.text import DataError, load_tokens, split_tokens
from server.http.errors import InvalidData
from server.storage import keys
from server.storage.base import Storage


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
    _put(storage, keys.val(run_id), ds.val)
    shards = [_put(storage, keys.shard(run_id, i), s) for i, s in enumerate(ds.shards)]
    return {
        "shards": shards,
        "n_shards": len(shards),
        "chunk_len": ds.chunk_len,
        "train_tokens": ds.train_tokens,
        "val_tokens": int(ds.val.numel()),
    }


def load_val(storage: Storage, run_id: str, cfg: RunConfig, *, tokens: int) -> torch.Tensor:
    """The first ``tokens`` validation tokens (all of a shorter file) as int64: a text
    run's uint8 tail, or a dataset's val.bin in its dtype. Only that prefix is read."""
    key = keys.validation(run_id, cfg.data.dataset)
    dtype = np.dtype(np.uint8)
    if cfg.data.dataset is not None:
        dtype = np.dtype(token_dtype(cfg.model.vocab)).newbyteorder("<")
    want, raw = tokens * dtype.itemsize, bytearray()
    for chunk in storage.read_chunks(key):
        raw += chunk
        if len(raw) >= want:
            break
    usable = min(len(raw), want) // dtype.itemsize * dtype.itemsize
    return torch.from_numpy(np.frombuffer(bytes(raw[:usable]), dtype=dtype).astype(np.int64))
