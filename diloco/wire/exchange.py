"""The run's codecs, from its ``[compression]``: the uploads' (``codec_for``) and the published
deltas' (``delta_codec_for``). A worker's Δ on its way out: Δ → codec (``encode_delta``), then
``diloco.wire.contribution.encode_contribution`` for the chunks. The client and the simulator both
call it; the server reads the stored body back in the close (``diloco.outer.close``, through
``diloco.outer.upload_file.UploadFile``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.config import CompressionSection
from diloco.wire.codec import Codec, EncodedTensor, make_codec
from diloco.wire.delta import DeltaCodec
from diloco.wire.lowbit import LowBitCodec, SparseCodec, encode_with_feedback

Residual = dict[str, torch.Tensor]


def _codec(kind: str, compression: CompressionSection, topk: int) -> Codec:
    """The codec ``kind`` with the section's block size, chunk and bits (sparse: ``topk``)."""
    if kind == "sparse":
        return SparseCodec(compression.chunk, topk, compression.bits)
    if kind in ("int4", "int2"):
        return LowBitCodec(int(kind.removeprefix("int")), compression.block_size)
    return make_codec(kind, compression.block_size)


def codec_for(compression: CompressionSection) -> Codec:
    """The codec a run's ``[compression]`` names: the one every upload of the run uses."""
    return _codec(compression.kind, compression, compression.topk)


def delta_codec_for(compression: CompressionSection) -> DeltaCodec:
    """The codec of the run's published deltas (``[compression] download``): what a
    returning volunteer downloads (``diloco.wire.delta``)."""
    codec = _codec(compression.download_kind, compression, compression.download_k)
    assert isinstance(codec, DeltaCodec)  # download is never "none": the config's type
    return codec


def encode_delta(
    delta: Mapping[str, torch.Tensor],
    compression: CompressionSection,
    error: Residual | None = None,
) -> tuple[dict[str, EncodedTensor], dict, Residual | None]:
    """Compress each tensor of Δ: the encoded tensors, the codec's description, and for
    the codecs with error feedback (int4, int2, sparse) the residual to carry into the
    next round, from ``error`` (None: zeros, as a new volunteer's)."""
    codec = codec_for(compression)
    if not isinstance(codec, LowBitCodec | SparseCodec):
        return {n: codec.encode(t) for n, t in delta.items()}, codec.describe(), None
    encoded: dict[str, EncodedTensor] = {}
    residual: Residual = {}
    for n, t in delta.items():
        carried = None if error is None else error.get(n)
        encoded[n], residual[n] = encode_with_feedback(codec, t, carried, compression.ef_decay)
    return encoded, codec.describe(), residual
