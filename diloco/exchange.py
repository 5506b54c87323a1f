"""What crosses the network in a round, as the client and the server do it.

Worker side: Δ → codec (``encode_delta``), then ``diloco.wire.encode_contribution`` for
the chunks. Server side: chunks → decoded tensors, fed one by one into an
:class:`~diloco.outer.Aggregator` (``aggregate_upload``). The simulator calls exactly
these functions, so every simulated round exercises the real codec and wire format.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

import torch

from diloco.codec import EncodedTensor, codec_from_description, make_codec
from diloco.outer import Aggregator
from diloco.wire import (
    ContributionDecoder,
    ContributionMeta,
    WireFormatError,
)


def encode_delta(
    delta: Mapping[str, torch.Tensor], *, kind: str, block_size: int
) -> tuple[dict[str, EncodedTensor], dict]:
    """Compress each tensor of Δ; returns the encoded tensors and the codec description."""
    codec = make_codec(kind, block_size)
    return {n: codec.encode(t) for n, t in delta.items()}, codec.describe()


def aggregate_upload(
    chunks: Iterable[bytes],
    aggregator: Aggregator,
    *,
    expected: Mapping[str, tuple[int, ...]],
    codec: dict,
) -> ContributionMeta:
    """Decode an upload body chunk by chunk and add it to ``aggregator``, weighted by
    its tokens. Each tensor is dequantized and accumulated as soon as its frame
    completes, so no more than one tensor is held decoded at a time."""
    decoder = ContributionDecoder(expected, codec=codec)
    decode = codec_from_description(codec).decode

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for chunk in chunks:
            for name, enc in decoder.feed(chunk):
                yield name, decode(enc)
        decoder.finish()

    stream = tensors()
    first = next(stream)  # the header is parsed by now: its tokens are the weight
    if decoder.header is None:
        raise WireFormatError("a tensor arrived before the header was parsed")
    meta = decoder.header.meta
    aggregator.add(itertools.chain([first], stream), weight=float(meta.tokens))
    return meta
