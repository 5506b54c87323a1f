"""Data: a text file becomes uint8 tokens, a validation split and K disjoint training shards.

Byte-level tokens mean no tokenizer: token = byte. The validation split is the tail of
the file (a contiguous block, so no training window overlaps it). The rest is cut into
chunks of ``chunk_size`` bytes dealt round-robin to K disjoint shards, so that every
shard samples the whole corpus (DiLoCo's i.i.d. setting: with one contiguous block per
worker, each worker would see only a few of Shakespeare's plays and drift towards them).
``chunk_size = 0`` gives one contiguous block per shard, the harder non-i.i.d. setting.
A shard is a (n_chunks, chunk_len) tensor; batches are random windows inside one chunk,
drawn with the caller's seeded generator, so a run is reproducible and no window
straddles two chunks that were not neighbours in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco.config import RunConfig
from diloco.data.manifest import ManifestError, read_manifest


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
    shards: tuple[torch.Tensor, ...]  # K x uint8 (n_chunks, chunk_len), disjoint
    # a prepared dataset: its training tokens (int32, its shards in order) and each shard's
    # size, from which the simulator deals data units as the server does (diloco.data.units)
    train: torch.Tensor | None = None
    shard_tokens: tuple[int, ...] = ()

    @property
    def train_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.shards)

    @property
    def chunk_len(self) -> int:
        return int(self.shards[0].shape[1])


def split_tokens(
    tokens: torch.Tensor,
    *,
    val_fraction: float,
    n_shards: int,
    block_size: int,
    chunk_size: int = 0,
) -> Dataset:
    """Validation tail + ``n_shards`` disjoint training shards of whole chunks.

    ``chunk_size`` > 0: chunks of that many bytes dealt round-robin (i.i.d.-like shards);
    0, or a corpus smaller than one chunk per shard: one contiguous chunk per shard.
    A remainder too small to share evenly is dropped.
    """
    if n_shards < 1:
        raise DataError(f"n_shards must be >= 1, got {n_shards}")
    if 0 < chunk_size < block_size + 1:
        raise DataError(
            f"chunk_size {chunk_size} must be at least block_size + 1 = {block_size + 1}"
        )
    n = int(tokens.numel())
    n_val = int(n * val_fraction)
    if n_val < block_size + 1:
        raise DataError(
            f"validation split has {n_val} tokens, fewer than one window of "
            f"block_size + 1 = {block_size + 1}; use a larger file or val_fraction"
        )
    train, val = tokens[: n - n_val], tokens[n - n_val :]
    return Dataset(
        val=val,
        shards=deal_shards(train, n_shards=n_shards, block_size=block_size, chunk_size=chunk_size),
    )


def deal_shards(
    train: torch.Tensor, *, n_shards: int, block_size: int, chunk_size: int
) -> tuple[torch.Tensor, ...]:
    """``n_shards`` disjoint training shards of whole chunks of ``train`` (see
    ``split_tokens``); a remainder too small to share evenly is dropped."""
    if n_shards < 1:
        raise DataError(f"n_shards must be >= 1, got {n_shards}")
    # a corpus too small for whole chunks falls back to one contiguous block per shard
    chunk = min(chunk_size or train.numel(), train.numel() // n_shards)
    if chunk < block_size + 1:
        raise DataError(
            f"{train.numel()} training tokens cannot give {n_shards} shards at least one window "
            f"of block_size + 1 = {block_size + 1} each; use a larger file or fewer shards"
        )
    per_shard = train.numel() // (chunk * n_shards)
    chunks = train[: per_shard * n_shards * chunk].view(per_shard, n_shards, chunk)
    return tuple(chunks[:, i].contiguous() for i in range(n_shards))  # (per_shard, chunk)


# the simulator holds a prepared dataset's tokens in memory (int32): an experiment tool for
# corpora that fit, never the server's or a volunteer's path (they read shard by shard)
MAX_SIMULATED_TOKENS = 1 << 28


def load_prepared(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A prepared dataset's training tokens (its shards in order) and validation tokens,
    int32, for the simulator; each file is checked against the manifest's size."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.train_tokens > MAX_SIMULATED_TOKENS:
        raise DataError(
            f"{folder}: {manifest.train_tokens:,} training tokens are more than the simulator "
            f"holds in memory ({MAX_SIMULATED_TOKENS:,}); simulate on a smaller dataset"
        )

    def read(name: str, tokens: int) -> torch.Tensor:
        path = folder / name
        array = np.fromfile(path, dtype=np.dtype(manifest.dtype).newbyteorder("<"))
        if array.size != tokens:
            raise DataError(f"{path} holds {array.size} tokens, the manifest says {tokens}")
        return torch.from_numpy(array.astype(np.int32))

    train = torch.cat([read(s.file, s.tokens) for s in manifest.shards])
    return train, read(manifest.val.file, manifest.val.tokens)


def random_batch(
    shard: torch.Tensor, *, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows from a (n_chunks, chunk_len) shard: inputs (B, T) and
    next-byte targets (B, T), int64. A 1-D shard is one chunk."""
    chunks = shard.view(1, -1) if shard.dim() == 1 else shard
    n_chunks, chunk_len = chunks.shape
    rows = torch.randint(0, n_chunks, (batch_size,), generator=generator)
    starts = torch.randint(0, chunk_len - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = chunks[rows[:, None], starts[:, None] + offsets].long()  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def range_windows(n_tokens: int, block_size: int) -> int:
    """How many non-overlapping windows of block_size + 1 tokens (sharing their edge token)
    a range of ``n_tokens`` holds."""
    return max(0, (n_tokens - 1) // block_size)


def range_batches(
    tokens: torch.Tensor, *, batch_size: int, block_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A dataset lease's batches: the range's windows (window i = tokens[i·T : i·T + T + 1])
    in an order permuted by ``generator``, ``batch_size`` at a time, each window exactly
    once; a last partial batch is dropped. Inputs (B, T) and targets (B, T), int64."""
    n = range_windows(int(tokens.numel()), block_size)
    order = torch.randperm(n, generator=generator)
    offsets = torch.arange(block_size + 1)
    for first in range(0, n - batch_size + 1, batch_size):
        starts = order[first : first + batch_size] * block_size
        windows = tokens[starts[:, None] + offsets].long()  # (B, T + 1)
        yield windows[:, :-1], windows[:, 1:]


# the steps a volunteer trains ahead (``[inner] overlap``) read its last lease's data again, in
# an order of their own: that lease's seed with this added
AHEAD_SEED = 0xA4EAD


def read_lease_tokens(
    path: Path, *, dtype: str, chunk_len: int, start: int | None = None, tokens: int | None = None
) -> torch.Tensor:
    """A lease's data from its shard file, as the volunteer trains on it (and the server's
    scoring reads it again): a dataset lease's range [``start``, ``start`` + ``tokens``)
    as 1-D int64, read by offset (the rest of the shard is never loaded); a text run's
    shard as uint8 ``(nbytes / chunk_len, chunk_len)``. The caller checks the sizes."""
    if start is not None and tokens is not None:
        little = np.dtype(dtype).newbyteorder("<")
        part = np.fromfile(path, dtype=little, count=tokens, offset=start * little.itemsize)
        return torch.from_numpy(part.astype(np.int64))
    data = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    return data.view(-1, chunk_len)  # (n_chunks, chunk_len)


def lease_stream(
    data: torch.Tensor,
    *,
    ranged: bool,
    batch_size: int,
    block_size: int,
    seed: int,
    repeat: bool = False,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """How a lease's data is read, by the volunteer client and the simulator alike: a
    dataset lease's range (``ranged``, 1-D tokens) each window once, in an order seeded by
    ``seed`` (``repeat``: pass after pass, each in a new order; else StopIteration once
    it is through); a text run's shard, random windows from a generator seeded by
    ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if not ranged:
        return lambda: random_batch(
            data, batch_size=batch_size, block_size=block_size, generator=gen
        )

    def passes() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from range_batches(
                data, batch_size=batch_size, block_size=block_size, generator=gen
            )
            if not repeat or range_windows(int(data.numel()), block_size) < batch_size:
                return

    windows = passes()
    return lambda: next(windows)


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


def simulated_data(cfg: RunConfig, n_shards: int) -> tuple[RunConfig, Dataset]:
    """The run's data as the simulator's workers get it: a text file split as the server
    splits it, or a prepared dataset's validation file and its training tokens dealt into
    ``n_shards`` shards of whole chunks (``data.chunk_size`` tokens), kept whole as well
    for dealing data units as the server does; and the config with the vocabulary
    recorded, as the server records it at creation."""
    if cfg.data.path is not None:
        return cfg, split_tokens(
            load_tokens(cfg.data.path),
            val_fraction=cfg.data.val_fraction,
            n_shards=n_shards,
            block_size=cfg.model.block_size,
            chunk_size=cfg.data.chunk_size,
        )
    assert cfg.data.dataset is not None  # the config holds exactly one of them
    try:
        manifest = read_manifest(cfg.data.dataset)
        vocab = manifest.tokenizer.vocab_size
        train, val = load_prepared(cfg.data.dataset)
    except ManifestError as err:
        raise DataError(f"data.dataset: {err}") from None
    if cfg.model.vocab_size not in (None, vocab):
        raise DataError(
            f"model.vocab_size: {cfg.model.vocab_size} is not the dataset's vocabulary ({vocab})"
        )
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab})})
    shards = deal_shards(
        train, n_shards=n_shards, block_size=cfg.model.block_size, chunk_size=cfg.data.chunk_size
    )
    sizes = tuple(s.tokens for s in manifest.shards)
    return cfg, Dataset(val=val, shards=shards, train=train, shard_tokens=sizes)
