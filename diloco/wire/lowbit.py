"""Low-bit and sparse codecs for pseudo-gradients (issue 25's ``[compression]`` kinds
``int4``, ``int2`` and ``sparse``): what an upload under 0.05 byte per parameter is made of.

A run chooses one with ``[compression] kind`` (``diloco.wire.exchange.codec_for``: the
keys ``block_size``, ``chunk``, ``topk``, ``bits``, ``ef_decay``). The wire format carries
these bodies (``codec_from_description``; a whole body's decoder checks every packed frame
with ``decode``), the server's streaming inspection checks and measures them
(``diloco.outer.inspection``), the close's pass reads them range by range
(``packed_range``, ``decode_packed``: ``diloco.outer.chunked``), and the volunteer keeps
its error-feedback residual with its AdamW state (``encode_delta``; the client's
``client.optimizer_state``, the simulator's workers alike). This module is their one
definition: the layout, the encoder and the strict decoder.

Both keep the int8 codec's shape (``EncodedTensor``: flat ``data``, one fp32 scale per
block) with ``data`` as packed bytes (``uint8``), ``data_nbytes(numel)`` long:

- ``LowBitCodec(bits)``, dense, ``bits`` ∈ {4, 2}: per block of ``block_size`` values a
  scale s = absmax / L with L = 2^(bits−1) − 1 (7 for int4, 1 for int2: ternary), each
  value rounded to q ∈ [−L, L] and stored as the code q + L in ``bits`` bits, ``8 / bits``
  codes per byte, the first value in the lowest bits. The top code 2^bits − 1 is never
  produced and is refused, as are set bits past the last value.
- ``SparseCodec(chunk, topk, bits)``: per chunk of ``chunk`` values (the last may be
  shorter) the ``topk`` values of largest magnitude (all of a chunk shorter than that),
  in increasing index order, each as one field of ``index_bits + bits`` bits: its index in
  the chunk (``index_bits`` = bits to count to ``chunk`` − 1: 12 for 4096) in the low
  bits, then its code. Codes are ``bits``-bit midrise levels: value ≈ (c − h) · s with
  h = (2^bits − 1) / 2 and s = the chunk's selected absmax / h, so 2 bits give ±s/2 and
  ±3s/2 (no zero level: a selected value is never the chunk's smallest). A chunk's fields
  are packed from its record's lowest bit and the record is padded to a whole byte; at
  the defaults (4096, 64, 2) a record is 112 bytes plus a 4-byte scale: 0.0283 byte per
  value. Indices must increase strictly within a record, lie inside the chunk, and the
  pad bits be zero.

Every scale must be finite, >= 0 and <= ``MAX_SCALE``: a value of a pseudo-gradient is a
parameter's change over one round, far below it, and the bound keeps every square and sum
the close computes finite in fp32 (issue 26's overflow).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from diloco.wire.codec import EncodedTensor, _flat_finite_fp32

MAX_SCALE = 1e4
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _check_scales(scales: torch.Tensor, expected: int, what: str) -> torch.Tensor:
    if scales.dtype != torch.float32 or scales.numel() != expected:
        raise ValueError(f"{what} expects {expected} float32 scales, got {scales.numel()}")
    bad = ~torch.isfinite(scales) | (scales < 0) | (scales > MAX_SCALE)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise ValueError(
            f"{what}: scale {first} is {float(scales[first])!r}, not finite in [0, {MAX_SCALE}]"
        )
    return scales


def _check_body(e: EncodedTensor, nbytes: int, n_scales: int, what: str) -> torch.Tensor:
    """``e``'s scales, once its data is ``nbytes`` bytes and its scales ``n_scales``
    finite values in [0, MAX_SCALE]; a ValueError naming ``what`` otherwise."""
    if e.data.dtype != torch.uint8 or e.data.numel() != nbytes:
        raise ValueError(
            f"{what} expects {nbytes} bytes for {e.numel} values, "
            f"got {e.data.numel()} of {e.data.dtype}"
        )
    return _check_scales(e.scales, n_scales, what)


def pack_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of ``width``-bit unsigned fields (int64, shape (R, F)) as bytes (R, ceil(F·width/8)):
    field j of a row starts at bit j·width of the row, the lowest bit first."""
    rows, n = fields.shape
    shifts = torch.arange(width, dtype=torch.int64)
    bits = ((fields.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(rows, n * width)
    pad = -(n * width) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(rows, pad)], dim=1)
    return (bits.reshape(rows, (n * width + pad) // 8, 8) * _BIT_WEIGHTS).sum(
        dim=-1, dtype=torch.uint8
    )


def unpack_fields(packed: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_fields``' inverse: the (R, n) fields, and whether each row's pad bits are zero."""
    rows = packed.shape[0]
    bits = ((packed.unsqueeze(-1) & _BIT_WEIGHTS) != 0).reshape(rows, packed.shape[1] * 8)
    body = bits[:, : n * width].reshape(rows, n, width).to(torch.int64)
    fields = (body << torch.arange(width, dtype=torch.int64)).sum(dim=-1)
    return fields, ~bits[:, n * width :].any(dim=1)


class LowBitCodec:
    """Dense symmetric ``bits``-bit quantization, one fp32 scale per block (module docstring)."""

    data_dtype: ClassVar[torch.dtype] = torch.uint8

    def __init__(self, bits: int, block_size: int = 4096) -> None:
        if bits not in (2, 4):
            raise ValueError(f"low-bit codec bits must be 2 or 4, got {bits!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.bits, self.block_size = bits, block_size
        self.levels = 2 ** (bits - 1) - 1  # L: codes 0..2L stand for -L..L
        self.per_byte = 8 // bits

    @property
    def kind(self) -> str:
        return f"int{self.bits}"

    def n_scales(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def data_nbytes(self, numel: int) -> int:
        return -(-numel // self.per_byte)

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        flat = _flat_finite_fp32(t).cpu()
        n = flat.numel()
        blocks = torch.nn.functional.pad(flat, (0, -n % self.block_size)).view(-1, self.block_size)
        scales = blocks.abs().amax(dim=1) / self.levels
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = (blocks / divisor[:, None]).round_().clamp_(-self.levels, self.levels)
        codes = (q.reshape(-1)[:n] + self.levels).to(torch.int64)
        return EncodedTensor(tuple(t.shape), self._pack(codes), scales.contiguous())

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(codes, (0, -codes.numel() % self.per_byte))
        return pack_fields(padded.view(1, -1), self.bits).reshape(-1)

    def decode(self, e: EncodedTensor) -> torch.Tensor:
        n = e.numel
        scales = _check_body(e, self.data_nbytes(n), self.n_scales(n), f"{self.kind} codec")
        fields, _ = unpack_fields(
            e.data.view(1, -1), self.data_nbytes(n) * self.per_byte, self.bits
        )
        codes = fields.reshape(-1)
        if bool((codes[:n] > 2 * self.levels).any()):
            raise ValueError(f"{self.kind} codec: a code is out of range (> {2 * self.levels})")
        if bool(codes[n:].any()):
            raise ValueError(f"{self.kind} codec: bits set past the last value")
        out = torch.empty(n, dtype=torch.float32)
        return self._dequantize(codes[:n], 0, scales, out).reshape(e.shape)

    def _dequantize(
        self, codes: torch.Tensor, start: int, scales: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Codes of values [start, start + len(out)) times their blocks' scales, into ``out``."""
        block = torch.arange(start, start + out.numel()) // self.block_size
        return torch.mul((codes - self.levels).to(torch.float32), scales[block], out=out)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": self.block_size}

    def packed_range(self, start: int, n: int, numel: int) -> tuple[int, int]:
        """(offset, length) of the data bytes that hold values [start, start + n)."""
        first = start // self.per_byte
        return first, -(-(start + n) // self.per_byte) - first

    def decode_packed(
        self, raw: torch.Tensor, start: int, out: torch.Tensor, numel: int, scales: torch.Tensor
    ) -> torch.Tensor:
        """Values [start, start + len(out)) into ``out`` from ``packed_range``'s bytes
        ``raw`` and the tensor's ``scales``; unchecked (the upload was checked on arrival)."""
        skip = start % self.per_byte
        fields, _ = unpack_fields(raw.view(1, -1), raw.numel() * self.per_byte, self.bits)
        return self._dequantize(fields.reshape(-1)[skip : skip + out.numel()], start, scales, out)


class SparseCodec:
    """Top-k per chunk, ``bits``-bit codes with one scale per chunk, indices and codes
    packed as bits (module docstring)."""

    kind: ClassVar[str] = "sparse"
    data_dtype: ClassVar[torch.dtype] = torch.uint8

    def __init__(self, chunk: int = 4096, topk: int = 64, bits: int = 2) -> None:
        if not 2 <= chunk <= 1 << 16:
            raise ValueError(f"sparse codec chunk must be in [2, 65536], got {chunk!r}")
        if not 1 <= topk <= chunk:
            raise ValueError(f"sparse codec topk must be in [1, chunk = {chunk}], got {topk!r}")
        if bits not in (1, 2, 3, 4, 8):
            raise ValueError(f"sparse codec bits must be 1, 2, 3, 4 or 8, got {bits!r}")
        self.chunk, self.topk, self.bits = chunk, topk, bits
        self.index_bits = (chunk - 1).bit_length()
        self.width = self.index_bits + bits
        self.half = (2**bits - 1) / 2

    def _chunks(self, numel: int) -> tuple[int, int]:
        """(whole chunks, values in the short last chunk: 0 when there is none)."""
        return numel // self.chunk, numel % self.chunk

    def _record_bytes(self, k: int) -> int:
        return -(-k * self.width // 8)

    def n_scales(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def data_nbytes(self, numel: int) -> int:
        full, last = self._chunks(numel)
        tail = self._record_bytes(min(self.topk, last)) if last else 0
        return full * self._record_bytes(self.topk) + tail

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        flat = _flat_finite_fp32(t).cpu()
        full, last = self._chunks(flat.numel())
        head = flat[: full * self.chunk].view(full, self.chunk)
        parts = [self._encode_rows(head, self.topk)]
        if last:
            parts.append(
                self._encode_rows(flat[full * self.chunk :].view(1, last), min(self.topk, last))
            )
        data = torch.cat([p[0].reshape(-1) for p in parts])
        scales = torch.cat([p[1] for p in parts])
        return EncodedTensor(tuple(t.shape), data, scales)

    def _encode_rows(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # (R, k)
        values = rows.gather(1, idx)
        scales = values.abs().amax(dim=1) / self.half  # (R,)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (values / divisor[:, None] + self.half).round_().clamp_(0, 2**self.bits - 1)
        fields = idx | (codes.to(torch.int64) << self.index_bits)
        return pack_fields(fields, self.width), scales

    def decode(self, e: EncodedTensor) -> torch.Tensor:
        n = e.numel
        scales = _check_body(e, self.data_nbytes(n), self.n_scales(n), "sparse codec")
        out = torch.empty(n, dtype=torch.float32)
        return self.decode_packed(e.data, 0, out, n, scales).reshape(e.shape)

    def _decode_rows(
        self, records: torch.Tensor, k: int, length: int, scales: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Check the (R, bytes) ``records`` of chunks ``length`` long and scatter their
        values into ``out`` (R · chunk values from a chunk boundary)."""
        fields, pad_clear = unpack_fields(records, k, self.width)
        if not bool(pad_clear.all()):
            raise ValueError("sparse codec: a record has pad bits set")
        idx = fields & ((1 << self.index_bits) - 1)
        if bool((idx >= length).any()):
            raise ValueError(f"sparse codec: an index is past its chunk of {length} values")
        if k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise ValueError("sparse codec: indices do not increase within a chunk")
        values = ((fields >> self.index_bits).to(torch.float32) - self.half) * scales[:, None]
        rows = idx.shape[0]
        out[: rows * self.chunk].view(rows, self.chunk).scatter_(1, idx, values)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "chunk": self.chunk, "topk": self.topk, "bits": self.bits}

    def _covering(self, start: int, n: int, numel: int) -> tuple[int, int]:
        """The chunks [first, stop) that hold values [start, start + n)."""
        return start // self.chunk, min(self.n_scales(numel), -(-(start + n) // self.chunk))

    def _offset(self, c: int, numel: int) -> int:
        """Where chunk ``c``'s record starts: the records of the values before it."""
        return self.data_nbytes(min(c * self.chunk, numel))

    def packed_range(self, start: int, n: int, numel: int) -> tuple[int, int]:
        """(offset, length) of the records of the chunks that hold values [start, start + n)."""
        first, stop = self._covering(start, n, numel)
        at = self._offset(first, numel)
        return at, self._offset(stop, numel) - at

    def decode_packed(
        self, raw: torch.Tensor, start: int, out: torch.Tensor, numel: int, scales: torch.Tensor
    ) -> torch.Tensor:
        """Values [start, start + len(out)) into ``out`` (zeros but at the sent indices)
        from ``packed_range``'s records ``raw`` and the tensor's ``scales``, each record
        checked (``decode`` is the whole tensor's range)."""
        n = out.numel()
        first, stop = self._covering(start, n, numel)
        full, last = self._chunks(numel)
        dense = torch.zeros((stop - first) * self.chunk, dtype=torch.float32)
        whole = min(stop, full) - first  # whole chunks among them
        record = self._record_bytes(self.topk)
        self._decode_rows(
            raw[: whole * record].view(whole, record), self.topk, self.chunk,
            scales[first : first + whole], dense,
        )  # fmt: skip
        if stop > full:  # and the short last one
            k = min(self.topk, last)
            self._decode_rows(
                raw[whole * record :].view(1, -1),
                k,
                last,
                scales[full:],
                dense[whole * self.chunk :],
            )
        at = start - first * self.chunk
        return out.copy_(dense[at : at + n])


def packed_from_description(d: dict[str, Any]) -> LowBitCodec | SparseCodec:
    """``describe()``'s output back to its codec; strict (it arrives over the network)."""
    kind = d["kind"]
    keys = ("kind", "chunk", "topk", "bits") if kind == SparseCodec.kind else ("kind", "block_size")
    if sorted(d) != sorted(keys):
        raise ValueError(f"codec description for {kind!r} needs exactly the keys {list(keys)}")
    values = {k: d[k] for k in keys[1:]}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
        raise ValueError(f"codec description for {kind!r}: {list(keys[1:])} must be integers")
    if kind == SparseCodec.kind:
        return SparseCodec(**values)
    return LowBitCodec(int(kind.removeprefix("int")), values["block_size"])


def encode_with_feedback(
    codec: LowBitCodec | SparseCodec, delta: torch.Tensor, error: torch.Tensor | None, decay: float
) -> tuple[EncodedTensor, torch.Tensor]:
    """Error feedback: a = decay · error + delta is what is encoded; the new error is
    a − decode(encoded), what the next round adds back (``error`` None: zeros, a new
    volunteer)."""
    accumulator = delta.float() if error is None else delta.float() + decay * error
    encoded = codec.encode(accumulator)
    return encoded, accumulator - codec.decode(encoded)


def bytes_per_value(codec: LowBitCodec | SparseCodec, numel: int) -> float:
    """Data and scales on the wire per value, framing excluded."""
    return (codec.data_nbytes(numel) + 4 * codec.n_scales(numel)) / max(1, numel)


__all__ = [
    "MAX_SCALE",
    "LowBitCodec",
    "SparseCodec",
    "bytes_per_value",
    "encode_with_feedback",
    "pack_fields",
    "packed_from_description",
    "unpack_fields",
]
