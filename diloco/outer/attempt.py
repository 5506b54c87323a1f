"""One try of a round's step (``diloco.outer.close``): the inputs a close reads, the base
version opened once for every try, and the pass (two for ``centered_clip``) that sums the
kept uploads, steps and writes the version's files to temp names, measuring on the way
what the checks read (``diloco.outer.checks``)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco.checkpoint import (
    OuterStateFile,
    open_outer_state,
    params_entries,
    params_metadata,
    state_entries,
    state_metadata,
)
from diloco.config import RunConfig
from diloco.outer.checks import RecentChange, RoundFigures, Sampler, Sampling
from diloco.outer.chunked import Hyper, Outputs, PassResult, Step, run_pass
from diloco.outer.exact import Terms
from diloco.outer.fold import FoldPlan, FoldState
from diloco.outer.robust import (
    Share,
    centre_pulls,
    clip_factors,
    cosine,
    distances,
    reference_norm,
)
from diloco.outer.scoring import Score, Windows
from diloco.outer.upload_file import UploadFile, upload_alignment
from diloco.wire import delta as deltas
from diloco.wire.exchange import codec_for, delta_codec_for
from diloco.wire.tensorfile import TensorFileReader, TensorFileWriter


@dataclass(frozen=True)
class Upload:
    """A contribution of the round as the close reads it."""

    id: str
    path: Path  # its stored body (``diloco.wire.contribution``); may be missing or damaged
    weight: float  # the tokens it counts for
    norm: float  # ‖Δ‖, measured when it was accepted
    # the windows of its lease's data the scoring reads (scoring.lease_picks), as its
    # volunteer read them
    # (diloco.outer.scoring); None: not scored (late work, whose base is an older version)
    own: Windows | None = None
    # its score, when it was taken before the close (on arrival, by the server); the close
    # then uses it instead of scoring it again
    score: Score | None = None


@dataclass(frozen=True)
class VersionPaths:
    """Where a version's three files are (or go)."""

    params: Path
    state: Path
    delta: Path


@dataclass(frozen=True)
class CloseInputs:
    run_id: str
    version: int  # the version this close publishes (= the round's index)
    cfg: RunConfig
    base_params: Path  # the base version's parameters
    base_state: Path  # its outer state (momentum, residual)
    uploads: list[Upload]  # in the order they were accepted: the sums' order
    history: list[float]  # norms of the run's latest aggregated contributions
    quorum: int
    out: VersionPaths  # where the new version is written (temp names until committed)
    # the checks' (diloco.outer.checks): the round's secret seed, where its samples are
    # taken, and the last published changes, sampled, to compare the uploads with
    check_seed: int = 0
    recent: list[RecentChange] = field(default_factory=list)
    # the windows every scored upload is also measured on (the validation data's first
    # score_windows); None: no upload is scored
    score_sample: Windows | None = None
    # a round whose sum is taken as its uploads arrive (diloco.outer.fold); None: not one
    fold: Folding | None = None


@dataclass(frozen=True)
class Folding:
    """A folded round: its plan, and where its running sum may be (None: nowhere here)."""

    plan: FoldPlan
    folder: Path | None = None


def folding(cfg: RunConfig, history: Sequence[float], folder: Path | None = None) -> Folding | None:
    """A round's ``Folding`` when ``cfg`` and ``history`` make it a folded one."""
    plan = FoldPlan.of_run(cfg, history)
    return None if plan is None else Folding(plan, folder)


@dataclass
class Base:
    """The base version, open for reading, and what every try of the step shares."""

    params: TensorFileReader
    state: OuterStateFile
    shapes: dict[str, tuple[int, ...]]
    upload_codec: dict
    delta_codec: deltas.DeltaCodec
    hyper: Hyper

    def align(self) -> int:
        """The pass's chunks start at multiples of this: whole blocks of int8 uploads and
        whole pieces of the delta (``diloco.wire.delta.alignment``)."""
        return math.lcm(deltas.alignment(self.delta_codec), upload_alignment(self.upload_codec))

    def close(self) -> None:
        self.params.close()
        self.state.reader.close()


@dataclass
class Tried:
    out: Outputs
    result: PassResult
    shares: dict[str, Share]
    figures: RoundFigures  # what the checks read
    change_sample: torch.Tensor
    folded: int = 0  # kept uploads whose terms were summed on arrival (diloco.outer.fold)


def open_base(inputs: CloseInputs) -> Base:
    cfg = inputs.cfg
    params = TensorFileReader(inputs.base_params)
    try:
        state = open_outer_state(inputs.base_state)
    except BaseException:
        params.close()
        raise
    names = json.loads(params.metadata["param_names"])
    return Base(
        params,
        state,
        {n: params.entries[n].shape for n in names},
        codec_for(cfg.compression).describe(),
        delta_codec_for(cfg.compression),
        Hyper(
            cfg.outer.lr_at(inputs.version, cfg.rounds.max_rounds),
            cfg.outer.momentum,
            cfg.outer.nesterov,
        ),
    )


def try_step(
    inputs: CloseInputs, base: Base, kept: list[Upload], clock: StageClock, *, full: bool
) -> Tried:
    """One try of the step with ``kept``: the pass (two for ``centered_clip``), the
    version's files written to temp names, and what each contribution put in. ``full``
    False: the delta alone is written, the parameters only digested (the close's critical
    pass); True: the parameters, the outer state and the delta (``diloco.outer.rebuild``).
    sha256 runs on a thread of its own (the uploads' trailers, the parameters), beside the
    sums."""
    norms = {u.id: u.norm for u in kept}
    summing = _summing(inputs, base, kept)
    n_params = sum(math.prod(shape) for shape in base.shapes.values())
    sampler = Sampler(base.shapes, [Sampling.for_round(n_params, s) for s in summing.seeds])
    for i in summing.folded_ids:
        if i in norms:  # folded and kept: sampled when it was folded
            assert summing.state is not None
            sampler.put(i, summing.state.samples(i))
    out, result, dots, v_sq, factors = _passes(inputs, base, kept, summing, sampler, full)
    if inputs.fold is not None:  # not every upload was read: on the sample
        dots = sampler.dots(list(norms), n_params)
    clock.lap("pass")
    for part, spent in result.seconds.items():  # where the pass's time went
        clock.seconds[f"pass_{part}"] = clock.seconds.get(f"pass_{part}", 0.0) + spent
    dist = distances(norms, dots, v_sq)
    v_norm = math.sqrt(v_sq)
    shares = {
        u.id: Share(u.weight, u.norm, factors[u.id], cosine(u.norm, dots[u.id], v_norm), dist[u.id])
        for u in kept
    }
    total = summing.terms.total
    figures = RoundFigures(
        ids=[u.id for u in kept],
        norms=norms,
        coefficients={u.id: u.weight * summing.clip[u.id] / total for u in kept},
        dots=dots,
        g_sq=v_sq,
        samples=sampler.uploads(),
        recent=list(inputs.recent),
        reference=reference_norm(list(norms.values()), inputs.history, inputs.cfg.aggregation),
        sparse=inputs.cfg.compression.kind == "sparse",
    )
    on_arrival = sum(1 for i in summing.folded_ids if i in norms)
    return Tried(out, result, shares, figures, sampler.changes(), on_arrival)


def _passes(
    inputs: CloseInputs,
    base: Base,
    kept: list[Upload],
    summing: _Summing,
    sampler: Sampler,
    full: bool,
) -> tuple[Outputs, PassResult, dict[str, float], float, dict[str, float]]:
    """The try's pass (two for ``centered_clip``): the outputs written, the stepping pass's
    result, each upload's dot product with the centre and its ‖·‖², and the factors."""
    norms = {u.id: u.norm for u in kept}
    with contextlib.ExitStack() as stack:
        hasher = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="close-sha256"))
        out = outputs(inputs, base, hasher, full=full)
        folded = None
        if summing.state is not None:
            folded = stack.enter_context(contextlib.closing(summing.state.open_sum()))

        def open_uploads(which: list[Upload]) -> list[UploadFile]:  # read, hashed, from the start
            return [
                stack.enter_context(
                    contextlib.closing(
                        UploadFile(u.id, u.path, base.shapes, base.upload_codec, hasher)
                    )
                )
                for u in which
            ]

        step = Step(base.hyper, base.params, base.state, base.delta_codec, out, sampler)
        align = base.align()
        try:
            uploads = open_uploads(summing.read)
            if inputs.cfg.aggregation.method != "centered_clip":
                result = run_pass(
                    uploads, summing.terms, base.shapes, align=align, step=step,
                    sampler=sampler, folded=folded,
                )  # fmt: skip
                dots, v_sq, factors = result.dots, result.g_sq, summing.clip
            else:  # the clipped mean v first, then v + Σ wᵢsᵢ(Δᵢ − v)/W
                first = run_pass(
                    uploads, summing.terms, base.shapes, align=align, keep=True, sampler=sampler
                )
                dots, v_sq = first.dots, first.g_sq
                factors = centre_pulls(distances(norms, dots, v_sq))
                pulls = [u.weight * factors[u.id] for u in kept]
                centre = (first.kept, 1.0 - math.fsum(pulls) / summing.terms.total)
                pulled = Terms.of(pulls, list(norms.values()), summing.terms.total)
                result = run_pass(
                    open_uploads(kept), pulled, base.shapes, align=align, center=centre, step=step
                )
            out.params.settle()  # before its hashing thread goes
        except BaseException:
            out.abort()
            raise
    return out, result, dots, v_sq, factors


@dataclass(frozen=True)
class _Summing:
    """How a try takes the round's sum: the uploads its pass reads with their terms (the kept
    ones not folded, then the folded ones left out, subtracted), and the folded sum it starts
    from (None: from zero)."""

    terms: Terms
    read: list[Upload]
    clip: dict[str, float]  # each kept upload's clip factor
    seeds: list[int]  # the samplings': the round's own, then the recent changes'
    state: FoldState | None = None
    folded_ids: list[str] = field(default_factory=list)


def _summing(inputs: CloseInputs, base: Base, kept: list[Upload]) -> _Summing:
    norms = {u.id: u.norm for u in kept}
    total = math.fsum(u.weight for u in kept)  # exact: the same in any order
    seeds = [inputs.check_seed, *(r.seed for r in inputs.recent)]
    if inputs.fold is None:
        _, clip = clip_factors(norms, inputs.history, inputs.cfg.aggregation)
        scaled = [u.weight * clip[u.id] for u in kept]
        return _Summing(Terms.of(scaled, list(norms.values()), total), kept, clip, seeds)
    plan = inputs.fold.plan
    clip = {u.id: plan.clip(u.norm) for u in kept}
    state, ids = None, None
    if inputs.fold.folder is not None:
        state = FoldState(inputs.fold.folder, base.shapes)
        ids = state.usable(plan, seeds)
    by_id = {u.id: u for u in inputs.uploads}
    if ids is None or any(i not in by_id for i in ids):  # from the stored uploads alone
        state, ids = None, []
    add = [u for u in kept if u.id not in ids]
    taken_out = [by_id[i] for i in ids if i not in norms]
    factors = [plan.factor(u.weight, u.norm) for u in add]
    factors += [-plan.factor(u.weight, u.norm) for u in taken_out]  # round(−y) = −round(y)
    terms = Terms(plan.unit, tuple(factors), total)
    return _Summing(terms, add + taken_out, clip, seeds, state, list(ids))


def outputs(inputs: CloseInputs, base: Base, hasher: ThreadPoolExecutor, *, full: bool) -> Outputs:
    """The pass's writers (``chunked.Outputs``): the delta always; the parameters written
    when ``full``, else only digested; the outer state only when ``full``."""
    names = list(base.shapes)
    meta = {"run_id": inputs.run_id}
    hp = base.hyper
    hparams = {"lr": hp.lr, "momentum": hp.momentum, "nesterov": hp.nesterov}
    delta_meta = deltas.metadata(
        run_id=inputs.run_id,
        version=inputs.version,
        base_version=inputs.version - 1,
        names=names,
        codec=base.delta_codec,
    )
    writers: list[TensorFileWriter] = []
    try:
        writers.append(
            TensorFileWriter(
                inputs.out.params,
                params_entries(base.shapes),
                params_metadata(version=inputs.version, names=names, metadata=meta),
                hasher=hasher,
                store=full,
            )
        )
        state = None
        if full:
            state = TensorFileWriter(
                inputs.out.state,
                state_entries(base.shapes),
                state_metadata(version=inputs.version, names=names, hparams=hparams, metadata=meta),
                digest=False,
            )
            writers.append(state)
        writers.append(
            TensorFileWriter(
                inputs.out.delta, deltas.entries(base.shapes, base.delta_codec), delta_meta
            )
        )
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return Outputs(writers[0], state, writers[-1])


class StageClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now
