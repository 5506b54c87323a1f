"""Inspection of an upload as it streams in (``UploadInspector``): every tensor must decode
to finite values (an int8 frame with a finite but huge scale decodes to Inf; a packed frame
must pass its codec's checks), the payload's L2 norm is measured (the robust aggregation's
clipping reads it: ``diloco.outer.robust``), and the decoded payload gets a digest (the
same tensors replayed by someone else are recognised whatever header they come with)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from diloco.wire.codec import INT8_MAX, EncodedTensor, Int8Codec, codec_from_description
from diloco.wire.contribution import (
    NonFiniteWireError,
    TensorSpec,
    WireFormatError,
    checked_decode,
    non_finite_values,
    out_of_range_int8,
)
from diloco.wire.digest import Part, StreamDigest
from diloco.wire.header import dtype_name

Shapes = Mapping[str, tuple[int, ...]]


class UploadInspector:
    """Measures an upload as it streams in and refuses a tensor that decodes to a
    non-finite value, without decoding it: a ``wire.FrameSink`` (the decoder hands it each
    data frame piece by piece, memory O(piece)), or fed whole tensors with ``add``.
    ``norm`` and ``payload_sha256`` are final once every tensor went through.

    For int8 nothing is dequantised: value i of block b decodes to fp32(qᵢ · s_b), so the
    block decodes finite iff fp32(max|q| · s_b) is finite (the rounding is monotone), and
    ‖x‖² = Σ_b s_b² · Σ_{i∈b} qᵢ² (``int8_block_stats`` measures both per block as the
    data streams; the scales, which follow the data, finish the sum). The payload digest
    covers each tensor's name, data and scales bytes: the same tensors replayed by someone
    else are recognised whatever header they come with.

    ``digest_later``: the payload digest is not computed as the bytes go by; each call of
    ``digest_work`` returns what is due since the last one, for ``digest`` to hash on
    another thread, one batch after the other, while the next pieces are scanned. Only for
    a caller whose chunks are immutable (``bytes``): the pieces are kept, not copied
    (``diloco.wire.digest``).
    """

    def __init__(self, codec: dict, *, digest_later: bool = False) -> None:
        self._codec = codec_from_description(codec)
        self._packed_codec = self._codec.data_dtype == torch.uint8  # diloco.wire.lowbit
        self._sq = 0.0  # Σ x², in float64
        self._digest = StreamDigest(later=digest_later)
        # the tensor being received
        self._name = ""
        self._carry = bytearray()  # the start of a block (int8) or value (fp32) cut by a piece
        self._absmax: list[np.ndarray] = []  # int8: per block max |q| (int16)
        self._qsq: list[np.ndarray] = []  # int8: per block Σ q² (float64)
        self._tensor_sq = 0.0  # fp32: Σ x² so far
        self._non_finite = 0  # fp32: NaN/Inf values so far
        self._shape: tuple[int, ...] = ()
        self._packed = bytearray()  # packed codes: the tensor's whole data frame (small)

    # -- the wire.FrameSink interface

    def begin(self, spec: TensorSpec) -> None:
        self._name, self._shape = spec.name, spec.shape
        self._packed.clear()
        self._carry.clear()
        self._absmax, self._qsq = [], []
        self._tensor_sq, self._non_finite = 0.0, 0
        self._digest.update(spec.name.encode())

    def data(self, piece: memoryview) -> None:
        self._digest.update(piece)
        if self._packed_codec:  # checked whole, with its scales (``end``)
            self._packed += piece
            return
        unit = self._codec.block_size if isinstance(self._codec, Int8Codec) else 4
        if self._carry:
            take = min(unit - len(self._carry), len(piece))
            self._carry += piece[:take]
            piece = piece[take:]
            if len(self._carry) < unit:
                return
            self._scan(memoryview(self._carry))
            self._carry.clear()
        whole = len(piece) - len(piece) % unit
        step = max(unit, SCAN_BYTES - SCAN_BYTES % unit)  # whole units; temporaries stay small
        for at in range(0, whole, step):
            self._scan(piece[at : min(whole, at + step)])
        self._carry += piece[whole:]

    def end_data(self) -> None:
        if self._carry:  # int8: the tensor's last, shorter block (fp32 frames are whole values)
            self._scan(memoryview(self._carry))
            self._carry.clear()
        if self._non_finite:
            raise non_finite_values(self._name, self._non_finite, "data")

    def end(self, scales: torch.Tensor) -> None:
        self._digest.update(scales.numpy().astype("<f4").tobytes())  # a copy: scales is reused
        if self._packed_codec:
            self._sq += self._packed_sq(scales)
        elif not isinstance(self._codec, Int8Codec):
            self._sq += self._tensor_sq
        else:
            self._sq += self._int8_sq(scales)
        if self._sq > MAX_UPLOAD_NORM**2:
            raise NonFiniteWireError(
                f"tensor {self._name!r}: the upload's norm reaches {self.norm:.3g} here, past "
                f"the {MAX_UPLOAD_NORM:g} an outer step can take in float32 (its squares "
                "and sums would overflow)"
            )

    def _int8_sq(self, scales: torch.Tensor) -> float:
        """An int8 tensor's Σ x² in float64 from its blocks' statistics and scales; a block
        whose largest value overflows float32 is refused."""
        s = scales.numpy().astype(np.float32, copy=False)  # (n_blocks,)
        absmax = np.concatenate(self._absmax) if self._absmax else np.zeros(0, np.int16)
        qsq = np.concatenate(self._qsq) if self._qsq else np.zeros(0, np.float64)
        if absmax.shape != s.shape:  # the decoder sized the scales from the data: never
            raise WireFormatError(
                f"tensor {self._name!r}: {len(s)} scales for {len(absmax)} blocks"
            )
        with np.errstate(over="ignore"):
            largest = absmax.astype(np.float32) * s  # fp32, rounded as decoding rounds
        if not bool(np.isfinite(largest).all()):
            raise NonFiniteWireError(
                f"tensor {self._name!r} decodes to non-finite values: its int8 values times "
                "their scales overflow float32"
            )
        s64 = s.astype(np.float64)
        return float(np.dot(s64 * s64, qsq))

    def _packed_sq(self, scales: torch.Tensor) -> float:
        """A packed tensor's Σ x² in float64, once its codec's decoder accepted it (codes,
        indices, pad bits, scales: ``diloco.wire.lowbit``)."""
        data = torch.from_numpy(np.frombuffer(self._packed, dtype=np.uint8).copy())
        encoded = EncodedTensor(self._shape, data, scales.clone())
        x = checked_decode(self._name, self._codec, encoded)
        return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2

    # -- whole tensors

    def add(self, name: str, encoded: EncodedTensor) -> None:
        """One whole tensor (``ContributionDecoder.feed``'s output); as a sink would see it."""
        codec, numel = self._codec, encoded.numel
        if (
            encoded.data.dtype != codec.data_dtype
            or encoded.data.numel() * encoded.data.element_size() != codec.data_nbytes(numel)
            or encoded.scales.numel() != codec.n_scales(numel)
        ):
            raise ValueError(
                f"tensor {name!r} is not in {codec!r}'s form: {encoded.data.dtype}, "
                f"{encoded.scales.numel()} scales for {encoded.numel} values"
            )
        dtype = dtype_name(codec.data_dtype)
        self.begin(TensorSpec(name, tuple(encoded.shape), dtype, encoded.scales.numel()))
        data = encoded.data.contiguous().numpy()
        self.data(data.astype(data.dtype.newbyteorder("<"), copy=False).view(np.uint8).data)
        self.end_data()
        self.end(encoded.scales.contiguous())

    def _scan(self, view: memoryview) -> None:
        if isinstance(self._codec, Int8Codec):
            absmax, qsq = int8_block_stats(view, self._codec.block_size)
            if int(absmax.max(initial=0)) > INT8_MAX:
                raise out_of_range_int8(self._name)
            self._absmax.append(absmax)
            self._qsq.append(qsq)
        else:
            x = torch.from_numpy(np.frombuffer(view, "<f4").astype(np.float32))  # (n,) a copy
            finite = torch.isfinite(x)
            if not bool(finite.all()):
                self._non_finite += int((~finite).sum())
                x = x[finite]
            self._tensor_sq += float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2

    # -- the payload digest

    def digest_work(self) -> list[Part]:
        """``digest_later``: the parts to digest since the last call, in order."""
        assert self._digest.later, "only with digest_later"
        return self._digest.work()

    def digest(self, work: list[Part]) -> None:
        """Digest ``digest_work``'s parts (calls in the order the work was taken)."""
        self._digest.run(work)

    @property
    def norm(self) -> float:
        return math.sqrt(self._sq)

    @property
    def payload_sha256(self) -> str:
        return str(self._digest.done().hexdigest())


# the largest ‖Δ‖ an upload may have (issue 26, liveness): the close sums, squares and
# steps in float32 (max 3.4e38), so an upload of finite values whose squares or sums pass
# that range would make every step with it non-finite. 1e15 leaves ‖Δ‖² (1e30) and sums of
# many such far inside float32, and is twelve orders of magnitude past any trained update
# (parameters are O(1)); the norm is measured in float64, where it cannot overflow
MAX_UPLOAD_NORM = 1e15

SCAN_BYTES = 1 << 18  # int8 data scanned in pieces of at most this many bytes (fp32 temps 4x)


def int8_block_stats(data: memoryview, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of ``block_size`` int8 values (the last one may be shorter): max |q| as
    int16 (128 means a -128 is there) and Σ q² as float64, without dequantising."""
    q = np.frombuffer(data, np.int8)
    rows = q.reshape(-1, block_size) if len(q) % block_size == 0 else q.reshape(1, -1)
    absmax = np.maximum(rows.max(axis=1).astype(np.int16), -rows.min(axis=1).astype(np.int16))
    f = rows.astype(np.float32)  # (blocks, block_size), exact: |q| <= 128
    # each row's dot product with itself, batched (BLAS: several times faster than summing
    # squares); fp32 sums are exact below 2²⁴ and within ~1e-7 above, as fp32 decoding is
    qsq = np.matmul(f[:, None, :], f[:, :, None]).reshape(-1).astype(np.float64)
    return absmax, qsq
