"""Contributions from volunteers we do not know: combined robustly (each one was checked
as it arrived: ``diloco.outer.inspection``).

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

import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from diloco.config import AggregationSection
from diloco.outer import exact
from diloco.outer.exact import Terms
from diloco.outer.optimizer import AggregationError
from diloco.wire.codec import codec_from_description
from diloco.wire.contribution import (
    ContributionDecoder,
    WireFormatError,
)

if TYPE_CHECKING:
    from diloco.outer.fold import FoldPlan

Shapes = Mapping[str, tuple[int, ...]]


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

    def __reduce__(self) -> tuple[type[SourceUnreadable], tuple[str, str]]:
        return SourceUnreadable, (self.source_id, self.reason)  # raised in another process


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


def _exact_sum(
    sources: Sequence[Source], terms: Terms, shapes: Shapes, codec: dict
) -> dict[str, torch.Tensor]:
    """Σ termsᵢ · scale, summed exactly as the chunked pass sums (``diloco.outer.exact``)."""
    acc = {n: torch.zeros(math.prod(shape), dtype=torch.float64) for n, shape in shapes.items()}
    for source, factor in zip(sources, terms.factors, strict=True):
        seen = 0
        for name, x in _tensors(source, shapes, codec):
            work = torch.empty_like(acc[name])
            exact.add_term(acc[name], x.reshape(-1), factor, work)
            seen += 1
        if seen != len(acc):
            why = f"its stored upload has {seen} of {len(acc)} tensors"
            raise SourceUnreadable(source.id, why)
    out = {n: torch.empty(shape, dtype=torch.float32) for n, shape in shapes.items()}
    for n, a in acc.items():
        exact.value_into(out[n].view(-1), a, terms.scale, torch.empty_like(a))
    return out


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
    fold: FoldPlan | None = None,
) -> Aggregate:
    """The round's update from ``sources`` as ``policy.method`` says (module docstring);
    a folded round's (``fold``: ``diloco.outer.fold``) clips against its plan's limit and sums
    on its grid. Raises ``SourceUnreadable`` for the first source that cannot be read back;
    the caller leaves it out and calls again."""
    if not sources:
        raise AggregationError("no contributions to aggregate")
    total_weight = math.fsum(s.weight for s in sources)
    if not total_weight > 0:
        raise AggregationError("the contributions' weights add up to nothing")
    norms = [s.norm for s in sources]
    if fold is None:
        ref, clip = clip_factors({s.id: s.norm for s in sources}, history, policy)
        scaled = [s.weight * clip[s.id] for s in sources]
        terms = Terms.of(scaled, norms, total_weight)
    else:
        ref, clip = fold.limit / policy.clip_multiple, {s.id: fold.clip(s.norm) for s in sources}
        terms = fold.terms([s.weight for s in sources], norms, total_weight)

    # pass 1: v = Σ wᵢ cᵢ Δᵢ / Σ wᵢ
    v = _exact_sum(sources, terms, shapes, codec)

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
    pulls = [s.weight * pull[s.id] for s in sources]
    moved = _exact_sum(sources, Terms.of(pulls, norms, total_weight), shapes, codec)
    kept = math.fsum(pulls) / total_weight
    for name, centre in v.items():
        moved[name].add_(centre, alpha=1.0 - kept)  # v + Σ wᵢsᵢΔᵢ/W − (Σ wᵢsᵢ/W) v
    shares = {
        s.id: Share(s.weight, s.norm, pull[s.id], cosine(s.norm, dots[s.id], v_norm), dist[s.id])
        for s in sources
    }
    return Aggregate(moved, shares, ref)
