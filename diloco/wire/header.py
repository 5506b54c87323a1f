"""The contribution header: constants, errors, the header dataclasses, and the msgpack
header schema — building it for the encoder, parsing and validating it for the decoder.

``diloco.wire.contribution`` streams the body around this header and re-exports every public name
defined here; ``docs/protocol.md`` is the full contract. The header is small and
self-describing msgpack, never pickle: nothing from the network may construct objects.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from diloco.config import INT32_MAX
from diloco.wire.codec import (
    INT8_MAX,
    Codec,
    EncodedTensor,
    NonFiniteError,
    codec_from_description,
)

__all__ = [
    "DIGEST_BYTES",
    "DTYPES",
    "FORMAT_VERSION",
    "FRESH",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_NUMEL",
    "PREFIX",
    "SUPPORTED_VERSIONS",
    "ContributionHeader",
    "ContributionMeta",
    "NonFiniteWireError",
    "ReplayRecord",
    "TensorSpec",
    "WireFormatError",
    "body_bytes",
    "parse_header",
    "prefix_and_header",
    "spec_of",
    "specs_for",
]

MAGIC = b"DILOCO-C"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (FORMAT_VERSION,)
MAX_HEADER_BYTES = 16 << 20  # a header describes tensors; it never needs to be large
MAX_NUMEL = 1 << 40  # per tensor; refuses absurd shapes before anything is allocated
DIGEST_BYTES = 32
PREFIX = struct.Struct("<8sI")  # magic, header length
# uint8: packed low-bit and sparse codes (diloco.wire.lowbit), whose data length is the codec's
DTYPES = {"int8": torch.int8, "float32": torch.float32, "uint8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_HEADER_KEYS = (
    "format_version", "run_id", "round", "base_version", "tokens", "inner_steps", "loss",
    "codec", "tensors", "replay",
)  # fmt: skip
_REPLAY_KEYS = ("start", "precision", "micro_batch")
# the precisions a volunteer trains in (diloco.precision) and the most sequences a pass holds
REPLAY_PRECISIONS = ("fp32", "bf16", "fp16")
MAX_MICRO_BATCH = 4096
FRESH = "fresh"  # a replay record's start: a new AdamW state, nothing to reveal
_TENSOR_KEYS = ("name", "shape", "dtype", "n_scales")
# what each integer of the header may be: indices and step counts are 32-bit wherever they
# are stored (Postgres integers); tokens are a float64 aggregation weight, exact to 2^53
META_RANGES = {
    "round": (0, INT32_MAX),
    "base_version": (0, INT32_MAX),
    "tokens": (1, 1 << 53),
    "inner_steps": (1, INT32_MAX),
}


class WireFormatError(ValueError):
    """The body is not a valid contribution; the message says what is wrong and where."""


class NonFiniteWireError(WireFormatError, NonFiniteError):
    """A frame holds NaN/Inf (float32 data or scales)."""


def non_finite_values(name: str, count: int, part: str) -> NonFiniteWireError:
    """The refusal of a frame with ``count`` NaN/Inf values (``part``: data or scales)."""
    return NonFiniteWireError(
        f"tensor {name!r} has {count} non-finite value(s) (NaN/Inf) in its {part}"
    )


def out_of_range_int8(name: str) -> WireFormatError:
    """The refusal of an int8 data frame holding -128, which no codec produces."""
    return WireFormatError(
        f"tensor {name!r} has int8 value {-INT8_MAX - 1}, outside [-{INT8_MAX}, {INT8_MAX}]"
    )


@dataclass(frozen=True)
class ContributionMeta:
    run_id: str
    round: int
    base_version: int  # the checkpoint version the contributor started from
    tokens: int  # aggregation weight
    inner_steps: int
    loss: float  # mean train loss of the inner loop, for the dashboard
    codec: dict[str, Any] = field(hash=False)  # the codec's describe()
    # what an audit needs to re-run the lease (docs/verification.md); None: not replayable
    # (the volunteer trained ahead of the lease, or a client from before replay records)
    replay: ReplayRecord | None = None


@dataclass(frozen=True)
class ReplayRecord:
    """How a contribution was trained, beyond its lease: the AdamW state it started from,
    committed as the SHA-256 of the state file the volunteer keeps (``FRESH``: a new
    optimizer), revealed only if the server audits it; its precision and micro-batch."""

    start: str  # 64 lowercase hex digits, or FRESH
    precision: str  # one of REPLAY_PRECISIONS
    micro_batch: int

    def check(self) -> None:
        if self.start != FRESH and not (
            len(self.start) == 64 and all(c in "0123456789abcdef" for c in self.start)
        ):
            raise WireFormatError(
                f"header replay 'start' must be {FRESH!r} or 64 lowercase hex digits"
            )
        if self.precision not in REPLAY_PRECISIONS:
            raise WireFormatError(
                f"header replay 'precision' must be one of {list(REPLAY_PRECISIONS)}, "
                f"got {self.precision!r}"
            )
        if not 1 <= self.micro_batch <= MAX_MICRO_BATCH:
            raise WireFormatError(
                f"header replay 'micro_batch' must be 1..{MAX_MICRO_BATCH}, got {self.micro_batch}"
            )


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "int8" | "float32" | "uint8"
    n_scales: int
    # the data frame's length: numel values of dtype, or a packed codec's bytes
    # (``Codec.data_nbytes``); never on the wire, the codec and the shape say it
    data_bytes: int = -1

    def __post_init__(self) -> None:
        if self.data_bytes < 0:
            object.__setattr__(self, "data_bytes", self.numel * DTYPES[self.dtype].itemsize)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def data_len(self) -> int:
        """Values of ``dtype`` in the data frame."""
        return self.data_bytes // DTYPES[self.dtype].itemsize

    @property
    def frame_bytes(self) -> int:
        return self.data_bytes + 4 * self.n_scales


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
    for key, (low, high) in META_RANGES.items():
        if not low <= getattr(meta, key) <= high:
            raise WireFormatError(
                f"header key {key!r} must be {low}..{high}, got {getattr(meta, key)}"
            )
    if not math.isfinite(meta.loss):
        raise WireFormatError(f"header key 'loss' must be finite, got {meta.loss}")
    if meta.replay is not None:
        meta.replay.check()


def _replay_of(h: Mapping[str, Any]) -> ReplayRecord | None:
    if "replay" not in h:
        return None
    r = _get(h, "replay", dict, "header")
    _check_keys(r, _REPLAY_KEYS, "header replay")
    return ReplayRecord(
        start=_get(r, "start", str, "header replay"),
        precision=_get(r, "precision", str, "header replay"),
        micro_batch=_get(r, "micro_batch", int, "header replay"),
    )


def _check_spec(spec: TensorSpec, codec: Codec) -> None:
    """A tensor's dtype and scale count must be what its codec produces for its shape."""
    if spec.numel > MAX_NUMEL:
        raise WireFormatError(f"tensor {spec.name!r} has {spec.numel} values, over {MAX_NUMEL}")
    if DTYPES[spec.dtype] != codec.data_dtype:
        raise WireFormatError(
            f"tensor {spec.name!r} has dtype {spec.dtype} but codec {codec.kind!r} "
            f"produces {_DTYPE_NAMES[codec.data_dtype]}"
        )
    if spec.n_scales != codec.n_scales(spec.numel):
        raise WireFormatError(
            f"tensor {spec.name!r} declares {spec.n_scales} scales but codec "
            f"{codec.describe()} needs {codec.n_scales(spec.numel)} for {spec.numel} values"
        )
    if spec.data_bytes != codec.data_nbytes(spec.numel):
        raise WireFormatError(
            f"tensor {spec.name!r} has {spec.data_bytes} data bytes but codec "
            f"{codec.describe()} needs {codec.data_nbytes(spec.numel)} for {spec.numel} values"
        )


def parse_header(raw: bytes) -> ContributionHeader:
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
        replay=_replay_of(h),
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
        if dtype not in DTYPES:
            raise WireFormatError(f"{where} key 'dtype' must be one of {list(DTYPES)}: {dtype!r}")
        n_scales = _get(t, "n_scales", int, where)
        name = _get(t, "name", str, where)
        numel = math.prod(shape)
        if numel > MAX_NUMEL:
            raise WireFormatError(f"tensor {name!r} has {numel} values, over {MAX_NUMEL}")
        spec = TensorSpec(name, tuple(shape), dtype, n_scales, codec.data_nbytes(numel))
        _check_spec(spec, codec)
        specs.append(spec)
    twice = sorted(name for name, n in Counter(s.name for s in specs).items() if n > 1)
    if twice:
        raise WireFormatError(f"header names tensor(s) more than once: {twice}")
    return ContributionHeader(meta, tuple(specs))


# ---------------------------------------------------------------- header building


def spec_of(name: str, t: EncodedTensor) -> TensorSpec:
    data, scales = t.data, t.scales
    if data.dtype not in _DTYPE_NAMES or scales.dtype != torch.float32:
        raise WireFormatError(
            f"tensor {name!r} has data {data.dtype} and scales {scales.dtype}; "
            f"the wire carries int8/float32 data and float32 scales"
        )
    for part, x in (("data", data), ("scales", scales)):
        if x.dim() != 1 or not x.is_contiguous() or x.device.type != "cpu":
            raise WireFormatError(f"tensor {name!r} {part} must be 1-D, contiguous, on the CPU")
    if data.dtype != torch.uint8 and data.numel() != t.numel:
        raise WireFormatError(
            f"tensor {name!r} has {data.numel()} values for shape {list(t.shape)} ({t.numel})"
        )
    shape = tuple(int(d) for d in t.shape)
    nbytes = data.numel() * data.element_size()
    return TensorSpec(name, shape, _DTYPE_NAMES[data.dtype], scales.numel(), nbytes)


def specs_for(codec: Codec, shapes: Mapping[str, tuple[int, ...]]) -> list[TensorSpec]:
    """The tensor specs of a contribution of parameters of these ``shapes`` in ``codec``,
    known before anything is encoded (what ``spec_of`` gives of the encoded tensors)."""
    dtype = _DTYPE_NAMES[codec.data_dtype]
    return [
        TensorSpec(
            name,
            tuple(shape),
            dtype,
            codec.n_scales(math.prod(shape)),
            codec.data_nbytes(math.prod(shape)),
        )
        for name, shape in shapes.items()
    ]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name of a data dtype (``DTYPES``' key)."""
    return _DTYPE_NAMES[dtype]


def body_bytes(head_bytes: int, specs: list[TensorSpec]) -> int:
    """A contribution body's size: ``head_bytes`` of prefix and header, then the frames of
    ``specs`` and the digest."""
    return head_bytes + sum(s.frame_bytes for s in specs) + DIGEST_BYTES


def prefix_and_header(meta: ContributionMeta, specs: list[TensorSpec]) -> bytes:
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
    if meta.replay is not None:
        r = meta.replay
        header["replay"] = {
            "start": r.start,
            "precision": r.precision,
            "micro_batch": r.micro_batch,
        }
    raw: bytes = msgpack.packb(header, use_bin_type=True)
    if len(raw) > MAX_HEADER_BYTES:
        raise WireFormatError(f"header is {len(raw)} bytes, over the {MAX_HEADER_BYTES} limit")
    return PREFIX.pack(MAGIC, len(raw)) + raw
