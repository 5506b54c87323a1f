"""The contribution upload format: a msgpack header, raw tensor frames, a sha256 trailer.

Body layout (all integers little-endian; ``docs/protocol.md`` is the full contract)::

    MAGIC (8) | header length u32 (4) | header (msgpack map) |
    for each tensor in header order: data (numel · itemsize) | scales (4 · n_scales) |
    sha256 of every preceding byte (32)

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
import hashlib
import itertools
import math
import struct
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from diloco.codec import (
    INT8_MAX,
    Codec,
    EncodedTensor,
    NonFiniteError,
    codec_from_description,
)

MAGIC = b"DILOCO-C"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (FORMAT_VERSION,)
MAX_HEADER_BYTES = 16 << 20  # a header describes tensors; it never needs to be large
MAX_NUMEL = 1 << 40  # per tensor; refuses absurd shapes before anything is allocated
DIGEST_BYTES = 32
_PREFIX = struct.Struct("<8sI")  # magic, header length
_DTYPES = {"int8": torch.int8, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_HEADER_KEYS = (
    "format_version", "run_id", "round", "base_version", "tokens", "inner_steps", "loss",
    "codec", "tensors",
)  # fmt: skip
_TENSOR_KEYS = ("name", "shape", "dtype", "n_scales")
_LITTLE_ENDIAN = sys.byteorder == "little"


class WireFormatError(ValueError):
    """The body is not a valid contribution; the message says what is wrong and where."""


class NonFiniteWireError(WireFormatError, NonFiniteError):
    """A frame holds NaN/Inf (float32 data or scales)."""


@dataclass(frozen=True)
class ContributionMeta:
    run_id: str
    round: int
    base_version: int  # the checkpoint version the contributor started from
    tokens: int  # aggregation weight
    inner_steps: int
    loss: float  # mean train loss of the inner loop, for the dashboard
    codec: dict[str, Any] = field(hash=False)  # the codec's describe()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "int8" | "float32"
    n_scales: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def frame_bytes(self) -> int:
        return self.numel * _DTYPES[self.dtype].itemsize + 4 * self.n_scales


@dataclass(frozen=True)
class ContributionHeader:
    meta: ContributionMeta
    tensors: tuple[TensorSpec, ...]


# ---------------------------------------------------------------- header validation


def _get(m: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    if key not in m:
        raise WireFormatError(f"{where} is missing the key {key!r}")
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = " or ".join(
            k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,))
        )
        raise WireFormatError(f"{where} key {key!r} must be {expected}, got {type(value).__name__}")
    return value


def _check_keys(m: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in m if k not in keys)
    if unknown:
        raise WireFormatError(f"{where} has unknown key(s) {unknown} (format {FORMAT_VERSION})")


def _codec_of(description: object, where: str) -> Codec:
    try:
        return codec_from_description(description)
    except ValueError as e:
        raise WireFormatError(f"{where} is invalid: {e}") from e


def _check_meta(meta: ContributionMeta) -> None:
    """Range checks shared by encoder and decoder, so a client cannot send what the
    server would refuse."""
    if not meta.run_id:
        raise WireFormatError("header key 'run_id' must not be empty")
    for key, low in (("round", 0), ("base_version", 0), ("tokens", 1), ("inner_steps", 1)):
        if getattr(meta, key) < low:
            raise WireFormatError(f"header key {key!r} must be >= {low}, got {getattr(meta, key)}")
    if not math.isfinite(meta.loss):
        raise WireFormatError(f"header key 'loss' must be finite, got {meta.loss}")


def _check_spec(spec: TensorSpec, codec: Codec) -> None:
    """A tensor's dtype and scale count must be what its codec produces for its shape."""
    if spec.numel > MAX_NUMEL:
        raise WireFormatError(f"tensor {spec.name!r} has {spec.numel} values, over {MAX_NUMEL}")
    if _DTYPES[spec.dtype] != codec.data_dtype:
        raise WireFormatError(
            f"tensor {spec.name!r} has dtype {spec.dtype} but codec {codec.kind!r} "
            f"produces {_DTYPE_NAMES[codec.data_dtype]}"
        )
    if spec.n_scales != codec.n_scales(spec.numel):
        raise WireFormatError(
            f"tensor {spec.name!r} declares {spec.n_scales} scales but codec "
            f"{codec.describe()} needs {codec.n_scales(spec.numel)} for {spec.numel} values"
        )


def _parse_header(raw: bytes) -> ContributionHeader:
    try:
        # No ext_hook/object_hook: msgpack can only build dicts, lists, str, bytes, numbers.
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireFormatError(f"header is not valid msgpack: {e}") from e
    if not isinstance(h, dict):
        raise WireFormatError(f"header must be a msgpack map, got {type(h).__name__}")
    version = _get(h, "format_version", int, "header")
    if version not in SUPPORTED_VERSIONS:
        raise WireFormatError(
            f"unsupported format_version {version}; this side supports {list(SUPPORTED_VERSIONS)}"
        )
    _check_keys(h, _HEADER_KEYS, "header")
    codec = _codec_of(_get(h, "codec", dict, "header"), "header key 'codec'")
    meta = ContributionMeta(
        run_id=_get(h, "run_id", str, "header"),
        round=_get(h, "round", int, "header"),
        base_version=_get(h, "base_version", int, "header"),
        tokens=_get(h, "tokens", int, "header"),
        inner_steps=_get(h, "inner_steps", int, "header"),
        loss=float(_get(h, "loss", (int, float), "header")),
        codec=codec.describe(),
    )
    _check_meta(meta)
    specs: list[TensorSpec] = []
    for i, t in enumerate(_get(h, "tensors", list, "header")):
        where = f"header tensors[{i}]"
        if not isinstance(t, dict):
            raise WireFormatError(f"{where} must be a map, got {type(t).__name__}")
        _check_keys(t, _TENSOR_KEYS, where)
        shape = _get(t, "shape", list, where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise WireFormatError(f"{where} key 'shape' must be a list of ints >= 0: {shape}")
        dtype = _get(t, "dtype", str, where)
        if dtype not in _DTYPES:
            raise WireFormatError(f"{where} key 'dtype' must be one of {list(_DTYPES)}: {dtype!r}")
        n_scales = _get(t, "n_scales", int, where)
        spec = TensorSpec(_get(t, "name", str, where), tuple(shape), dtype, n_scales)
        _check_spec(spec, codec)
        specs.append(spec)
    twice = sorted(name for name, n in Counter(s.name for s in specs).items() if n > 1)
    if twice:
        raise WireFormatError(f"header names tensor(s) more than once: {twice}")
    return ContributionHeader(meta, tuple(specs))


# ---------------------------------------------------------------- encoding


def _spec_of(name: str, t: EncodedTensor) -> TensorSpec:
    data, scales = t.data, t.scales
    if data.dtype not in _DTYPE_NAMES or scales.dtype != torch.float32:
        raise WireFormatError(
            f"tensor {name!r} has data {data.dtype} and scales {scales.dtype}; "
            f"the wire carries int8/float32 data and float32 scales"
        )
    for part, x in (("data", data), ("scales", scales)):
        if x.dim() != 1 or not x.is_contiguous() or x.device.type != "cpu":
            raise WireFormatError(f"tensor {name!r} {part} must be 1-D, contiguous, on the CPU")
    if data.numel() != t.numel:
        raise WireFormatError(
            f"tensor {name!r} has {data.numel()} values for shape {list(t.shape)} ({t.numel})"
        )
    shape = tuple(int(d) for d in t.shape)
    return TensorSpec(name, shape, _DTYPE_NAMES[data.dtype], scales.numel())


def _prefix_and_header(meta: ContributionMeta, specs: list[TensorSpec]) -> bytes:
    _check_meta(meta)
    codec = _codec_of(meta.codec, "meta.codec")
    for spec in specs:
        _check_spec(spec, codec)
    header = {
        "format_version": FORMAT_VERSION,
        "run_id": meta.run_id,
        "round": meta.round,
        "base_version": meta.base_version,
        "tokens": meta.tokens,
        "inner_steps": meta.inner_steps,
        "loss": float(meta.loss),
        "codec": codec.describe(),
        "tensors": [
            {"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "n_scales": s.n_scales}
            for s in specs
        ],
    }
    raw: bytes = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER_BYTES:
        raise WireFormatError(f"header is {len(raw)} bytes, over the {MAX_HEADER_BYTES} limit")
    return _PREFIX.pack(MAGIC, len(raw)) + raw


def contribution_nbytes(meta: ContributionMeta, tensors: Mapping[str, EncodedTensor]) -> int:
    """The exact body size ``encode_contribution`` will produce (for Content-Length)."""
    specs = [_spec_of(name, t) for name, t in tensors.items()]
    return len(_prefix_and_header(meta, specs)) + sum(s.frame_bytes for s in specs) + DIGEST_BYTES


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
    prefix = _prefix_and_header(meta, [_spec_of(name, t) for name, t in items])

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


# ---------------------------------------------------------------- decoding


class _Stage(enum.Enum):
    PREFIX = "the prefix (magic and header length)"  # fixed 12 bytes, buffered
    HEADER = "the header"  # header-length bytes of msgpack, buffered
    DATA = "data"  # a tensor's data frame, copied into its preallocated tensor
    SCALES = "scales"  # a tensor's scales frame, likewise
    TRAILER = "the sha256 trailer"  # 32 bytes, buffered, compared with the running digest
    DONE = "done"  # nothing more may arrive


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
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[int, ...]] | None = None,
        *,
        codec: dict[str, Any] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self._expected = (
            None if expected is None else {k: tuple(int(d) for d in s) for k, s in expected.items()}
        )
        self._codec = None if codec is None else codec_from_description(codec).describe()
        self._max_bytes = max_bytes
        self._digest = hashlib.sha256()
        self._received = 0
        self._header_len = 0
        self._header: ContributionHeader | None = None
        self._error: WireFormatError | None = None
        self._index = 0  # tensor being filled, in header order
        self._data: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self._buf = bytearray()  # the fixed parts only: prefix, header, trailer
        self._dest: np.ndarray | None = None  # uint8 view of the frame being filled
        self._stage, self._size, self._filled = _Stage.PREFIX, _PREFIX.size, 0

    @property
    def header(self) -> ContributionHeader | None:
        """The validated header, once it has arrived."""
        return self._header

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

    def finish(self) -> None:
        """Raise unless the whole body arrived and its checksum matched."""
        if self._error is not None:
            raise WireFormatError(f"decoder already rejected this body: {self._error}")
        if self._stage is _Stage.DONE:
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
        if self._dest is not None:
            self._dest[self._filled : self._filled + len(take)] = np.frombuffer(take, np.uint8)
        else:
            self._buf += take
        if self._stage is not _Stage.TRAILER:
            self._digest.update(take)
        if self._stage is _Stage.PREFIX and not MAGIC.startswith(self._buf[: len(MAGIC)]):
            raise WireFormatError(
                f"body starts with {bytes(self._buf[: len(MAGIC)])!r}, not the magic {MAGIC!r}: "
                f"it is not a DiLoCo contribution"
            )
        self._filled += len(take)
        return view[len(take) :]

    def _complete_part(self, completed: list[tuple[str, EncodedTensor]]) -> None:
        if self._stage is _Stage.PREFIX:
            _, header_len = _PREFIX.unpack(self._buf)
            if header_len > MAX_HEADER_BYTES:
                raise WireFormatError(f"header length {header_len} is over {MAX_HEADER_BYTES}")
            self._header_len = header_len
            self._enter(_Stage.HEADER, header_len)
        elif self._stage is _Stage.HEADER:
            self._header = _parse_header(bytes(self._buf))
            self._check_header(self._header)
            self._start_tensor(0)
        elif self._stage is _Stage.DATA:
            assert self._data is not None
            _check_frame(self._spec().name, "data", self._data)
            self._scales = torch.empty(self._spec().n_scales, dtype=torch.float32)
            self._enter(_Stage.SCALES, 4 * self._spec().n_scales, self._scales)
        elif self._stage is _Stage.SCALES:
            assert self._data is not None and self._scales is not None
            _check_frame(self._spec().name, "scales", self._scales)
            spec = self._spec()
            completed.append((spec.name, EncodedTensor(spec.shape, self._data, self._scales)))
            self._start_tensor(self._index + 1)
        elif self._stage is _Stage.TRAILER:
            digest = self._digest.digest()
            if bytes(self._buf) != digest:
                raise WireFormatError(
                    f"checksum mismatch: body hashes to {digest.hex()[:16]}… but its trailer "
                    f"says {bytes(self._buf).hex()[:16]}…; it was corrupted in transit"
                )
            self._enter(_Stage.DONE, 0)

    def _start_tensor(self, index: int) -> None:
        assert self._header is not None
        self._index, self._data, self._scales = index, None, None
        if index == len(self._header.tensors):
            self._enter(_Stage.TRAILER, DIGEST_BYTES)
            return
        spec = self._spec()
        self._data = torch.empty(spec.numel, dtype=_DTYPES[spec.dtype])
        self._enter(_Stage.DATA, spec.numel * self._data.element_size(), self._data)

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
        declared = _PREFIX.size + self._header_len + frames + DIGEST_BYTES
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
            raise NonFiniteWireError(
                f"tensor {name!r} has {int((~finite).sum())} non-finite value(s) (NaN/Inf) "
                f"in its {part}"
            )
        if part == "scales" and bool((x < 0).any()):
            raise WireFormatError(f"tensor {name!r} has negative scales")
    elif bool((x == -INT8_MAX - 1).any()):
        raise WireFormatError(
            f"tensor {name!r} has int8 value {-INT8_MAX - 1}, outside [-{INT8_MAX}, {INT8_MAX}]"
        )


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
