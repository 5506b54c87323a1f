"""The contribution upload format: a msgpack header, raw tensor frames, a sha256 trailer.

Body layout (all integers little-endian; ``docs/protocol.md`` is the full contract)::

    MAGIC (8) | header length u32 (4) | header (msgpack map) |
    for each tensor in header order: data (numel · itemsize) | scales (4 · n_scales) |
    sha256 of every preceding byte (32)

The constants, errors, header dataclasses and header schema live in ``diloco.wire.header``
and the encoder in ``diloco.wire.encode``; this module decodes the body as it streams in
and re-exports their public names, so callers import everything from ``diloco.wire.contribution``.

Why this shape: the header is small and self-describing (msgpack, never pickle — nothing
from the network may construct objects), while the tensor bytes travel as raw frames that
both sides stream without ever holding the body: the encoder yields slices of the encoded
tensors, and the decoder copies each chunk straight into a preallocated tensor and hands
back every tensor as soon as it is complete, so a server can aggregate tensor by tensor.

Every rejection by the decoder is a ``WireFormatError`` (a ``ValueError``); NaN/Inf in a
frame raises ``NonFiniteWireError``, which is both a ``WireFormatError`` and a
``codec.NonFiniteError``, so either ``except`` clause catches it.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from diloco.wire.codec import INT8_MAX, Codec, EncodedTensor, codec_from_description
from diloco.wire.digest import Part, StreamDigest
from diloco.wire.encode import contribution_nbytes, encode_contribution
from diloco.wire.header import (
    DIGEST_BYTES,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_NUMEL,
    PREFIX,
    SUPPORTED_VERSIONS,
    ContributionHeader,
    ContributionMeta,
    NonFiniteWireError,
    TensorSpec,
    WireFormatError,
    non_finite_values,
    out_of_range_int8,
    parse_header,
)

__all__ = [
    "DIGEST_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_NUMEL",
    "SUPPORTED_VERSIONS",
    "ContributionDecoder",
    "ContributionHeader",
    "ContributionMeta",
    "FrameSink",
    "NonFiniteWireError",
    "TensorSpec",
    "WireFormatError",
    "checked_decode",
    "contribution_nbytes",
    "decode_contribution",
    "encode_contribution",
    "non_finite_values",
    "out_of_range_int8",
]

_LITTLE_ENDIAN = sys.byteorder == "little"


# ---------------------------------------------------------------- decoding


class _Stage(enum.Enum):
    PREFIX = "the prefix (magic and header length)"  # fixed 12 bytes, buffered
    HEADER = "the header"  # header-length bytes of msgpack, buffered
    DATA = "data"  # a tensor's data frame, copied into its preallocated tensor
    SCALES = "scales"  # a tensor's scales frame, likewise
    TRAILER = "the sha256 trailer"  # 32 bytes, buffered, compared with the running digest
    DONE = "done"  # nothing more may arrive


class FrameSink(Protocol):
    """Takes a body's tensors as their bytes arrive, instead of whole tensors
    (``ContributionDecoder(sink=...)``): memory stays O(chunk) whatever the tensor sizes.

    For each tensor in header order: ``begin``, ``data`` for each piece of its data frame
    (pieces split anywhere, even inside a value), ``end_data``, then ``end`` with its scales
    (a small frame, 4 bytes per block: checked by the decoder, then handed over whole).
    The sink owns the data frames' value checks the decoder makes on whole tensors: int8
    -128 (``out_of_range_int8``) and non-finite floats (``non_finite_values``), raised from
    ``data`` or ``end_data``. Pieces are views into the caller's chunk: use them at once.
    """

    def begin(self, spec: TensorSpec) -> None: ...
    def data(self, piece: memoryview) -> None: ...
    def end_data(self) -> None: ...
    def end(self, scales: torch.Tensor) -> None: ...


class ContributionDecoder:
    """Incremental decoder: feed chunks as they arrive, get each tensor when it completes.

    Memory is the small fixed parts plus the one tensor being filled. Tensors returned by
    ``feed`` are provisional until ``finish`` returns, because the checksum covers the
    whole body: a consumer that aggregates as it goes must be able to discard them.

    ``expected`` maps tensor names to shapes (the model's); ``codec`` is the run's codec
    description; ``max_bytes`` caps the body. Each is checked as soon as the header is
    parsed, before any tensor memory is allocated. After any error the decoder is dead.
    A server must pass ``expected`` or ``max_bytes``: without them a header may ask for up
    to ``MAX_NUMEL`` values per tensor.

    ``on_header`` is called with the validated header before any tensor byte is looked
    at (what it raises comes out of ``feed``). With a ``sink`` no tensor is ever held:
    every tensor's bytes go to it as they arrive and ``feed`` returns nothing.
    ``body_sha256`` is the sha256 of every byte fed, the trailer included, once done.

    ``digest_later`` (immutable chunks only: ``diloco.wire.digest``): the body is hashed
    by ``digest(digest_work())`` calls, on any thread, instead of as it is fed, and the
    trailer is checked by ``finish``, once all of it is hashed.
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[int, ...]] | None = None,
        *,
        codec: dict[str, Any] | None = None,
        max_bytes: int | None = None,
        on_header: Callable[[ContributionHeader], None] | None = None,
        sink: FrameSink | None = None,
        digest_later: bool = False,
    ) -> None:
        self._expected = (
            None if expected is None else {k: tuple(int(d) for d in s) for k, s in expected.items()}
        )
        self._codec = None if codec is None else codec_from_description(codec).describe()
        self._max_bytes = max_bytes
        self._on_header = on_header
        self._sink = sink
        self._digest = StreamDigest(later=digest_later)
        self._trailer: bytes | None = None  # digest_later: the trailer, checked by finish
        self._body_sha256: str | None = None
        self._received = 0
        self._header_len = 0
        self._header: ContributionHeader | None = None
        self._header_codec: Codec | None = None  # the header's codec, once it arrived
        self._error: WireFormatError | None = None
        self._index = 0  # tensor being filled, in header order
        self._data: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self._buf = bytearray()  # the fixed parts only: prefix, header, trailer
        self._dest: np.ndarray | None = None  # uint8 view of the frame being filled
        self._stage, self._size, self._filled = _Stage.PREFIX, PREFIX.size, 0

    @property
    def header(self) -> ContributionHeader | None:
        """The validated header, once it has arrived."""
        return self._header

    @property
    def body_sha256(self) -> str | None:
        """The hex sha256 of the whole body, trailer included, once the trailer matched."""
        return self._body_sha256

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[tuple[str, EncodedTensor]]:
        """Consume one chunk; return the tensors it completed, in header order."""
        if self._error is not None:
            raise WireFormatError(f"decoder already rejected this body: {self._error}")
        view = memoryview(chunk).cast("B")
        completed: list[tuple[str, EncodedTensor]] = []
        try:
            self._received += len(view)
            if self._max_bytes is not None and self._received > self._max_bytes:
                raise WireFormatError(f"body is over the {self._max_bytes}-byte limit")
            while True:
                # Parts of size zero (empty tensors, the "none" codec's scales) complete at once.
                while self._stage is not _Stage.DONE and self._filled == self._size:
                    self._complete_part(completed)
                if not len(view):
                    return completed
                if self._stage is _Stage.DONE:
                    raise WireFormatError(f"{len(view)} unexpected byte(s) after the trailer")
                view = self._consume(view)
        except WireFormatError as e:
            self._error = e
            raise

    def digest_work(self) -> list[Part]:
        """``digest_later``: the body's bytes to hash since the last call, in order."""
        return self._digest.work()

    def digest(self, work: list[Part]) -> None:
        """Hash ``digest_work``'s parts (calls in the order the work was taken)."""
        self._digest.run(work)

    def finish(self) -> None:
        """Raise unless the whole body arrived and its checksum matched."""
        if self._error is not None:
            raise WireFormatError(f"decoder already rejected this body: {self._error}")
        if self._stage is _Stage.DONE:
            if self._trailer is not None:  # digest_later: all of it hashed by now
                trailer, self._trailer = self._trailer, None
                try:
                    self._check_trailer(trailer)
                except WireFormatError as e:
                    self._error = e
                    raise
            return
        where = self._stage.value
        if self._stage in (_Stage.DATA, _Stage.SCALES):
            where = f"tensor {self._spec().name!r} {where}"
        self._error = WireFormatError(
            f"body is truncated inside {where}: got {self._filled} of {self._size} bytes "
            f"({self._received} bytes in all)"
        )
        raise self._error

    # -- state machine

    def _spec(self) -> TensorSpec:
        assert self._header is not None
        return self._header.tensors[self._index]

    def _enter(self, stage: _Stage, size: int, frame: torch.Tensor | None = None) -> None:
        self._stage, self._size, self._filled = stage, size, 0
        self._buf.clear()
        self._dest = None if frame is None else frame.numpy().view(np.uint8)

    def _consume(self, view: memoryview) -> memoryview:
        take = view[: self._size - self._filled]
        if self._stage is not _Stage.TRAILER:
            self._digest.update(take)
        if self._dest is not None:
            self._dest[self._filled : self._filled + len(take)] = np.frombuffer(take, np.uint8)
        elif self._stage is _Stage.DATA:  # with a sink: streamed, never held
            assert self._sink is not None
            self._sink.data(take)
        else:
            self._buf += take
        if self._stage is _Stage.PREFIX and not MAGIC.startswith(self._buf[: len(MAGIC)]):
            raise WireFormatError(
                f"body starts with {bytes(self._buf[: len(MAGIC)])!r}, not the magic {MAGIC!r}: "
                f"it is not a DiLoCo contribution"
            )
        self._filled += len(take)
        return view[len(take) :]

    def _complete_part(self, completed: list[tuple[str, EncodedTensor]]) -> None:
        if self._stage is _Stage.PREFIX:
            _, header_len = PREFIX.unpack(self._buf)
            if header_len > MAX_HEADER_BYTES:
                raise WireFormatError(f"header length {header_len} is over {MAX_HEADER_BYTES}")
            self._header_len = header_len
            self._enter(_Stage.HEADER, header_len)
        elif self._stage is _Stage.HEADER:
            self._header = parse_header(bytes(self._buf))
            self._header_codec = codec_from_description(self._header.meta.codec)
            self._check_header(self._header)
            if self._on_header is not None:
                self._on_header(self._header)
            self._start_tensor(0)
        elif self._stage is _Stage.DATA:
            if self._sink is not None:
                self._sink.end_data()
            else:
                assert self._data is not None
                _check_frame(self._spec().name, "data", self._data)
            self._scales = torch.empty(self._spec().n_scales, dtype=torch.float32)
            self._enter(_Stage.SCALES, 4 * self._spec().n_scales, self._scales)
        elif self._stage is _Stage.SCALES:
            assert self._scales is not None
            _check_frame(self._spec().name, "scales", self._scales)
            spec = self._spec()
            if self._sink is not None:
                self._sink.end(self._scales)
            else:
                assert self._data is not None and self._header is not None
                encoded = EncodedTensor(spec.shape, self._data, self._scales)
                if spec.dtype == "uint8":  # packed codes: the codec's own checks
                    assert self._header_codec is not None
                    checked_decode(spec.name, self._header_codec, encoded)
                completed.append((spec.name, encoded))
            self._start_tensor(self._index + 1)
        elif self._stage is _Stage.TRAILER:
            if self._digest.later:
                self._trailer = bytes(self._buf)
            else:
                self._check_trailer(bytes(self._buf))
            self._enter(_Stage.DONE, 0)

    def _check_trailer(self, trailer: bytes) -> None:
        sha = self._digest.done()
        digest = sha.digest()
        if trailer != digest:
            raise WireFormatError(
                f"checksum mismatch: body hashes to {digest.hex()[:16]}… but its trailer "
                f"says {trailer.hex()[:16]}…; it was corrupted in transit"
            )
        whole = sha.copy()  # the body's digest is the running one plus the trailer
        whole.update(trailer)
        self._body_sha256 = whole.hexdigest()

    def _start_tensor(self, index: int) -> None:
        assert self._header is not None
        self._index, self._data, self._scales = index, None, None
        if index == len(self._header.tensors):
            self._enter(_Stage.TRAILER, DIGEST_BYTES)
            return
        spec = self._spec()
        if self._sink is not None:
            self._sink.begin(spec)
            self._enter(_Stage.DATA, spec.data_bytes)
            return
        self._data = torch.empty(spec.data_len, dtype=DTYPES[spec.dtype])
        self._enter(_Stage.DATA, spec.data_bytes, self._data)

    def _check_header(self, header: ContributionHeader) -> None:
        """The caller's expectations, checked before any tensor memory is allocated."""
        if self._codec is not None and header.meta.codec != self._codec:
            raise WireFormatError(
                f"upload uses codec {header.meta.codec} but this run expects {self._codec}"
            )
        if self._expected is not None:
            got = {s.name: s.shape for s in header.tensors}
            missing = sorted(set(self._expected) - set(got))
            unexpected = sorted(set(got) - set(self._expected))
            if missing or unexpected:
                raise WireFormatError(
                    f"tensor names do not match the model: missing {missing}, "
                    f"unexpected {unexpected}"
                )
            for name, shape in got.items():
                if shape != self._expected[name]:
                    raise WireFormatError(
                        f"tensor {name!r} has shape {list(shape)}, "
                        f"expected {list(self._expected[name])}"
                    )
        frames = sum(s.frame_bytes for s in header.tensors)
        declared = PREFIX.size + self._header_len + frames + DIGEST_BYTES
        if self._max_bytes is not None and declared > self._max_bytes:
            raise WireFormatError(
                f"body declares {declared} bytes, over the {self._max_bytes}-byte limit"
            )


def _check_frame(name: str, part: str, x: torch.Tensor) -> None:
    """Reject values a codec can never produce: NaN/Inf, negative scales, int8 -128.
    (On a big-endian host it first swaps float32 frames to native order, in place.)"""
    if x.dtype == torch.float32:
        if not _LITTLE_ENDIAN:
            x.numpy().byteswap(inplace=True)
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            raise non_finite_values(name, int((~finite).sum()), part)
        if part == "scales" and bool((x < 0).any()):
            raise WireFormatError(f"tensor {name!r} has negative scales")
    elif x.dtype == torch.int8 and bool((x == -INT8_MAX - 1).any()):
        raise out_of_range_int8(name)


def checked_decode(name: str, codec: Codec, encoded: EncodedTensor) -> torch.Tensor:
    """Tensor ``name`` decoded, its frames checked as its codec's decoder checks them (for
    the packed codecs of ``diloco.wire.lowbit``: sizes, indices, codes, pad bits, scales);
    a WireFormatError naming the tensor otherwise."""
    try:
        return codec.decode(encoded)
    except ValueError as e:
        raise WireFormatError(f"tensor {name!r}: {e}") from e


def decode_contribution(
    chunks: bytes | bytearray | memoryview | Iterable[bytes],
    expected: Mapping[str, tuple[int, ...]] | None = None,
    *,
    codec: dict[str, Any] | None = None,
    max_bytes: int | None = None,
) -> tuple[ContributionMeta, dict[str, EncodedTensor]]:
    """Decode a whole body (one buffer or an iterable of chunks) and verify it."""
    decoder = ContributionDecoder(expected, codec=codec, max_bytes=max_bytes)
    parts = [chunks] if isinstance(chunks, bytes | bytearray | memoryview) else chunks
    tensors: dict[str, EncodedTensor] = {}
    for chunk in parts:
        tensors.update(decoder.feed(chunk))
    decoder.finish()
    assert decoder.header is not None  # finish() returned, so the header arrived
    return decoder.header.meta, tensors
