"""Contributions from volunteers we do not know: checked after decoding, combined robustly.

**Inspection** (``UploadInspector``), as an upload streams in: every tensor must decode to
finite values (an int8 frame with a finite but huge scale decodes to Inf), the payload's
L2 norm is measured, and the decoded payload gets a digest (the same tensors replayed by
someone else are recognised whatever header they come with).

**Aggregation**, at the close, as the run's ``[aggregation] method`` says. The close
(``diloco.outer.close``) computes it in its chunked pass over the stored uploads
(``diloco.outer.chunked``) with ``clip_factors``, ``distances`` and ``centre_pulls`` from
here; ``robust_aggregate`` is the same arithmetic on whole tensors, in memory, which the
tests hold the pass to:

- ``mean``: Σ wᵢΔᵢ / Σ wᵢ, the weights wᵢ the tokens each contribution counts for.
- ``clipped_mean`` (the default): each Δᵢ is first scaled by
  cᵢ = min(1, clip_multiple · r / ‖Δᵢ‖), where r is the median norm of the round (or of
  the run's recent history too, when the round has few contributions): no contribution
  moves the model further than clip_multiple times a typical one (BTARD's bound).
- ``centered_clip``: the clipped mean v is the centre; one CenteredClip step (Karimireddy
  et al., 2021) then moves it by Σ wᵢ sᵢ (Δᵢ − v) / Σ wᵢ, with sᵢ = min(1, τ / ‖Δᵢ − v‖)
  and τ the median distance: a contribution far from the others in *direction* (a sign
  flip, noise) is bounded too, not only one that is long.

``robust_aggregate`` reads each source three times: the weighted sum (1), the dot products
with it for each contribution's cosine (2; the telemetry and the guard's culprit choice
need it), and for ``centered_clip`` the clipped distances (3); the chunked pass does (1)
and (2) in one. Norms come from the inspection at upload.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from diloco.config import AggregationSection
from diloco.outer.optimizer import AggregationError
from diloco.wire.codec import INT8_MAX, EncodedTensor, Int8Codec, codec_from_description
from diloco.wire.contribution import (
    ContributionDecoder,
    NonFiniteWireError,
    TensorSpec,
    WireFormatError,
    non_finite_values,
    out_of_range_int8,
)

Shapes = Mapping[str, tuple[int, ...]]


# ---------------------------------------------------------------- inspecting an upload


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
    a caller whose chunks are immutable (``bytes``): the pieces are kept, not copied.
    """

    def __init__(self, codec: dict, *, digest_later: bool = False) -> None:
        self._codec = codec_from_description(codec)
        if self._codec.data_dtype == torch.uint8:  # diloco.wire.lowbit: no run uses them yet
            raise ValueError(f"uploads in {self._codec.kind} are not inspected yet")
        self._sq = 0.0  # Σ x², in float64
        self._digest = hashlib.sha256()
        self._due: list[bytes | memoryview] | None = [] if digest_later else None
        # the tensor being received
        self._name = ""
        self._carry = bytearray()  # the start of a block (int8) or value (fp32) cut by a piece
        self._absmax: list[np.ndarray] = []  # int8: per block max |q| (int16)
        self._qsq: list[np.ndarray] = []  # int8: per block Σ q² (float64)
        self._tensor_sq = 0.0  # fp32: Σ x² so far
        self._non_finite = 0  # fp32: NaN/Inf values so far

    # -- the wire.FrameSink interface

    def begin(self, spec: TensorSpec) -> None:
        self._name = spec.name
        self._carry.clear()
        self._absmax, self._qsq = [], []
        self._tensor_sq, self._non_finite = 0.0, 0
        self._hash(spec.name.encode())

    def data(self, piece: memoryview) -> None:
        self._hash(piece)
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
        self._hash(scales.numpy().astype("<f4").tobytes())  # a copy: scales is reused
        if not isinstance(self._codec, Int8Codec):
            self._sq += self._tensor_sq
            return
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
        self._sq += float(np.dot(s64 * s64, qsq))

    # -- whole tensors

    def add(self, name: str, encoded: EncodedTensor) -> None:
        """One whole tensor (``ContributionDecoder.feed``'s output); as a sink would see it."""
        codec, numel = self._codec, encoded.numel
        if (
            encoded.data.dtype != codec.data_dtype
            or encoded.data.numel() != numel
            or encoded.scales.numel() != codec.n_scales(numel)
        ):
            raise ValueError(
                f"tensor {name!r} is not in {codec!r}'s form: {encoded.data.dtype}, "
                f"{encoded.scales.numel()} scales for {encoded.numel} values"
            )
        dtype = "int8" if codec.data_dtype == torch.int8 else "float32"
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

    def _hash(self, part: bytes | memoryview) -> None:
        if self._due is None:
            self._digest.update(part)
        else:
            self._due.append(part)

    def digest_work(self) -> list[bytes | memoryview]:
        """``digest_later``: the parts to digest since the last call, in order."""
        assert self._due is not None, "only with digest_later"
        work, self._due = self._due, []
        return work

    def digest(self, work: list[bytes | memoryview]) -> None:
        """Digest ``digest_work``'s parts (calls in the order the work was taken)."""
        for part in work:
            self._digest.update(part)

    @property
    def norm(self) -> float:
        return math.sqrt(self._sq)

    @property
    def payload_sha256(self) -> str:
        assert not self._due, "digest_work() is still due"
        return self._digest.hexdigest()


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


# ---------------------------------------------------------------- sources and their passes


@dataclass(frozen=True)
class Source:
    """One stored contribution, ready to be read again as often as a pass needs."""

    id: str
    weight: float  # the tokens it counts for (protocol.rules.upload_weight)
    norm: float  # ‖Δ‖, measured when it was accepted
    chunks: Callable[[], Iterable[bytes]]  # its body, from the start, on each call


class SourceUnreadable(Exception):
    """A stored contribution that cannot be read back (missing, damaged): leave it out."""

    def __init__(self, source_id: str, reason: str) -> None:
        super().__init__(f"{source_id}: {reason}")
        self.source_id, self.reason = source_id, reason


def _tensors(source: Source, shapes: Shapes, codec: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's decoded tensors in body order, checked against the model and codec; its
    trailer digest is verified at the end (a consumer discards what it summed if not)."""
    decoder = ContributionDecoder(shapes, codec=codec)
    decode = codec_from_description(codec).decode
    try:
        for chunk in source.chunks():
            for name, encoded in decoder.feed(chunk):
                yield name, decode(encoded)
        decoder.finish()
    except OSError as err:
        why = f"its stored upload cannot be read: {err.strerror}"
        raise SourceUnreadable(source.id, why) from None
    except WireFormatError as err:
        raise SourceUnreadable(source.id, f"its stored upload is damaged: {err}") from None


def _accumulate(
    into: dict[str, torch.Tensor], source: Source, scale: float, shapes: Shapes, codec: dict
) -> None:
    seen = 0
    for name, x in _tensors(source, shapes, codec):
        into[name].add_(x.view(into[name].shape), alpha=scale)
        seen += 1
    if seen != len(into):
        raise SourceUnreadable(source.id, f"its stored upload has {seen} of {len(into)} tensors")


def _dot(source: Source, v: Mapping[str, torch.Tensor], shapes: Shapes, codec: dict) -> float:
    total = 0.0
    for name, x in _tensors(source, shapes, codec):
        total += float(torch.dot(x.reshape(-1).double(), v[name].reshape(-1).double()))
    return total


# ---------------------------------------------------------------- the aggregate


@dataclass(frozen=True)
class Share:
    """What one contribution put into the aggregate, for the round's telemetry."""

    weight: float
    norm: float
    clip: float  # the factor its Δ (clipped_mean) or its distance from the centre was scaled by
    cosine: float | None  # to the aggregate's centre (None: a zero vector)
    distance: float  # ‖Δ − v‖ from the centre v: how far it pulls away from the others


@dataclass
class Aggregate:
    delta: dict[str, torch.Tensor]  # the update for the outer step
    shares: dict[str, Share] = field(default_factory=dict)  # by source id
    reference_norm: float | None = None  # r, the norm clipping compared against


def reference_norm(
    norms: Sequence[float], history: Sequence[float], policy: AggregationSection
) -> float | None:
    """r: the round's median norm; with fewer than ``reference_min`` contributions, the
    median over the run's recent history and the round together; None with nothing to
    compare against (then nothing is clipped: the guard still watches the step)."""
    pool = list(norms) if len(norms) >= policy.reference_min else [*history, *norms]
    if len(pool) < policy.reference_min:
        return None
    return statistics.median(pool)


def clip_factors(
    norms: Mapping[str, float], history: Sequence[float], policy: AggregationSection
) -> tuple[float | None, dict[str, float]]:
    """r and each contribution's cᵢ = min(1, clip_multiple · r / ‖Δᵢ‖) (all 1 for ``mean``
    or with nothing to compare against)."""
    ref = None if policy.method == "mean" else reference_norm(list(norms.values()), history, policy)
    limit = None if ref is None else policy.clip_multiple * ref
    return ref, {
        i: 1.0 if limit is None or norm <= limit else limit / norm for i, norm in norms.items()
    }


def distances(
    norms: Mapping[str, float], dots: Mapping[str, float], v_sq: float
) -> dict[str, float]:
    """‖Δᵢ − v‖ from ‖Δᵢ‖, ⟨Δᵢ, v⟩ and ‖v‖², with no further pass over the uploads."""
    return {i: math.sqrt(max(0.0, n**2 - 2 * dots[i] + v_sq)) for i, n in norms.items()}


def centre_pulls(dist: Mapping[str, float]) -> dict[str, float]:
    """CenteredClip's sᵢ = min(1, τ / ‖Δᵢ − v‖), τ the median distance."""
    tau = statistics.median(dist.values())
    return {i: 1.0 if d <= tau else tau / d for i, d in dist.items()}


def cosine(norm: float, dot: float, v_norm: float) -> float | None:
    """⟨Δᵢ, v⟩ / (‖Δᵢ‖‖v‖); None for a zero vector."""
    return dot / (norm * v_norm) if norm > 0 and v_norm > 0 else None


def robust_aggregate(
    sources: Sequence[Source],
    *,
    shapes: Shapes,
    codec: dict,
    policy: AggregationSection,
    history: Sequence[float] = (),
) -> Aggregate:
    """The round's update from ``sources`` as ``policy.method`` says (module docstring).
    Raises ``SourceUnreadable`` for the first source that cannot be read back; the caller
    leaves it out and calls again."""
    if not sources:
        raise AggregationError("no contributions to aggregate")
    total_weight = sum(s.weight for s in sources)
    if not total_weight > 0:
        raise AggregationError("the contributions' weights add up to nothing")
    ref, clip = clip_factors({s.id: s.norm for s in sources}, history, policy)

    # pass 1: v = Σ wᵢ cᵢ Δᵢ / Σ wᵢ
    v = {n: torch.zeros(shape, dtype=torch.float32) for n, shape in shapes.items()}
    for s in sources:
        _accumulate(v, s, s.weight * clip[s.id] / total_weight, shapes, codec)

    # pass 2: each one's dot product with v: its cosine, and (centred clipping) its distance
    v_sq = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in v.values())
    v_norm = math.sqrt(v_sq)
    dots = {s.id: _dot(s, v, shapes, codec) for s in sources}

    dist = distances({s.id: s.norm for s in sources}, dots, v_sq)
    if policy.method != "centered_clip":
        shares = {
            s.id: Share(
                s.weight, s.norm, clip[s.id], cosine(s.norm, dots[s.id], v_norm), dist[s.id]
            )
            for s in sources
        }
        return Aggregate(v, shares, ref)

    # pass 3: v + Σ wᵢ sᵢ (Δᵢ − v) / Σ wᵢ, sᵢ = min(1, τ / ‖Δᵢ − v‖), τ the median distance
    pull = centre_pulls(dist)
    moved = {n: torch.zeros(shape, dtype=torch.float32) for n, shape in shapes.items()}
    for s in sources:
        _accumulate(moved, s, s.weight * pull[s.id] / total_weight, shapes, codec)
    kept = sum(s.weight * pull[s.id] for s in sources) / total_weight
    for name, centre in v.items():
        moved[name].add_(centre, alpha=1.0 - kept)  # v + Σ wᵢsᵢΔᵢ/W − (Σ wᵢsᵢ/W) v
    shares = {
        s.id: Share(s.weight, s.norm, pull[s.id], cosine(s.norm, dots[s.id], v_norm), dist[s.id])
        for s in sources
    }
    return Aggregate(moved, shares, ref)
