"""Data: a text file becomes uint8 tokens, a validation split and K disjoint training shards.

Byte-level tokens mean no tokenizer: token = byte. The validation split is the tail of
the file (a contiguous block, so no training window overlaps it); the rest is cut into
K contiguous, disjoint shards, one per worker. Batches are random windows drawn from one
shard with the caller's seeded generator, so a run is reproducible.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class DataError(ValueError):
    """The corpus cannot be split as asked (too small, empty, ...)."""


def load_tokens(path: str | Path) -> torch.Tensor:
    """The file's bytes as a uint8 tensor (vocabulary 256)."""
    raw = Path(path).read_bytes()
    if not raw:
        raise DataError(f"{path}: the data file is empty")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())


@dataclass(frozen=True)
class Dataset:
    val: torch.Tensor  # uint8 (N_val,)
    shards: tuple[torch.Tensor, ...]  # K x uint8 (N_shard,), disjoint

    @property
    def train_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.shards)


def split_tokens(
    tokens: torch.Tensor, *, val_fraction: float, n_shards: int, block_size: int
) -> Dataset:
    """Validation tail + ``n_shards`` disjoint contiguous training shards."""
    if n_shards < 1:
        raise DataError(f"n_shards must be >= 1, got {n_shards}")
    n = int(tokens.numel())
    n_val = int(n * val_fraction)
    if n_val < block_size + 1:
        raise DataError(
            f"validation split has {n_val} tokens, fewer than one window of "
            f"block_size + 1 = {block_size + 1}; use a larger file or val_fraction"
        )
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    shard_len = train.numel() // n_shards
    if shard_len < block_size + 1:
        raise DataError(
            f"each of {n_shards} shards would hold {shard_len} tokens, fewer than one window "
            f"of block_size + 1 = {block_size + 1}; use a larger file or fewer shards"
        )
    shards = tuple(train[i * shard_len : (i + 1) * shard_len] for i in range(n_shards))
    return Dataset(val=val, shards=shards)


def random_batch(
    shard: torch.Tensor, *, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs (B, T) and next-byte targets (B, T), int64."""
    starts = torch.randint(0, shard.numel() - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = shard[starts[:, None] + offsets].long()  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def eval_batches(
    val: torch.Tensor, *, batch_size: int, block_size: int, max_windows: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows over the validation split, in order: deterministic eval."""
    n_windows = (val.numel() - 1) // block_size
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    for first in range(0, n_windows, batch_size):
        idx = torch.arange(first, min(first + batch_size, n_windows))
        windows = val[idx[:, None] * block_size + torch.arange(block_size + 1)].long()
        yield windows[:, :-1], windows[:, 1:]
