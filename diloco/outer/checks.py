"""Cheap checks on every upload of a round, at its close (issue 26, item 2).

A freeloader's upload passes the checks at upload (finite, measured, not a byte-exact
replay) and would otherwise be paid in full. The close looks at every upload once more,
with figures its pass measures anyway or at almost no cost, and leaves out for good
(no weight, no credit, the reason stored with the contribution) one that is:

- ``zero_update``: ‖Δ‖ = 0, or at most ``ZERO_FRACTION`` of the round's reference norm
  (``diloco.outer.robust.reference_norm``: the round's median, or with few uploads the
  run's recent history too). Honest work of one inner step is still orders of magnitude
  above that.
- ``copy``: a near-copy, |cosine| ≥ ``COPY_COSINE``, of an upload accepted before it in
  the round (any scale, either sign: another's Δ × 0.9 or × −1), or of one of the last
  ``RECENT_CHANGES`` published changes θ_v − θ_{v−1} (what a freeloader downloads). The
  cosines are measured on a sample of coordinates: every ``stride``-th value from a
  ``phase`` drawn from the round's secret seed (``Sampling``), about ``SAMPLE_SIZE`` values,
  so a copier cannot know which values to alter; a copy scores 1 whatever the sample, and
  two independent updates score within a few 1/√SAMPLE_SIZE of their true cosine.
- ``unaligned`` / ``opposed``: its cosine, on the sampled coordinates where both it and the
  coordinate-wise median of the others' samples (a reference a minority cannot pull far)
  are non-zero, m of them (about the whole sample for dense uploads), is within
  ``SIGMAS``/√m of 0, where a direction independent of the others lands, or below
  −``SIGMAS``/√m. Judged only when no upload failed the checks above (a copy negated
  would make its original look opposed), in a round of at least ``DIRECTION_MIN`` uploads
  whose median cosine is clearly positive (above 3 × ``SIGMAS``/√m on the median), and
  only for a minority of them: with two uploads, in a round with no common direction, or
  where the odd ones are not the few, the cheap checks cannot say who is the odd one out.
  In a round of sparse uploads (top-k of each chunk: ``RoundFigures.sparse``) the others'
  median is mostly zeros and an honest upload may share only a few coordinates with it,
  so an upload is judged only where its m could show the round's median cosine clear of
  the noise (≥ 2 × ``SIGMAS``/√m); in a dense round every upload is, so a mostly-zero
  upload there is still judged on the few values it holds.

Each upload's cosine to the aggregate of the others (leave-one-out, exact, from the pass's
dot products) is measured and stored beside them (``loo_cosine``).

The base an upload names is checked at upload against its lease (``admit_claim``).
Quiet attacks that point the right way (ALIE-style shifts, a stale base, other data) pass
these checks; they are bounded by clipping and judged by their effect on the loss.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

SAMPLE_SIZE = 1 << 14  # coordinates sampled per update (64 KiB of fp32)
COPY_COSINE = 0.99
ZERO_FRACTION = 1e-3
SIGMAS = 4.0
DIRECTION_MIN = 3
RECENT_CHANGES = 3  # published changes a round's uploads are compared with
LOO_PRECISION = 1e-3  # the leave-one-out cosine's trust in float32 dot products (_loo_cosine)


@dataclass(frozen=True)
class Sampling:
    """The coordinates sampled: global index i (parameters in the model's order, flattened)
    with i ≡ ``phase`` (mod ``stride``)."""

    stride: int
    phase: int

    @classmethod
    def for_round(cls, n_params: int, seed: int) -> Sampling:
        stride = max(1, n_params // SAMPLE_SIZE)
        return cls(stride, seed % stride)

    def take(self, x: torch.Tensor, at: int) -> torch.Tensor:
        """The sampled values of ``x``, whose first value has global index ``at``."""
        return x[(self.phase - at) % self.stride :: self.stride].clone()


@dataclass(frozen=True)
class RecentChange:
    """A published change θ_v − θ_{v−1}, sampled where its own round sampled (its seed)."""

    version: int
    seed: int
    values: torch.Tensor


class Sampler:
    """Collects the samples a pass takes: each upload's at every sampling (the round's own
    first, then each recent change's), and the step's change at the round's own."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], samplings: Sequence[Sampling]):
        self.samplings = list(samplings)
        self.offsets: dict[str, int] = {}
        at = 0
        for name, shape in shapes.items():
            self.offsets[name] = at
            at += math.prod(shape)
        self._uploads: dict[str, list[list[tuple[int, torch.Tensor]]]] = {}
        self._change: list[tuple[int, torch.Tensor]] = []
        self._total: list[tuple[int, torch.Tensor]] = []

    def upload(self, upload_id: str, name: str, start: int, x: torch.Tensor) -> None:
        at = self.offsets[name] + start
        pieces = self._uploads.setdefault(upload_id, [[] for _ in self.samplings])
        for got, sampling in zip(pieces, self.samplings, strict=True):
            got.append((at, sampling.take(x, at)))

    def put(self, upload_id: str, samples: Sequence[torch.Tensor]) -> None:
        """An upload's samples taken before (``diloco.outer.fold``), one per sampling."""
        self._uploads[upload_id] = [[(0, t)] for t in samples]

    def change(self, name: str, start: int, change: torch.Tensor) -> None:
        at = self.offsets[name] + start
        self._change.append((at, self.samplings[0].take(change, at)))

    def total(self, name: str, start: int, g: torch.Tensor) -> None:
        """The round's sum g, at the round's own sampling."""
        at = self.offsets[name] + start
        self._total.append((at, self.samplings[0].take(g, at)))

    def dots(self, ids: Sequence[str], n_params: int) -> dict[str, float]:
        """⟨Δᵢ, g⟩ estimated on the round's own sample (scaled by n_params / its size): a
        folded round's, whose uploads the close does not all read again."""
        g = _ordered(self._total).double()
        scale = n_params / max(1, g.numel())
        return {i: scale * float(torch.dot(_ordered(self._uploads[i][0]).double(), g)) for i in ids}

    def uploads(self) -> dict[str, list[torch.Tensor]]:
        """Each upload's samples, one tensor per sampling, in global order."""
        return {i: [_ordered(p) for p in pieces] for i, pieces in self._uploads.items()}

    def changes(self) -> torch.Tensor:
        return _ordered(self._change)


def _ordered(pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    if not pieces:
        return torch.zeros(0)
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])])


@dataclass(frozen=True)
class Check:
    """What the checks found about one upload; ``code`` None: it passed."""

    code: str | None
    reason: str
    loo_cosine: float | None  # to the aggregate of the others (None: no others)
    # on the sample, to the others' coordinate-wise median, where both are non-zero
    median_cosine: float | None
    copy_cosine: float | None  # the largest |cosine| to an earlier upload or a recent change
    copy_of: str | None  # which: an upload id or "version N"
    norm_ratio: float | None  # ‖Δ‖ over the round's reference norm (None: no reference)
    # its effect on the loss, applied alone (diloco.outer.scoring; None: not scored)
    own_gain: float | None = None
    other_gain: float | None = None
    # how much more it points along its lease windows' gradient than the judging windows'
    own_alignment: float | None = None

    def figures(self) -> dict[str, float | str | None]:
        """What a contribution stores and shows: every field but the reason (which the
        contribution's excluded_reason holds when it failed)."""
        return {k: v for k, v in asdict(self).items() if k != "reason"}


@dataclass(frozen=True)
class RoundFigures:
    """What the pass measured of the round, in the uploads' order (the order accepted)."""

    ids: list[str]
    norms: dict[str, float]
    coefficients: dict[str, float]  # cᵢ: g = Σ cᵢ Δᵢ
    dots: dict[str, float]  # ⟨Δᵢ, g⟩
    g_sq: float  # ‖g‖²
    samples: dict[str, list[torch.Tensor]]  # Sampler.uploads()
    recent: list[RecentChange] = field(default_factory=list)  # in the samplings' order, from [1]
    reference: float | None = None  # the round's reference norm
    sparse: bool = False  # the uploads are top-k of each chunk (the run's codec is sparse)


def check_uploads(f: RoundFigures) -> dict[str, Check]:
    """Every upload's ``Check`` (module docstring). The checks that need no aggregate (zero,
    copy) go first: while one of them fails, the direction is not judged (a copy negated
    would make its original look opposed); the caller leaves those out and asks again."""
    loo = {i: _loo_cosine(f, i) for i in f.ids}
    copies = _earlier_copies(f)
    out: dict[str, Check] = {}
    for i in f.ids:
        norm = f.norms[i]
        ratio = norm / f.reference if f.reference else None
        copy_cos, copy_of = _closest_copy(f, i, copies.get(i, (None, None)))
        code, reason = None, "passed"
        if norm == 0 or (ratio is not None and ratio <= ZERO_FRACTION):
            code = "zero_update"
            reason = f"its update is (near) zero: ‖Δ‖ = {norm:.3g}" + (
                f", {ratio:.2g} of the round's reference norm" if ratio is not None else ""
            )
        elif copy_cos is not None and copy_cos >= COPY_COSINE:
            code = "copy"
            reason = f"a near-copy of {copy_of} (|cosine| {copy_cos:.4f} ≥ {COPY_COSINE})"
        out[i] = Check(code, reason, loo[i], None, copy_cos, copy_of, ratio)
    if any(c.code is not None for c in out.values()):
        return out
    return _judge_directions(f, out)


def _judge_directions(f: RoundFigures, out: dict[str, Check]) -> dict[str, Check]:
    """Each upload's cosine, on the sample, to the coordinate-wise median of the others'
    (a reference a minority cannot pull far); a minority whose cosine is where noise lands
    or below is left out, in a round of at least ``DIRECTION_MIN`` whose median cosine is
    clearly positive."""
    ids = [i for i in f.ids if i in f.samples]
    if len(ids) < DIRECTION_MIN:
        return out
    own = torch.stack([f.samples[i][0] for i in ids])  # (n, sample)
    centres = _others_medians(own)  # selected values: exact in the samples' float32
    na, nb, dots, held = _masked_figures(own, centres)
    cos: dict[str, float] = {}
    tau: dict[str, float] = {}  # where noise lands: SIGMAS / √(the coordinates both hold)
    for k, i in enumerate(ids):
        if (c := cosine_of(float(dots[k]), float(na[k]), float(nb[k]))) is not None:
            cos[i], tau[i] = c, SIGMAS / math.sqrt(int(held[k]))
    out = {i: replace(c, median_cosine=cos.get(i)) for i, c in out.items()}
    if len(cos) < DIRECTION_MIN or not statistics.median(c / tau[i] for i, c in cos.items()) > 3:
        return out
    typical = statistics.median(cos.values())
    judged = {i for i in cos if not f.sparse or typical >= 2 * tau[i]}
    odd = {i: c for i, c in cos.items() if c <= tau[i] and i in judged}
    if len(odd) > (len(ids) - 1) // 2:  # not a minority: the round has no one direction
        return out
    for i, c in odd.items():
        band = tau[i]
        if c < -band:
            reason = f"it points against the others (cosine {c:.3g} to their median, < −{band:.2g})"
            out[i] = replace(out[i], code="opposed", reason=reason)
        else:
            reason = (
                f"its direction is unrelated to the others' (cosine {c:.3g} to their median, "
                f"within ±{band:.2g} where noise lands)"
            )
            out[i] = replace(out[i], code="unaligned", reason=reason)
    return out


def _masked_figures(
    own: torch.Tensor, centres: torch.Tensor, rows: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row, on the coordinates where both it and its centre are nonzero: both
    norms and their dot product in float64, and how many coordinates; a few rows at a time
    (small temporaries: in a busy server, fresh memory for whole-matrix ones cost more than
    the arithmetic, bench/arrivals.py)."""
    out = torch.empty(4, own.shape[0], dtype=torch.float64)
    for lo in range(0, own.shape[0], rows):
        a, b = own[lo : lo + rows].double(), centres[lo : lo + rows].double()
        both = (a != 0) & (b != 0)
        a.masked_fill_(~both, 0.0)
        b.masked_fill_(~both, 0.0)
        out[0, lo : lo + rows] = a.norm(dim=1)
        out[1, lo : lo + rows] = b.norm(dim=1)
        out[2, lo : lo + rows] = a.mul_(b).sum(dim=1)
        out[3, lo : lo + rows] = both.sum(dim=1)
    return out[0], out[1], out[2], out[3]


def suspect_figures(
    checks: Mapping[str, Check], taken: Iterable[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Of the uploads a step took (``taken``), each one's cosine to the others' median and
    its score's ``own_alignment``, where measured: what ``diloco.protocol.audit.suspect``
    names the round's suspect from (the server's close and the simulator's alike)."""
    mine = {i: checks[i] for i in taken if i in checks}
    cosines = {i: c.median_cosine for i, c in mine.items() if c.median_cosine is not None}
    aligned = {i: c.own_alignment for i, c in mine.items() if c.own_alignment is not None}
    return cosines, aligned


def tally(checks: Mapping[str, Check]) -> dict[str, Any]:
    """A round's checks in figures, for the benchmarks: how many each code left out (and
    which: ``failed``, upload id -> code), how many were scored, and the smallest margins
    the uploads that passed kept (their median cosine, and the larger of their two gains)."""
    passed = [c for c in checks.values() if c.code is None]
    cosines = [c.median_cosine for c in passed if c.median_cosine is not None]
    gains = [
        max(c.own_gain, c.other_gain)
        for c in passed
        if c.own_gain is not None and c.other_gain is not None
    ]
    left_out: dict[str, int] = {}
    for c in checks.values():
        if c.code is not None:
            left_out[c.code] = left_out.get(c.code, 0) + 1
    return {
        "left_out": left_out,
        "failed": {i: c.code for i, c in checks.items() if c.code is not None},
        "scored": sum(c.own_gain is not None for c in checks.values()),
        "min_median_cosine": min(cosines, default=None),
        "min_gain": min(gains, default=None),
    }


def _loo_cosine(f: RoundFigures, i: str) -> float | None:
    """cos(Δᵢ, g − cᵢΔᵢ) from ‖Δᵢ‖, ⟨Δᵢ, g⟩ and ‖g‖², without another pass; None when
    there are no others, or when Δᵢ so dominates g (no clipping) that the difference would
    be rounding error (the dots are float32 sums: trusted to about 1e-6 of ‖g‖²)."""
    c, n, dot = f.coefficients[i], f.norms[i], f.dots[i]
    rest_sq = f.g_sq - 2 * c * dot + c * c * n * n
    if n <= 0 or not rest_sq > LOO_PRECISION * max(f.g_sq, c * c * n * n, 1e-300):
        return None
    return max(-1.0, min(1.0, (dot - c * n * n) / (n * math.sqrt(rest_sq))))


def _others_medians(own: torch.Tensor) -> torch.Tensor:
    """Row k: the coordinate-wise median of every row but k (``torch.median``'s lower
    median; the mean of two), for all rows at once. With s the column's values in order and
    ``at`` the lower median's index among n − 1 values, the median without row k is s[at]
    when row k is above s[at], else s[at + 1] (row k at s[at] and ranked after it means
    s[at + 1] = s[at]: ties give the same value); one selection per column, no sort."""
    n = own.shape[0]
    if n - 1 <= 2:
        return torch.stack([torch.cat([own[:k], own[k + 1 :]]).mean(dim=0) for k in range(n)])
    at = (n - 2) // 2
    # both order statistics of each column in one selection, along contiguous memory
    # (numpy's partition with two kth: half the time of two torch.kthvalue, a fifth of a sort)
    chosen = np.partition(own.T.contiguous().numpy(), [at, at + 1], axis=1)
    low, high = torch.from_numpy(chosen[:, at].copy()), torch.from_numpy(chosen[:, at + 1].copy())
    return torch.where(own > low, low, high)


def _earlier_copies(f: RoundFigures) -> dict[str, tuple[float | None, str | None]]:
    """Each upload's largest |cosine|, on the sample, to an upload accepted before it in
    the round, and which: one product of the samples' matrix for every pair."""
    ids = [i for i in f.ids if i in f.samples]
    if len(ids) < 2:
        return {}
    own = torch.stack([f.samples[i][0] for i in ids]).double()  # (n, sample)
    norms = own.norm(dim=1)
    usable = (norms > 0) & torch.isfinite(norms)
    cos = (own @ own.T) / (norms.unsqueeze(1) * norms.unsqueeze(0))
    cos = cos.clamp(-1.0, 1.0).abs()
    earlier = torch.ones(len(ids), len(ids), dtype=torch.bool).tril(-1)  # j accepted before i
    cos = torch.where(earlier & usable.unsqueeze(1) & usable.unsqueeze(0), cos, -1.0)
    best, which = cos.max(dim=1)
    return {
        i: (float(best[k]), ids[int(which[k])]) if best[k] >= 0 else (None, None)
        for k, i in enumerate(ids)
    }


def _closest_copy(
    f: RoundFigures, i: str, earlier: tuple[float | None, str | None]
) -> tuple[float | None, str | None]:
    """The largest |cosine| of upload ``i`` to an earlier upload (``earlier``) or to one
    of the last published changes, and which."""
    mine = f.samples.get(i)
    if mine is None:
        return None, None
    pairs = [
        (mine[k + 1], r.values, f"the change published as version {r.version}")
        for k, r in enumerate(f.recent)
        if k + 1 < len(mine)
    ]
    best: tuple[float | None, str | None] = earlier
    for a, b, name in pairs:
        cos = _cosine(a, b)
        if cos is not None and (best[0] is None or abs(cos) > best[0]):
            best = (abs(cos), name)
    return best


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """cos(a, b) in float64, None when either is zero or not finite."""
    if a.shape != b.shape:
        return None
    a64, b64 = a.double(), b.double()
    return cosine_of(float(a64 @ b64), float(a64.norm()), float(b64.norm()))


def cosine_of(dot: float, na: float, nb: float) -> float | None:
    """dot / (na nb), clamped to [−1, 1]; None when either norm is zero or not finite."""
    if not (na > 0 and nb > 0) or not (math.isfinite(na) and math.isfinite(nb)):
        return None
    return max(-1.0, min(1.0, dot / (na * nb)))
