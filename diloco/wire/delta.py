"""Compressed deltas between published versions: what a returning volunteer downloads.

Every version v the server publishes also has a delta from v−1: the change of each
parameter in the run's download codec (``[compression] download``, built by
``diloco.wire.exchange.delta_codec_for``): int8 with one fp32 scale per block
(``diloco.wire.codec.Int8Codec``, 1 byte a parameter), or int4, int2 or sparse top-k
(``diloco.wire.lowbit``: 0.5, 0.25, 0.03 byte a parameter). The published parameters are
*defined* by the deltas:

    θ_v = θ_{v−1} + decode(q_v)          (fp32, elementwise: the same bits everywhere)

so a volunteer that holds θ_{v−k} and applies the k deltas gets exactly the bytes of the
full checkpoint, which it checks against the checkpoint's sha256. What the quantisation
leaves out is not lost: the server keeps the residual r_v and adds it to the next change
(error feedback), so the published parameters track the exact outer optimizer's:

    d_v = r_{v−1} − lr·u_v     (u_v the Nesterov update; r_0 = 0)
    q_v = quantise(d_v),  θ_v = θ_{v−1} + decode(q_v),  r_v = d_v − decode(q_v)

``publish_change`` is that one step on any flat piece of a tensor that starts at a
multiple of ``alignment(codec)`` values (a whole number of the codec's blocks, chunks or
packed bytes): the server applies it chunk by chunk (``diloco.outer.chunked``, writing each
piece at ``piece_offsets``), the simulator and the tests' reference to whole tensors, with
the same bits.

A delta file is a safetensors file: ``scales/<name>`` (fp32, one per block or chunk) and
``delta/<name>`` (int8 in the parameter's shape for int8; the packed bytes, uint8, for the
others), with metadata naming the format, the run, ``version`` and ``base_version`` and
the codec (its ``describe()`` as JSON). Format 1 (int8 only, a ``block_size`` key) is
still read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.wire.codec import EncodedTensor, Int8Codec, NonFiniteError, codec_from_description
from diloco.wire.lowbit import LowBitCodec, SparseCodec
from diloco.wire.tensorfile import Entry, TensorFileError, TensorFileReader, TensorFileWriter

FORMAT = "diloco-delta"
FORMAT_VERSION = "2"
READ_VERSIONS = ("1", "2")  # 1: int8 only, its block size under "block_size"
SCALES, DATA = "scales/", "delta/"
DeltaCodec = Int8Codec | LowBitCodec | SparseCodec


class DeltaError(ValueError):
    """A delta file that is not the one expected (format, run, versions, tensors)."""


def alignment(codec: DeltaCodec) -> int:
    """Where a piece of a tensor may start for ``publish_change``: a multiple of this many
    values (whole scale blocks or sparse chunks, and whole bytes of packed codes)."""
    if isinstance(codec, SparseCodec):
        return codec.chunk
    if isinstance(codec, LowBitCodec):
        return math.lcm(codec.block_size, codec.per_byte)
    return codec.block_size


def piece_offsets(codec: DeltaCodec, start: int) -> tuple[int, int]:
    """Where the encoding of the piece that starts at value ``start`` (a multiple of
    ``alignment``) goes in its tensor's data and scales entries: (element, scale)."""
    return codec.data_nbytes(start), codec.n_scales(start)


def publish_change(d: torch.Tensor, codec: DeltaCodec) -> tuple[EncodedTensor, torch.Tensor]:
    """The published change for a flat fp32 piece ``d`` of a tensor's wanted change:
    (its encoding, the decoded change volunteers will add). Raises ``NonFiniteError``
    when ``d`` is not finite."""
    encoded = codec.encode(d)
    return encoded, codec.decode(encoded).reshape(-1)


def apply_change(theta: torch.Tensor, change: torch.Tensor) -> None:
    """θ ← θ + change, in place: the one way a published change is applied."""
    theta.add_(change)


def _data_entry(name: str, shape: tuple[int, ...], codec: DeltaCodec) -> Entry:
    if isinstance(codec, Int8Codec):
        return Entry(DATA + name, torch.int8, tuple(shape))
    return Entry(DATA + name, torch.uint8, (codec.data_nbytes(math.prod(shape)),))


def entries(shapes: Mapping[str, tuple[int, ...]], codec: DeltaCodec) -> list[Entry]:
    out = [
        Entry(SCALES + n, torch.float32, (codec.n_scales(math.prod(s)),)) for n, s in shapes.items()
    ]
    return out + [_data_entry(n, s, codec) for n, s in shapes.items()]


def metadata(
    *, run_id: str, version: int, base_version: int, names: list[str], codec: DeltaCodec
) -> dict[str, str]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "version": str(version),
        "base_version": str(base_version),
        "codec": json.dumps(codec.describe(), sort_keys=True),
        "param_names": json.dumps(names),
    }


def write_delta(
    path: Path,
    encoded: Mapping[str, EncodedTensor],
    *,
    run_id: str,
    version: int,
    base_version: int,
    codec: DeltaCodec,
) -> str:
    """Write a whole delta at once (the simulator, tests); returns its sha256."""
    shapes = {n: e.shape for n, e in encoded.items()}
    meta = metadata(
        run_id=run_id, version=version, base_version=base_version, names=list(shapes), codec=codec
    )
    with TensorFileWriter(path, entries(shapes, codec), meta) as out:
        for name, e in encoded.items():
            out.write(SCALES + name, 0, e.scales)
            out.write(DATA + name, 0, e.data.reshape(-1))
        return out.commit()


@dataclass(frozen=True)
class Delta:
    run_id: str
    version: int
    base_version: int
    codec: DeltaCodec
    tensors: dict[str, EncodedTensor]


def read_delta(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> Delta:
    """Read and check a delta file against the model's parameter shapes."""
    try:
        with TensorFileReader(path) as f:
            codec, version, base = _checked(f, shapes)
            tensors = {n: _encoded(f, n, shapes[n]) for n in shapes}
            run_id = f.metadata.get("run_id", "")
    except TensorFileError as err:
        raise DeltaError(str(err)) from err
    return Delta(run_id, version, base, codec, tensors)


class DeltaFile:
    """A delta file, open and checked as ``read_delta`` checks it against ``shapes``
    (``flat``: each only by its number of values), applied a tensor at a time: the memory
    of one tensor of it, not of the delta."""

    def __init__(
        self, path: Path, shapes: Mapping[str, tuple[int, ...]], *, flat: bool = False
    ) -> None:
        self._shapes = dict(shapes)
        try:
            self._f = TensorFileReader(path)
        except TensorFileError as err:
            raise DeltaError(str(err)) from err
        try:
            self.codec, self.version, self.base_version = _checked(self._f, shapes, flat=flat)
        except BaseException:
            self._f.close()
            raise

    def apply(self, name: str, theta: torch.Tensor) -> None:
        """θ ← θ + decode(q) for the parameter ``name`` (``apply_delta``'s rules)."""
        try:
            encoded = _encoded(self._f, name, self._shapes[name])
        except TensorFileError as err:
            raise DeltaError(str(err)) from err
        _apply_one(name, theta, self.codec, encoded)

    def close(self) -> None:
        self._f.close()


def apply_delta_file(params: Mapping[str, torch.Tensor], path: Path) -> None:
    """``apply_delta`` of the delta file at ``path`` to ``params`` (flat, contiguous fp32
    views, in the model's order), a tensor at a time (``DeltaFile``)."""
    delta = DeltaFile(path, {n: (t.numel(),) for n, t in params.items()}, flat=True)
    try:
        for name, theta in params.items():
            delta.apply(name, theta)
    finally:
        delta.close()


def _checked(
    f: TensorFileReader, shapes: Mapping[str, tuple[int, ...]], *, flat: bool = False
) -> tuple[DeltaCodec, int, int]:
    """The delta file's codec, version and base version, once its format, its parameters'
    names and its tensors' layout are those of a delta of ``shapes`` (``flat``: each shape
    only by its number of values)."""
    meta, path = f.metadata, f.path
    if meta.get("format") != FORMAT or meta.get("format_version") not in READ_VERSIONS:
        raise DeltaError(f"{path} is not a {FORMAT} file of a format {READ_VERSIONS}")
    try:
        codec = _codec_of(meta)
        version, base = int(meta["version"]), int(meta["base_version"])
        names = json.loads(meta["param_names"])
    except (KeyError, ValueError, TypeError) as err:
        raise DeltaError(f"{path} has malformed metadata: {err}") from err
    if names != list(shapes):
        raise DeltaError(f"{path} is a delta of other parameters than this model's")
    got = {e.name: (e.dtype, e.numel if flat else e.shape) for e in f.entries.values()}
    want = {e.name: (e.dtype, e.numel if flat else e.shape) for e in entries(shapes, codec)}
    if got != want:
        raise DeltaError(f"{path} holds tensors that do not fit this model")
    return codec, version, base


def _encoded(f: TensorFileReader, name: str, shape: tuple[int, ...]) -> EncodedTensor:
    return EncodedTensor(tuple(shape), f.tensor(DATA + name).reshape(-1), f.tensor(SCALES + name))


def _codec_of(meta: Mapping[str, str]) -> DeltaCodec:
    if meta["format_version"] == "1":
        return Int8Codec(int(meta["block_size"]))
    codec = codec_from_description(json.loads(meta["codec"]))
    if not isinstance(codec, DeltaCodec):
        raise ValueError(f"a delta cannot be in the {codec.kind!r} codec")
    return codec


def apply_delta(params: Mapping[str, torch.Tensor], delta: Delta) -> None:
    """θ ← θ + decode(q), in place, for every parameter (fp32, contiguous); a packed
    body that does not decode (``diloco.wire.lowbit``'s strict checks) is a DeltaError."""
    if params.keys() != delta.tensors.keys():
        raise DeltaError("the delta names other parameters than the model's")
    for name, theta in params.items():
        _apply_one(name, theta, delta.codec, delta.tensors[name])


def _apply_one(name: str, theta: torch.Tensor, codec: DeltaCodec, encoded: EncodedTensor) -> None:
    if theta.dtype != torch.float32 or not theta.is_contiguous():
        raise DeltaError(f"parameter {name!r} must be contiguous fp32 to take a delta")
    try:
        change = codec.decode(encoded)
    except ValueError as err:
        raise DeltaError(f"the delta of {name!r} does not decode: {err}") from err
    if not bool(torch.isfinite(change).all()):
        raise DeltaError(f"the delta of {name!r} is not finite")
    apply_change(theta.view(-1), change.view(-1))


def catch_up(
    have: int, target: int, *, full_nbytes: int, delta_nbytes: Mapping[int, int]
) -> list[int] | None:
    """The versions whose deltas take a volunteer from ``have`` to ``target``, when they
    exist and add up to fewer bytes than the full checkpoint; None: fetch the full one."""
    wanted = list(range(have + 1, target + 1))
    if not wanted or have < 0 or any(v not in delta_nbytes for v in wanted):
        return None
    return wanted if sum(delta_nbytes[v] for v in wanted) < full_nbytes else None


__all__ = [
    "Delta",
    "DeltaCodec",
    "DeltaError",
    "NonFiniteError",
    "alignment",
    "apply_change",
    "apply_delta",
    "catch_up",
    "piece_offsets",
    "publish_change",
    "read_delta",
    "write_delta",
]
