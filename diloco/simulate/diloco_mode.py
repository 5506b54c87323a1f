"""``diloco simulate --mode diloco``: K workers, R rounds, the platform's own code.

Each round every worker trains H inner steps from θ(t−1) (:mod:`diloco.train`), sends Δ
through the codec and the wire format, and the server's side of the round
(:mod:`diloco.simulate.server`) checks each upload and closes the round with the server's
own close (:mod:`diloco.outer.close`: robust aggregate, Nesterov step, int8 delta with error
feedback, every step judged before it is published). ``SimOptions.attacks`` turns workers
into attackers (:mod:`diloco.simulate.attacks`), for ``bench/attacks.py``.
``SimOptions.downloads="delta"`` counts what workers download as the deltas since the
version they hold (:mod:`diloco.simulate.downloads`); either way they start from the published
θ, as a volunteer does. ``[inner] overlap`` = f: from round 2 each worker trains the
first f·H steps of a round from its own end of the round before (the version is still
being published; ``train_ahead``, on its own stream, so counted as the round's tokens), then
folds the published θ in (``InnerTrainer.fold``) and trains the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors.torch import save as safetensors_save

from diloco.config import RunConfig
from diloco.data.text import Dataset
from diloco.model.architectures import build_model
from diloco.model.gpt import LanguageModel
from diloco.outer.checks import suspect_figures, tally
from diloco.protocol.audit import suspect
from diloco.protocol.state import Refusal
from diloco.simulate.attacks import TRAINING, Attack, hostile_body
from diloco.simulate.dealing import Batch, Dealer, Dealt, batch_source, stream_generator
from diloco.simulate.downloads import DeltaReport, Ledger
from diloco.simulate.run import (
    Progress,
    Recorder,
    SimOptions,
    Trained,
)
from diloco.simulate.server import SIM_RUN_ID, RoundDesk, Standings, Stepped, open_round
from diloco.simulate.versions import Versions
from diloco.simulate.work import Upload, train_upload
from diloco.train import InnerTrainer, load_parameters, parameters_of, train_ahead

ELSEWHERE_STREAM = 50_000  # other_data's streams: past every worker's own


def run_diloco(
    cfg: RunConfig,
    opts: SimOptions,
    data: Dataset,
    model: LanguageModel,
    device: torch.device,
    progress: Progress | None,
) -> Trained:
    """K workers, R rounds of H inner steps, Δ through codec + wire, and the server's side
    of a round (:mod:`diloco.simulate.server`: checked uploads, the server's close).
    ``model`` ends holding the final published parameters θ (``Trained.delta`` reports
    x = θ + r beside them with delta downloads)."""
    versions = Versions(cfg, parameters_of(model), run_id=SIM_RUN_ID, delta_dir=opts.delta_dir)
    try:
        return _rounds(cfg, opts, data, device, progress, model, versions)
    finally:
        versions.cleanup()


class _Workers:
    """diloco mode's K workers: each its own model and AdamW (kept across rounds), its own
    data; what they have sent and downloaded."""

    def __init__(self, cfg: RunConfig, opts: SimOptions, data: Dataset, device: torch.device,
                 checkpoint_bytes: int, ledger: Ledger | None) -> None:  # fmt: skip
        self.cfg, self.opts = cfg, opts
        self.trainers = [
            InnerTrainer(build_model(cfg.model), cfg.inner, total_steps=cfg.total_inner_steps,
                         device=device)
            for _ in range(opts.workers)
        ]  # fmt: skip
        self.dealer = Dealer(data, cfg, batches=opts.batches, seed=opts.seed, workers=opts.workers)
        self.drops = stream_generator(opts.seed, 10_000)
        self.checkpoint_bytes, self.ledger = checkpoint_bytes, ledger
        self.earlier: dict[int, dict[str, torch.Tensor]] = {}  # each one's Δ of the round before
        self.starts: dict[int, dict[str, torch.Tensor]] = {}  # θ each recent round began from
        self.elsewhere: dict[int, Callable[[], Batch]] = {}  # other_data: its own stream
        self.ahead = cfg.inner.ahead_cap(cfg.inner.steps)  # steps it trains before the fold
        self.bytes_up = self.bytes_down = self.tokens = 0

    def train(
        self, r: int, start: dict[str, torch.Tensor], desk: RoundDesk, secret: int
    ) -> list[float]:
        """Round ``r`` (from 0): every worker downloads θ(t−1) = ``start``, trains H steps
        and sends Δ through codec and wire to ``desk`` (unless its upload is dropped);
        their mean training losses. ``secret``: the round's check seed (what it scores)."""
        losses: list[float] = []
        first_delta = None  # what a copier sends: the first honest worker's Δ
        honest: list[dict[str, torch.Tensor]] = []  # what the round's attackers see
        self.starts[r] = start  # what a stale_base attacker trains from two rounds on
        self.starts.pop(r - 3, None)
        for i, trainer in enumerate(self.trainers):
            dealt = self.dealer.deal(r + 1, i, secret)  # this round's batches (simulate.dealing)
            if self.ledger is None:
                self.bytes_down += self.checkpoint_bytes
            else:
                self.ledger.fetch(f"worker-{i}", r)
            attack = self.opts.attacks.get(i) if r + 1 >= self.opts.attack_from else None
            begin, feed = self._training(attack, i, r, start, dealt)
            ahead = None
            if self.ahead and r > 0:  # from its own end of round r, on its own stream
                ahead = train_ahead(trainer, self.ahead, start_step=r * self.cfg.inner.steps,
                                    next_batch=feed, counted=True)  # fmt: skip
            upload = train_upload(trainer, begin, cfg=self.cfg, round=r + 1,
                                  next_batch=feed, ahead=ahead)  # fmt: skip
            if attack == "other_data":  # the batches it was dealt, as the server reads them
                for _ in range(self.cfg.inner.steps):
                    dealt.next_batch()
            self.tokens += upload.result.tokens
            losses.append(upload.result.mean_loss)
            chunks = upload.chunks
            if attack is not None and attack not in TRAINING:  # sent instead of its work
                chunks = [self._hostile(attack, i, r, upload, first_delta, honest)]
            elif attack is None:
                honest.append(upload.delta)
                first_delta = honest[0]
            self.earlier[i] = upload.delta
            self.bytes_up += sum(len(c) for c in chunks)
            # a dropped upload never reaches the server
            if (
                self.opts.drop_prob
                and float(torch.rand((), generator=self.drops)) < self.opts.drop_prob
            ):
                continue
            admitted = desk.admit(f"worker-{i}@{r + 1}", f"worker-{i}", chunks, own=dealt.own())
            if not isinstance(admitted, Refusal):
                self.dealer.trained(dealt)  # the server counts the unit covered at upload
        return losses

    def _training(
        self, attack: Attack | None, i: int, r: int, start: dict[str, torch.Tensor], dealt: Dealt
    ) -> tuple[dict[str, torch.Tensor], Callable[[], Batch]]:
        """Where worker ``i``'s round ``r`` trains from and what it reads: θ(t−1) and the
        batches it was dealt, or what a training attack (``attacks.TRAINING``) takes
        instead: the version before last (``stale_base``), other batches of its shard
        (``other_data``, a stream of its own)."""
        if attack == "stale_base":
            return self.starts.get(r - 2, self.starts[min(self.starts)]), dealt.next_batch
        if attack == "other_data":
            if i not in self.elsewhere:
                shards = self.dealer.data.shards
                gen = stream_generator(self.opts.seed, ELSEWHERE_STREAM + i)
                self.elsewhere[i] = batch_source(shards[i % len(shards)], self.cfg, gen)
            return start, self.elsewhere[i]
        return start, dealt.next_batch

    def _hostile(
        self,
        attack: Attack,
        i: int,
        r: int,
        upload: Upload,
        other: dict[str, torch.Tensor] | None,
        peers: list[dict[str, torch.Tensor]],
    ) -> bytes:
        assert upload.meta is not None
        return hostile_body(
            attack,
            upload.delta,
            upload.meta,
            kind=self.cfg.compression.kind,
            block_size=self.cfg.compression.block_size,
            seed=self.opts.seed * 1_000 + r,
            other_delta=other,
            stale_delta=self.earlier.get(i, upload.delta),
            peers=peers,
        )


def _rounds(
    cfg: RunConfig,
    opts: SimOptions,
    data: Dataset,
    device: torch.device,
    progress: Progress | None,
    model: LanguageModel,
    versions: Versions,
) -> Trained:
    K = opts.workers
    checkpoint_bytes = len(safetensors_save(versions.theta))  # what a worker downloads per round
    ledger = Ledger(versions.sizes, checkpoint_bytes) if opts.downloads == "delta" else None
    workers = _Workers(cfg, opts, data, device, checkpoint_bytes, ledger)
    recorder = Recorder(cfg, opts, data, device, progress)
    judge = recorder.evaluator(build_model(cfg.model))
    history: list[float] = []  # norms of aggregated contributions: the clipping's reference
    standings = Standings()  # each worker's standing, as the server keeps it
    for r in range(cfg.rounds.max_rounds):
        desk = open_round(cfg, r + 1, standings)
        losses = workers.train(r, versions.theta, desk, versions.check_seed(r + 1))
        drawn = desk.drawn(versions.check_seed(r + 1))  # by the standings before this close
        # the server's close (no step when every contribution was lost or refused); version
        # r+1 is published either way, the next round starts from it
        stepped = desk.close(
            versions, evaluate=judge, history=history, score_sample=recorder.score_sample()
        )
        accepted = 0
        if stepped.update_norm is not None:
            accepted = len(stepped.shares)
            norms = [share.norm for share in stepped.shares.values()]
            history = [*history, *norms][-cfg.aggregation.history :]
        load_parameters(model, versions.theta)
        recorder.close_round(
            model,
            round=r + 1,
            tokens=workers.tokens,
            train_loss=sum(losses) / len(losses),
            accepted=accepted,
            update_norm=stepped.update_norm,
            refused=sum(desk.refused.values()),
            left_out=len(stepped.left_out),
            checks=tally(stepped.checks),
            suspect=_suspect(cfg, stepped),
            drawn=drawn,
        )
    if ledger is None:
        return Trained(recorder.records, workers.bytes_up // K, workers.bytes_down // K)
    last = versions.sizes[versions.version]
    report = DeltaReport(checkpoint_bytes, last, residual_norms=list(versions.residual_norms))
    return Trained(
        recorder.records,
        workers.bytes_up // K,
        ledger.bytes // K,
        delta=report,
        outer_params=versions.exact(),
    )


def _suspect(cfg: RunConfig, stepped: Stepped) -> str | None:
    """The upload the server's close would audit as the round's suspect (``[audit]
    suspects``; ``server.rounds.audit_draw.suspect_at_close``)."""
    if cfg.audit.fraction <= 0.0 or not cfg.audit.suspects or stepped.update_norm is None:
        return None
    return suspect(*suspect_figures(stepped.checks, stepped.shares))
