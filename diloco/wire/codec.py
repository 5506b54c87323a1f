"""Pseudo-gradient compression: the int8 codec that uploads use, and an fp32 baseline.

A contributor's pseudo-gradient Δ = θ(t−1) − θi is what crosses the network every round,
so it is the one thing worth shrinking. The int8 codec is symmetric absmax quantization
per block: each block of ``block_size`` values keeps one fp32 scale (its absmax / 127) and
one int8 per value, so an upload costs about 1 byte per parameter plus 4 bytes per block.
Per-block scales (rather than one per tensor) keep a single outlier from flattening the
resolution of a whole weight matrix.

The interface is deliberately tiny — ``encode``, ``decode``, ``describe`` — so that the
wire format (``diloco.wire.contribution``) can carry any codec by its description and the server can
rebuild the codec from that description alone.

Encoded tensors always live on the CPU: they exist to be written to the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never produced, so negation is exact
DEFAULT_BLOCK_SIZE = 4096


class NonFiniteError(ValueError):
    """A tensor holds NaN or Inf. One such value would poison the averaged update of a
    whole round, so codecs refuse to encode it rather than let it reach the server."""


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor in codec form: flat ``data`` plus per-block ``scales``.

    ``data`` is 1-D and contiguous (int8 for the int8 codec, float32 for "none");
    ``scales`` is 1-D float32 with one value per block (empty for "none").
    """

    shape: tuple[int, ...]
    data: torch.Tensor
    scales: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies on the wire (data + scales, no framing)."""
        return (
            self.data.numel() * self.data.element_size()
            + self.scales.numel() * self.scales.element_size()
        )


class Codec(Protocol):
    """What the wire format and the server need from a codec."""

    @property
    def kind(self) -> str: ...

    data_dtype: ClassVar[torch.dtype]

    def encode(self, t: torch.Tensor) -> EncodedTensor: ...
    def decode(self, e: EncodedTensor) -> torch.Tensor: ...
    def describe(self) -> dict[str, Any]: ...
    def n_scales(self, numel: int) -> int: ...
    def data_nbytes(self, numel: int) -> int: ...


def _flat_finite_fp32(t: torch.Tensor) -> torch.Tensor:
    """Flatten to 1-D fp32 (on t's device, possibly a view) after rejecting NaN/Inf."""
    flat = t.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(flat).all()):
        _refuse_non_finite(flat)
    return flat


def _refuse_non_finite(flat: torch.Tensor) -> None:
    bad = int((~torch.isfinite(flat)).sum())
    raise NonFiniteError(
        f"cannot encode a tensor with {bad} non-finite value(s) (NaN/Inf) "
        f"out of {flat.numel()}; the inner loop diverged or the input is corrupt"
    )


def _split_blocks(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a 1-D tensor: (n_full, block_size) whole blocks, and the short tail block.

    Working on the two views avoids padding, which would copy the whole tensor.
    """
    n_full = flat.numel() // block_size
    cut = n_full * block_size
    return flat[:cut].view(n_full, block_size), flat[cut:]


class Int8Codec:
    """Symmetric absmax int8 quantization with one fp32 scale per block of values."""

    kind: ClassVar[str] = "int8"
    data_dtype: ClassVar[torch.dtype] = torch.int8

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"int8 codec block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size

    def n_blocks(self, numel: int) -> int:
        """Blocks needed for ``numel`` values; the last block may be shorter."""
        return -(-numel // self.block_size)

    def n_scales(self, numel: int) -> int:
        return self.n_blocks(numel)

    def data_nbytes(self, numel: int) -> int:
        """A tensor's data frame: one byte per value."""
        return numel

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        flat = t.detach().reshape(-1).to(torch.float32)  # (N,)
        head, tail = _split_blocks(flat, self.block_size)  # (B, bs), (N - B*bs,)

        # Per-block absmax; amax of max/-min avoids materialising |x| for the whole tensor.
        # abs_: an all-zero block's max is +0 or -0 by the reduction's order (which moves with
        # the number of blocks and threads); its scale, and the change it decodes to, is +0.
        absmax = torch.maximum(head.amax(dim=1), -head.amin(dim=1)).abs_()  # (B,)
        if tail.numel():
            absmax = torch.cat([absmax, tail.abs().amax().reshape(1)])  # (n_blocks,)
        # amax propagates NaN and keeps Inf: every value is finite iff every absmax is
        if not bool(torch.isfinite(absmax).all()):
            _refuse_non_finite(flat)
        scales = absmax / INT8_MAX
        # An all-zero block has scale 0: divide by 1 instead, so it quantizes to exact zeros.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))

        scaled = torch.empty_like(flat)  # (N,) fp32, filled block-wise below
        scaled_head, scaled_tail = _split_blocks(scaled, self.block_size)
        n_full = head.shape[0]
        torch.div(head, divisor[:n_full, None], out=scaled_head)
        torch.div(tail, divisor[n_full:], out=scaled_tail)
        q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return EncodedTensor(tuple(t.shape), q.cpu().contiguous(), scales.cpu().contiguous())

    def decode(self, e: EncodedTensor) -> torch.Tensor:
        if e.data.dtype != torch.int8 or e.data.numel() != e.numel:
            raise ValueError(
                f"int8 codec expects {e.numel} int8 values for shape {list(e.shape)}, "
                f"got {e.data.numel()} of {e.data.dtype}"
            )
        if e.scales.numel() != self.n_blocks(e.numel):
            raise ValueError(
                f"int8 codec with block_size {self.block_size} expects "
                f"{self.n_blocks(e.numel)} scales for {e.numel} values, got {e.scales.numel()}"
            )
        out = torch.empty(e.numel, dtype=torch.float32)  # (N,)
        return self.decode_into(e.data, e.scales.to(torch.float32), out).reshape(e.shape)

    def decode_into(
        self, data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Dequantise flat int8 ``data`` (from a block boundary) with its blocks' fp32
        ``scales`` into ``out`` (fp32, same length), unchecked: the one dequantisation, for
        whole tensors (``decode``) and for chunks of them (``diloco.outer.chunked``) alike."""
        out.copy_(data)  # int8 -> fp32, then a same-dtype multiply (a mixed one is ~15x slower)
        out_head, out_tail = _split_blocks(out, self.block_size)
        out_head.mul_(scales[: out_head.shape[0], None])
        out_tail.mul_(scales[out_head.shape[0] :])
        return out

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size}

    def __repr__(self) -> str:
        return f"Int8Codec(block_size={self.block_size})"


class NoneCodec:
    """fp32 passthrough: the uncompressed baseline for comparing against int8."""

    kind: ClassVar[str] = "none"
    data_dtype: ClassVar[torch.dtype] = torch.float32

    def n_scales(self, numel: int) -> int:
        return 0

    def data_nbytes(self, numel: int) -> int:
        """A tensor's data frame: four bytes per value."""
        return 4 * numel

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        flat = _flat_finite_fp32(t)
        data = flat.to(device="cpu", dtype=torch.float32, copy=True)  # never alias the caller's
        return EncodedTensor(tuple(t.shape), data, torch.empty(0, dtype=torch.float32))

    def decode(self, e: EncodedTensor) -> torch.Tensor:
        if e.data.dtype != torch.float32 or e.data.numel() != e.numel or e.scales.numel():
            raise ValueError(
                f"'none' codec expects {e.numel} float32 values and no scales for shape "
                f"{list(e.shape)}, got {e.data.numel()} of {e.data.dtype} "
                f"and {e.scales.numel()} scales"
            )
        return e.data.to(torch.float32, copy=True).reshape(e.shape)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def __repr__(self) -> str:
        return "NoneCodec()"


KNOWN_KINDS = (Int8Codec.kind, NoneCodec.kind)
PACKED_KINDS = ("int4", "int2", "sparse")  # diloco.wire.lowbit (diloco.wire.exchange.codec_for)


def make_codec(kind: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Int8Codec | NoneCodec:
    """The codec a run config names (``[compression] kind``); ``block_size`` is int8-only."""
    if kind == Int8Codec.kind:
        return Int8Codec(block_size)
    if kind == NoneCodec.kind:
        return NoneCodec()
    raise ValueError(f"unknown codec kind {kind!r}; known kinds: {', '.join(KNOWN_KINDS)}")


def codec_from_description(d: object) -> Codec:
    """Rebuild a codec from ``describe()`` output. Strict, because the description arrives
    over the network: unknown kinds, missing or extra keys, and wrong types are errors.
    It knows the packed kinds of ``diloco.wire.lowbit`` (int4, int2, sparse) besides
    ``make_codec``'s."""
    if not isinstance(d, dict):
        raise ValueError(f"codec description must be a map, got {type(d).__name__}")
    kind = d.get("kind")
    if not isinstance(kind, str):
        raise ValueError(f"codec description needs a string 'kind'; known kinds: {KNOWN_KINDS}")
    if kind in PACKED_KINDS:
        from diloco.wire.lowbit import packed_from_description

        return packed_from_description(d)
    allowed = {"kind", "block_size"} if kind == Int8Codec.kind else {"kind"}
    extra = sorted(str(k) for k in d if k not in allowed)
    if extra:
        raise ValueError(f"codec description for {kind!r} has unknown key(s): {extra}")
    if kind == Int8Codec.kind and "block_size" not in d:
        raise ValueError("codec description for 'int8' is missing 'block_size'")
    return make_codec(kind, d.get("block_size", DEFAULT_BLOCK_SIZE))


def relative_l2_error(original: torch.Tensor, decoded: torch.Tensor) -> float:
    """‖original − decoded‖₂ / ‖original‖₂ in float64; 0 when both are zero."""
    a = original.detach().to(torch.float64).reshape(-1)
    b = decoded.detach().to(torch.float64).reshape(-1)
    num = float(torch.linalg.vector_norm(a - b))
    den = float(torch.linalg.vector_norm(a))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
