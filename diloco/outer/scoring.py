"""Scoring an upload by its effect on the loss (issue 26, item 3).

An honest volunteer's Δ is the change its H inner steps made, starting from the round's
base, on its lease's data: applied alone to the base, θ_base − Δ is (up to the codec) the
model it trained, and it must lower the loss on the data it trained on. The close applies
each scored upload alone and measures the loss on two small samples with the same model:

- ``own``: ``[aggregation] score_windows`` windows of the upload's lease data, read as the
  volunteer read them (``diloco.data.text.lease_stream``: its shard or range, its seed),
  one from each of as many equal stretches of the batches its inner steps took
  (``lease_picks``), drawn with the round's secret: what it trained on, over the whole
  lease, and nothing a volunteer can single out to train on alone;
- ``other``: the same number of the run's judging windows (its validation data), the same
  for everyone.

``own_gain`` = L(θ_base; own) − L(θ_base − Δ; own), and ``other_gain`` likewise. An upload
that raises the loss on both, each by more than ``TOLERANCE`` of the base's, did not do
the work its lease asked for, or did it from another base: noise, a sign flip, and a stale
Δ (trained from an older version and relabelled: applied on top of the version that
already holds it, it overshoots) do (a stale Δ in about half the rounds measured). It is
left out as ``no_gain``, like a failed cheap check (``diloco.outer.checks``; zeros, which
change nothing, are the zero check's). Neither gain alone is enough to judge by, nor
their sign: late in a run an honest volunteer's own model can be a little worse than the
averaged base on its own windows, on the judging sample, or on both (measured: down to
−0.003 and −0.024 nats at once, at a loss of 2.5).

Which uploads are scored: all of a round of at most ``SCORE_ALL``; of a larger round, half
of them (rounded up), drawn with the round's secret seed, so nobody knows beforehand
whether theirs will be; and every upload already scored when the close begins. The cost is
a forward and backward pass and two forward passes of ``score_windows`` windows per scored
upload (and one forward and backward pass on the judging windows per scorer), and the
model five times in memory (base, Δ, the model, two gradients); ``score_windows = 0`` turns
scoring off. A score does
not depend on the other uploads, so the server takes it as each upload arrives, off the
close's critical path (``server.rounds.arrival_scores``): its close then scores only the
chosen uploads that arrived too late to be scored before.

What the gains do not catch: work trained honestly on other data than the lease's (it lowers
the loss on the lease's data as much as honest work does at this scale: measured, the
own-data advantage of honest work was within noise), and shifts that point the right way
(ALIE): both are bounded by clipping. For the first, a score also takes ``own_alignment``:
cos(Δ, ∇L(θ_base; own)) − cos(Δ, ∇L(θ_base; other)), the gradients at the base (one
backward pass each; the judging windows' once per scorer). An honest Δ holds a step taken
on each of the ``own`` windows (near the base: H steps move it little), so it points along
their gradient more than along other windows'; Δ trained on other data does not (bench/
own_alignment.py, the demo model, 16 leases: honest +0.030 on average, lowest −0.001; other
data −0.001, highest +0.017; in each lease the honest Δ above the other-data one). Too
close to leave an upload out by, it picks whom to replay (``diloco.protocol.audit.suspect``):
an audit decides.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from diloco.config import RunConfig
from diloco.data.text import eval_batches
from diloco.model.architectures import empty_model
from diloco.outer.checks import cosine_of
from diloco.train import load_parameters, parameters_of
from diloco.wire.contribution import decode_contribution
from diloco.wire.exchange import codec_for
from diloco.wire.tensorfile import TensorFileReader

SCORE_ALL = 8  # rounds of up to this many uploads have every upload scored
# how much an upload may raise both losses and still pass, as a share of the base's loss:
# late in a run honest work can raise both a little (measured down to −0.003 and −0.024
# nats at a loss of 2.5), work that did nothing useful raises them by far more
TOLERANCE = 0.005
Picks = Mapping[int, Sequence[int]]  # a lease stream's batch index -> rows of that batch


@dataclass(frozen=True)
class Windows:
    """A sample of token windows: inputs and next-token targets, (n, T) int64."""

    x: torch.Tensor
    y: torch.Tensor

    @classmethod
    def picked(
        cls, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], picks: Picks
    ) -> Windows:
        """The windows ``picks`` names (``lease_picks``) of a lease's stream, in stream order,
        ``next_batch`` called up to the last batch it names. Windows past the stream's end
        (a dataset range shorter than its steps) or past a short batch are left out."""
        picker = WindowPicker(picks)
        for _ in range(max(picks, default=-1) + 1):
            try:
                picker.take(next_batch())
            except StopIteration:
                break
        if (windows := picker.windows()) is None:
            raise ValueError("the lease's stream holds none of the windows to score it on")
        return windows

    @classmethod
    def validation(cls, val: torch.Tensor, n: int, block_size: int) -> Windows:
        """The first ``n`` windows of the validation tokens, in eval order (the judging
        sample's first ones): the same for every upload."""
        (x, y), *_ = eval_batches(val, batch_size=n, block_size=block_size, max_windows=n)
        return cls(x.long(), y.long())


class WindowPicker:
    """Keeps the windows ``picks`` names as a lease's batches go by, in order (each batch
    given to ``take``): the scoring's windows, read again or kept while a worker trains."""

    def __init__(self, picks: Picks) -> None:
        self.picks, self.seen = picks, 0
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        rows = [r for r in self.picks.get(self.seen, ()) if r < len(x)]
        if rows:
            self.kept.append((x[rows], y[rows]))
        self.seen += 1

    def windows(self) -> Windows | None:
        """The windows kept so far; None when no batch held one."""
        if not self.kept:
            return None
        return Windows(torch.cat([x for x, _ in self.kept]).long(),
                       torch.cat([y for _, y in self.kept]).long())  # fmt: skip


def lease_picks(cfg: RunConfig, *, steps: int, secret: int, lease: int) -> Picks:
    """The ``[aggregation] score_windows`` windows of a lease's stream the scoring reads
    (module docstring): the batches of ``[inner] batch_size`` windows its ``steps`` inner
    steps drew from it, in order (less those a volunteer may have trained ahead on its
    previous lease's data, ``[inner] overlap``: ``ahead_cap``), cut into that many equal
    stretches, one window drawn from each by ``secret`` (the round's check seed, which the
    volunteer never sees) with ``lease`` (the lease's own seed): spread over its inner
    steps, and unknown to the volunteer until its upload is scored."""
    n, batch_size = cfg.aggregation.score_windows, cfg.inner.batch_size
    total = (steps - cfg.inner.ahead_cap(steps)) * batch_size
    rng = random.Random(f"{secret}/{lease}")
    picks: dict[int, list[int]] = {}
    for k in range(min(n, total)):
        w = rng.randrange(k * total // n, (k + 1) * total // n) if n <= total else k
        picks.setdefault(w // batch_size, []).append(w % batch_size)
    return picks


def lease_windows(
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    cfg: RunConfig,
    *,
    steps: int,
    secret: int,
    lease: int,
) -> Windows:
    """The windows of a lease's stream (``next_batch``, read afresh) its score is taken on."""
    return Windows.picked(next_batch, lease_picks(cfg, steps=steps, secret=secret, lease=lease))


@dataclass(frozen=True)
class Score:
    own_gain: float  # L(base; own) − L(base − Δ; own), in nats
    other_gain: float  # the same on the judging windows
    own_base: float  # L(base; own)
    other_base: float  # L(base; other)
    # cos(Δ, ∇L(base; own)) − cos(Δ, ∇L(base; other)) (module docstring); None: a score
    # stored before it was measured
    own_alignment: float | None = None

    @property
    def failed(self) -> bool:
        """It raises the loss on both samples, each by more than ``TOLERANCE`` of the base's."""
        return (
            self.own_gain < -TOLERANCE * self.own_base
            and self.other_gain < -TOLERANCE * self.other_base
        )

    def figures(self) -> dict[str, float]:
        """As the server stores a score taken on arrival (``from_figures`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_figures(cls, figures: Mapping[str, float | None]) -> Score:
        """What ``figures`` stored; a figure it lacks or holds as None takes its default."""
        return cls(
            **{f.name: float(v) for f in fields(cls) if (v := figures.get(f.name)) is not None}
        )

    def reason(self) -> str:
        return (
            f"applied alone it raises the loss both on its lease's own data (by "
            f"{-self.own_gain:.4g} nats) and on the judging sample (by {-self.other_gain:.4g}), "
            f"each past {TOLERANCE:.1%} of the base's"
        )


def chosen(ids: Sequence[str], seed: int) -> set[str]:
    """The uploads a close scores (module docstring)."""
    if len(ids) <= SCORE_ALL:
        return set(ids)
    return set(random.Random(seed).sample(list(ids), (len(ids) + 1) // 2))


class Scorer:
    """The base version loaded once; ``score`` applies one upload alone and measures."""

    def __init__(self, cfg: RunConfig, base_params: Path, other: Windows) -> None:
        self.cfg, self.other = cfg, other
        self.model = empty_model(cfg.model)
        with TensorFileReader(base_params) as f:
            self.base = {n: f.tensor(n) for n in parameters_of(self.model)}
        self.shapes = {n: tuple(t.shape) for n, t in self.base.items()}
        self.codec = codec_for(cfg.compression)
        load_parameters(self.model, self.base)
        self.base_other, self.grad_other = self._gradient(other)

    def score(self, upload: Path, own: Windows) -> Score:
        base_own, grad_own = self._gradient(own)
        delta = self._decode(upload)
        alignment = _cosine(delta, grad_own) - _cosine(delta, self.grad_other)
        del grad_own
        load_parameters(self.model, {n: t - delta[n].view_as(t) for n, t in self.base.items()})
        try:
            own_gain = base_own - self._loss(own)
            other_gain = self.base_other - self._loss(self.other)
            return Score(own_gain, other_gain, base_own, self.base_other, alignment)
        finally:
            load_parameters(self.model, self.base)

    def _gradient(self, w: Windows) -> tuple[float, dict[str, torch.Tensor]]:
        """L(base; w) and its gradient at the base, by parameter."""
        self.model.eval()
        params = parameters_of(self.model)
        with torch.enable_grad():
            loss = self.model(w.x, w.y)
            grads = torch.autograd.grad(loss, list(params.values()))
        return float(loss.detach()), dict(zip(params, grads, strict=True))

    def _decode(self, upload: Path) -> Mapping[str, torch.Tensor]:
        with open(upload, "rb") as f:
            chunks = iter(lambda: f.read(1 << 20), b"")
            _, encoded = decode_contribution(chunks, self.shapes, codec=self.codec.describe())
        return {n: self.codec.decode(e) for n, e in encoded.items()}

    @torch.no_grad()
    def _loss(self, w: Windows) -> float:
        self.model.eval()
        return float(self.model(w.x, w.y))


def _cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """cos(a, b) over every parameter (the checks' rule, ``cosine_of``), its sums taken in
    float64 a tensor at a time (no flat copy of either); 0 for a zero vector (a zero Δ is
    the zero check's to judge)."""
    dot = aa = bb = 0.0
    for name, x in a.items():
        x, y = x.reshape(-1).double(), b[name].reshape(-1).double()
        dot, aa, bb = dot + float(x @ y), aa + float(x @ x), bb + float(y @ y)
    c = cosine_of(dot, math.sqrt(aa), math.sqrt(bb))
    return 0.0 if c is None else c
