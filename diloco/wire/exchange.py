"""A worker's Δ on its way out: Δ → codec (``encode_delta``), then
``diloco.wire.contribution.encode_contribution`` for the chunks. The client and the simulator both
call it; the server reads the stored body back in the close (``diloco.outer.close``, through
``diloco.outer.chunked.UploadFile``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.wire.codec import EncodedTensor, make_codec


def encode_delta(
    delta: Mapping[str, torch.Tensor], *, kind: str, block_size: int
) -> tuple[dict[str, EncodedTensor], dict]:
    """Compress each tensor of Δ; returns the encoded tensors and the codec description."""
    codec = make_codec(kind, block_size)
    return {n: codec.encode(t) for n, t in delta.items()}, codec.describe()
