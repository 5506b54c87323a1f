"""A stored upload (a ``diloco.wire.contribution`` body) read range by range for the
close's pass and the fold (``diloco.outer.chunked``, ``diloco.outer.fold``): ``os.preadv``
into small reusable buffers, never the whole blob, its bytes hashed in file order as they
are read and its sha256 trailer checked at the end (``UploadFile.finish``): a stored upload
damaged on disk raises ``SourceUnreadable``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from pathlib import Path

import torch

from diloco.outer import exact, kernels
from diloco.outer.robust import SourceUnreadable
from diloco.wire.codec import Int8Codec, codec_from_description
from diloco.wire.contribution import DIGEST_BYTES, ContributionDecoder, WireFormatError
from diloco.wire.header import MAX_HEADER_BYTES, PREFIX
from diloco.wire.lowbit import LowBitCodec, SparseCodec
from diloco.wire.tensorfile import byte_view

Shapes = Mapping[str, tuple[int, ...]]


def upload_alignment(codec: dict) -> int:
    """A read of a stored upload of ``codec`` starts at a multiple of this many values:
    whole blocks of int8 (the packed codecs decode any range)."""
    return int(codec["block_size"]) if codec["kind"] == "int8" else 1


class UploadFile:
    """A stored upload (a ``diloco.wire.contribution`` body), read range by range and hashed
    in order."""

    def __init__(
        self,
        source_id: str,
        path: Path,
        shapes: Shapes,
        codec: dict,
        hasher: Executor | None = None,
    ) -> None:
        self.id = source_id
        # where the bytes are hashed: a thread of its own (in order: one worker), so that
        # sha256 runs on another core while this one sums; None: here, inline
        self._hasher = hasher
        self._pending: list[Future[None] | None] = [None, None]
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise SourceUnreadable(
                source_id, f"its stored upload cannot be read: {err.strerror}"
            ) from None
        try:
            self._open(shapes, codec)
        except BaseException:
            os.close(self._fd)
            raise

    def _open(self, shapes: Shapes, codec: dict) -> None:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, PREFIX.size, 0)
        decoder = ContributionDecoder(shapes, codec=codec)
        try:
            decoder.feed(head)
            if len(head) < PREFIX.size:
                decoder.finish()
            header_len = min(PREFIX.unpack(head)[1], MAX_HEADER_BYTES + 1)
            decoder.feed(os.pread(self._fd, header_len, PREFIX.size))
            header = decoder.header
            if header is None:
                decoder.finish()
        except WireFormatError as err:
            raise self.damaged(err) from None
        assert header is not None
        self._sha = hashlib.sha256(os.pread(self._fd, PREFIX.size + header_len, 0))
        self.codec = codec_from_description(header.meta.codec)
        # diloco.wire.lowbit's packed codes: ranges of bytes, decoded range by range
        self._packed = self.codec if isinstance(self.codec, LowBitCodec | SparseCodec) else None
        self._numel = 0
        self._data: dict[str, int] = {}
        self._scales: dict[str, int] = {}
        at = PREFIX.size + header_len
        for spec in header.tensors:
            self._data[spec.name] = at
            at += spec.data_bytes
            self._scales[spec.name] = at
            at += 4 * spec.n_scales
        self._trailer = at
        self.order = [spec.name for spec in header.tensors]  # file order: hashed as read
        self._next = PREFIX.size + header_len  # the next byte the running hash expects
        if size != at + DIGEST_BYTES:
            raise self.damaged(f"it is {size} bytes, its header says {at + DIGEST_BYTES}")
        self._tensor_scales = torch.empty(0)
        self._tensor_scales_at = 0
        # two buffers, used in turn: one is read into while the other may still be hashed
        self._bufs = [torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.int8)]
        self._turn = 0

    def damaged(self, why: object) -> SourceUnreadable:
        return SourceUnreadable(self.id, f"its stored upload is damaged: {why}")

    def _pread_into(self, out: torch.Tensor, at: int) -> None:
        view = byte_view(out)
        try:
            got = os.preadv(self._fd, [view], at)
        except OSError as err:
            raise SourceUnreadable(
                self.id, f"its stored upload cannot be read: {err.strerror}"
            ) from None
        if got != len(view):
            raise self.damaged("it ended early")
        self._pending[self._turn] = self._hash(view, at)

    def _hash(self, view: memoryview, at: int) -> Future[None] | None:
        if at == self._next:  # read in file order: hashed on the way
            self._next += len(view)
            if self._hasher is None:
                self._sha.update(view)
                return None
            return self._hasher.submit(self._sha.update, view)
        self._next = -1  # not in file order: finish() reads the whole file again
        return None

    def start_tensor(self, name: str, numel: int) -> None:
        """Read the tensor's scales (hashed after its data: file order)."""
        n = self.codec.n_scales(numel)
        self._numel = numel
        self._tensor_scales = torch.empty(n, dtype=torch.float32)
        view = byte_view(self._tensor_scales)
        if n and os.preadv(self._fd, [view], self._scales[name]) != len(view):
            raise self.damaged("it ended early")
        self._tensor_scales_at = self._scales[name]

    def end_tensor(self) -> None:
        self._hash(byte_view(self._tensor_scales), self._tensor_scales_at)  # a fresh tensor

    def chunk(self, name: str, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the tensor's data, in a buffer reused next call
        (packed codes: the bytes that hold them, ``decode_into`` unpacks them)."""
        dtype = self.codec.data_dtype
        at = start * dtype.itemsize  # the element's byte, or the packed bytes that hold it
        if self._packed is not None:
            at, n = self._packed.packed_range(start, n, self._numel)
        self._turn ^= 1
        if (pending := self._pending[self._turn]) is not None:
            pending.result()  # this buffer's bytes are hashed: it may be read into again
            self._pending[self._turn] = None
        buf = self._bufs[self._turn]
        if buf.dtype != dtype or buf.numel() < n:
            buf = self._bufs[self._turn] = torch.empty(n, dtype=dtype)
        out = buf[:n]
        self._pread_into(out, self._data[name] + at)
        return out

    def decode_into(self, q: torch.Tensor, start: int, out: torch.Tensor) -> torch.Tensor:
        """Dequantise the chunk ``q`` (from element ``start``) into ``out``."""
        if self._packed is not None:
            try:
                return self._packed.decode_packed(q, start, out, self._numel, self._tensor_scales)
            except ValueError as err:  # checked on arrival: the stored bytes changed since
                raise self.damaged(err) from None
        if not isinstance(self.codec, Int8Codec):
            return q  # fp32 already
        return self.codec.decode_into(q, self._int8_scales(self.codec, start, q.numel()), out)

    def _int8_scales(self, codec: Int8Codec, start: int, n: int) -> torch.Tensor:
        """The scales of the blocks of ``n`` values from ``start`` (a block boundary)."""
        first = start // codec.block_size
        return self._tensor_scales[first : first + codec.n_blocks(n)]

    def add_into(
        self,
        q: torch.Tensor,
        start: int,
        out: torch.Tensor,
        acc: torch.Tensor,
        factor: float,
        work: torch.Tensor,
    ) -> torch.Tensor:
        """``decode_into`` ``out``, and its term round(x · factor) added to the exact sum
        ``acc`` (``exact.add_term``; ``work`` a float64 buffer): for int8 in one pass of the
        fused kernel (``kernels.add_int8``). The decoded values."""
        if self._packed is None and isinstance(self.codec, Int8Codec):
            scales = self._int8_scales(self.codec, start, q.numel())
            return kernels.add_int8(acc, q, scales, self.codec, factor, out, work)
        x = self.decode_into(q, start, out)
        exact.add_term(acc, x, factor, work)
        return x

    def finish(self) -> None:
        """Check the trailer against the bytes read."""
        if self._hasher is not None:  # every update queued so far (one worker: in order)
            self._hasher.submit(lambda: None).result()
        if self._next != self._trailer:  # not read in file order: hash it all again
            self._sha = hashlib.sha256()
            for at in range(0, self._trailer, 1 << 22):
                self._sha.update(os.pread(self._fd, min(1 << 22, self._trailer - at), at))
        trailer = os.pread(self._fd, DIGEST_BYTES, self._trailer)
        if trailer != self._sha.digest():
            raise self.damaged("its sha256 trailer does not match its bytes")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
