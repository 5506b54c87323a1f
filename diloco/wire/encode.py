"""Encoding a contribution body (``diloco.wire.contribution`` has the layout and re-exports these):
the header, then each tensor's bytes sliced straight from the encoded tensors, then the
sha256 trailer, streamed in chunks so that only one chunk is ever materialised."""

from __future__ import annotations

import hashlib
import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from diloco.wire.codec import EncodedTensor
from diloco.wire.header import (
    ContributionMeta,
    body_bytes,
    prefix_and_header,
    spec_of,
)

_LITTLE_ENDIAN = sys.byteorder == "little"


def contribution_nbytes(meta: ContributionMeta, tensors: Mapping[str, EncodedTensor]) -> int:
    """The exact body size ``encode_contribution`` will produce (for Content-Length)."""
    specs = [spec_of(name, t) for name, t in tensors.items()]
    return body_bytes(len(prefix_and_header(meta, specs)), specs)


def _le_bytes(x: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor, little-endian (copies only on big-endian hosts)."""
    arr = x.numpy()
    if not _LITTLE_ENDIAN:
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.view(np.uint8).data


def encode_contribution(
    meta: ContributionMeta, tensors: Mapping[str, EncodedTensor], chunk_size: int = 1 << 20
) -> Iterator[bytes]:
    """Validate now, then stream the body as chunks of at most ``chunk_size`` bytes.

    Only one chunk is materialised at a time; tensor bytes are sliced from the tensors.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    items = list(tensors.items())
    prefix = prefix_and_header(meta, [spec_of(name, t) for name, t in items])

    def pieces() -> Iterator[memoryview]:
        digest = hashlib.sha256()
        views = (v for _, t in items for v in (_le_bytes(t.data), _le_bytes(t.scales)))
        for piece in itertools.chain([memoryview(prefix)], views):
            digest.update(piece)
            yield piece
        yield memoryview(digest.digest())

    return _rechunk(pieces(), chunk_size)


def _rechunk(pieces: Iterable[memoryview], chunk_size: int) -> Iterator[bytes]:
    """Coalesce small pieces and split large ones into chunks of exactly ``chunk_size``
    (the last one shorter), so many small tensors do not become many tiny writes."""
    buf = bytearray()
    for piece in pieces:
        while len(piece):
            if not buf and len(piece) >= chunk_size:
                yield bytes(piece[:chunk_size])
                piece = piece[chunk_size:]
                continue
            room = chunk_size - len(buf)
            buf += piece[:room]
            piece = piece[room:]
            if len(buf) == chunk_size:
                yield bytes(buf)
                buf.clear()
    if buf:
        yield bytes(buf)
