"""``diloco simulate``: DiLoCo, data-parallel and single-worker training in one process.

The DiLoCo mode runs the very code the platform runs: each worker's inner loop
(:mod:`diloco.train`), Δ through the codec and the wire format (:mod:`diloco.wire.exchange`),
the server's checks at upload and the server's close (:mod:`diloco.simulate.server`,
:mod:`diloco.outer.close`: robust aggregate, Nesterov step, int8 delta, the guard). The
baselines use the same model, data and inner optimizer:

- ``ddp``: one model, K× the batch per step (one slice from each worker's shard),
  as many steps as a DiLoCo worker takes in total; communication is counted as a
  ring all-reduce of fp32 gradients every step.
- ``single``: one worker, 1× batch, the same number of steps: by default worker 0 alone
  on its own shard (a DiLoCo worker that never communicates, so ``single`` → ``ddp``
  is exactly what pooling K workers buys); ``single_data="all"`` trains it on the whole
  training split instead, a stronger reference on a finite corpus.
- ``protocol``: K volunteers against the round protocol's rules on a simulated clock
  (:mod:`diloco.simulate.protocol_mode`): speeds, deadlines, stragglers, dropouts.

Batches (:mod:`diloco.simulate.dealing`): by default worker i draws random windows from
shard i with its own generator, kept across rounds; ``batches="lease"`` deals them as the
platform does, to every mode but ``protocol`` (which always does): on a text run, the
shard and seed of the round's i-th lease (:func:`diloco.protocol.rules.assign_lease`); on
a prepared dataset, a data unit per lease in the server's order, each window read once.
The default is kept so that published benchmarks reproduce.

Downloads: in ``diloco`` and ``protocol`` modes workers start each round from the
published parameters θ (as the server publishes them: through the close's int8 delta);
``downloads="delta"`` counts what they download as those deltas rather than the fp32
checkpoint (:mod:`diloco.simulate.downloads`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from diloco.config import RunConfig
from diloco.data.text import Dataset, simulated_data
from diloco.model.architectures import build_model
from diloco.model.gpt import LanguageModel
from diloco.outer.close import Evaluate
from diloco.outer.scoring import Windows
from diloco.simulate.attacks import Attack
from diloco.simulate.dealing import Dealer, Dealt
from diloco.simulate.downloads import DeltaReport
from diloco.train import (
    Batch,
    InnerTrainer,
    evaluate,
    load_parameters,
    load_version_files,
    snapshot,
)

if TYPE_CHECKING:
    from diloco.simulate.protocol_mode import ProtocolOptions, ProtocolTotals

Mode = Literal["diloco", "ddp", "single", "protocol"]
Downloads = Literal["full", "delta"]
FP32_BYTES = 4


@dataclass(frozen=True)
class SimOptions:
    workers: int = 4
    mode: Mode = "diloco"
    seed: int = 0
    drop_prob: float = 0.0  # each worker's contribution is lost with this probability per round
    eval_windows: int | None = 256  # validation windows scored after each round (None: all)
    single_data: Literal["shard", "all"] = "shard"  # single mode: worker 0's shard, or all
    # worker i's own stream on shard i, or as the platform deals leases (simulate.dealing)
    batches: Literal["worker", "lease"] = "worker"
    device: str = "cpu"
    # diloco mode: worker index -> the attack it makes (diloco.simulate.attacks), for
    # bench/attacks.py
    attacks: Mapping[int, Attack] = field(default_factory=dict)
    attack_from: int = 1  # the round they begin (honest before: an account with standing)
    # diloco, protocol: workers download fp32 checkpoints, or the deltas (simulate.downloads)
    downloads: Downloads = "full"
    delta_dir: Path | None = None  # delta downloads: write each version's delta file here


@dataclass
class RoundRecord:
    round: int
    tokens: int  # tokens trained on so far, all workers together
    eval_loss: float
    train_loss: float
    accepted: int  # contributions that reached the outer step (DiLoCo), else workers
    update_norm: float | None = None
    refused: int = 0  # uploads the server would refuse (non-finite, a replay, ...)
    left_out: int = 0  # admitted, then left out of the step by the guard or the checks
    checks: dict[str, Any] = field(default_factory=dict)  # diloco.outer.checks.tally
    # the upload the close would audit as its suspect (diloco.protocol.audit.suspect), and
    # those the round's secret drew for an audit as they arrived (audit.drawn)
    suspect: str | None = None
    drawn: list[str] = field(default_factory=list)


@dataclass
class SimResult:
    mode: str
    workers: int
    seed: int
    inner_steps: int
    n_rounds: int
    compression: str
    drop_prob: float
    n_params: int
    final_eval_loss: float
    bytes_up_per_worker: int
    bytes_down_per_worker: int
    wall_s: float
    rounds: list[RoundRecord]
    config: dict[str, Any]
    protocol: ProtocolTotals | None = None  # protocol mode: time, compute, goodput, refusals
    downloads: str = "full"  # what workers download: the fp32 checkpoint, or the deltas
    overlap: float = 0.0  # the run's [inner] overlap: the share of H trained ahead
    delta: DeltaReport | None = None  # delta downloads: bytes, x's final loss, ‖x − θ‖
    # version 0's eval loss, on the windows each round is scored on
    initial_eval_loss: float | None = None
    # the final global parameters, for tests and callers; not part of the JSON
    final_params: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["final_params"]
        return out


Progress = Callable[[RoundRecord], None]


class Recorder:
    """Evaluates the (global) model after each round, keeps the records, reports them."""

    def __init__(
        self,
        cfg: RunConfig,
        opts: SimOptions,
        data: Dataset,
        device: torch.device,
        progress: Progress | None,
    ) -> None:
        self.cfg, self.opts, self.data, self.device = cfg, opts, data, device
        self.progress = progress
        self.records: list[RoundRecord] = []

    def evaluator(self, scratch: LanguageModel) -> Evaluate:
        """The close's judge: a version's loss, in ``scratch``, on the judging sample (the
        first ``[aggregation] judge_windows`` validation windows, as the server judges on
        its run's)."""

        def judge(params_path: Path, delta_path: Path | None) -> float:
            load_version_files(scratch, params_path, delta_path)
            return evaluate(
                scratch,
                self.data.val,
                block_size=self.cfg.model.block_size,
                max_windows=self.cfg.aggregation.judge_windows,
                device=self.device,
            )

        return judge

    def score_sample(self) -> Windows | None:
        """The windows every scored upload is also measured on (the server's: the first
        ``[aggregation] score_windows`` validation windows); None with scoring off."""
        n = self.cfg.aggregation.score_windows
        return Windows.validation(self.data.val, n, self.cfg.model.block_size) if n else None

    def close_round(
        self, model: LanguageModel, record_type: type[RoundRecord] = RoundRecord, **fields: Any
    ) -> None:
        eval_loss = evaluate(
            model,
            self.data.val,
            block_size=self.cfg.model.block_size,
            max_windows=self.opts.eval_windows,
            device=self.device,
        )
        record = record_type(eval_loss=eval_loss, **fields)
        self.records.append(record)
        if self.progress:
            self.progress(record)


@dataclass
class Trained:
    """What a mode's runner hands back; ``model`` holds the final global parameters."""

    records: list[RoundRecord]
    bytes_up_per_worker: int
    bytes_down_per_worker: int
    protocol: ProtocolTotals | None = None
    delta: DeltaReport | None = None  # delta downloads (``model`` then holds θ, not x)
    outer_params: dict[str, torch.Tensor] | None = None  # delta downloads: x


Runner = Callable[
    [RunConfig, SimOptions, Dataset, LanguageModel, torch.device, Progress | None], Trained
]


def simulate(
    cfg: RunConfig,
    opts: SimOptions,
    progress: Progress | None = None,
    *,
    protocol: ProtocolOptions | None = None,
) -> SimResult:
    """Train per ``cfg`` and ``opts``; ``cfg.rounds.max_rounds`` × ``cfg.inner.steps``
    inner steps per worker, with an evaluation of the global model after every round.
    ``protocol``: the volunteers and the hub's settings of ``protocol`` mode (default: K
    volunteers of speed 1, the server's default settings)."""
    if opts.workers < 1:
        raise ValueError(f"workers must be >= 1, got {opts.workers}")
    if not 0.0 <= opts.drop_prob < 1.0:
        raise ValueError(f"drop_prob must be in [0, 1), got {opts.drop_prob}")
    if opts.batches != "worker" and opts.mode == "protocol":
        raise ValueError("protocol mode deals leases as the platform does: batches must be worker")
    if protocol is not None and opts.mode != "protocol":
        raise ValueError("protocol options apply to protocol mode only")
    if opts.downloads not in ("full", "delta"):
        raise ValueError(f"downloads must be full or delta, got {opts.downloads!r}")
    if opts.downloads != "full" and opts.mode not in ("diloco", "protocol"):
        raise ValueError(f"downloads={opts.downloads!r} applies to diloco and protocol modes")
    run: Runner
    n_shards = opts.workers
    if opts.mode == "protocol":
        from diloco.simulate.events import protocol_runner
        from diloco.simulate.protocol_mode import ProtocolOptions

        protocol = protocol or ProtocolOptions()
        run, n_shards = protocol_runner(protocol, opts)
    elif opts.mode == "diloco":
        from diloco.simulate.diloco_mode import run_diloco

        run = run_diloco
    else:
        run = _run_baseline
        if opts.mode == "single" and opts.single_data == "all":
            n_shards = 1
    device = torch.device(opts.device)
    cfg, data = simulated_data(cfg, n_shards)
    torch.manual_seed(opts.seed)  # the initial global model
    model = build_model(cfg.model)
    initial = evaluate(
        model, data.val, block_size=cfg.model.block_size, max_windows=opts.eval_windows,
        device=device,
    )  # fmt: skip
    started = time.perf_counter()
    trained = run(cfg, opts, data, model, device, progress)
    final = evaluate(model, data.val, block_size=cfg.model.block_size, device=device)
    if trained.delta is not None and trained.outer_params is not None:  # x's, for information
        exact = build_model(cfg.model)
        load_parameters(exact, trained.outer_params)
        trained.delta.final_eval_loss_outer = evaluate(
            exact, data.val, block_size=cfg.model.block_size, device=device
        )
    return SimResult(
        mode=opts.mode,
        workers=opts.workers if opts.mode != "single" else 1,
        seed=opts.seed,
        inner_steps=cfg.inner.steps,
        n_rounds=cfg.rounds.max_rounds,
        compression=cfg.compression.kind if opts.mode in ("diloco", "protocol") else "none",
        drop_prob=opts.drop_prob,
        n_params=model.num_parameters(),
        final_eval_loss=final,
        initial_eval_loss=initial,
        bytes_up_per_worker=trained.bytes_up_per_worker,
        bytes_down_per_worker=trained.bytes_down_per_worker,
        wall_s=time.perf_counter() - started,
        rounds=trained.records,
        config=cfg.model_dump(),
        protocol=trained.protocol,
        downloads=opts.downloads,
        overlap=cfg.inner.overlap,
        delta=trained.delta,
        final_params=snapshot(model),
    )


def _run_baseline(
    cfg: RunConfig,
    opts: SimOptions,
    data: Dataset,
    model: LanguageModel,
    device: torch.device,
    progress: Progress | None,
) -> Trained:
    """``ddp`` (one model, a batch from each of K workers' data per step) or ``single``
    (worker 0's data), dealt per ``opts.batches`` (:mod:`diloco.simulate.dealing`)."""
    H, R = cfg.inner.steps, cfg.rounds.max_rounds
    trainer = InnerTrainer(model, cfg.inner, total_steps=cfg.total_inner_steps, device=device)
    K = 1 if opts.mode == "single" else opts.workers
    dealer = Dealer(data, cfg, batches=opts.batches, seed=opts.seed, workers=K)
    recorder = Recorder(cfg, opts, data, device, progress)
    tokens = 0
    for r in range(R):
        dealt = [dealer.deal(r + 1, i) for i in range(K)]

        def next_batch(dealt: list[Dealt] = dealt) -> Batch:
            parts = [d.next_batch() for d in dealt]  # (B, T) each -> (K·B, T)
            return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

        result = trainer.run(H, start_step=r * H, next_batch=next_batch)
        for d in dealt:
            dealer.trained(d)
        tokens += result.tokens
        recorder.close_round(
            model, round=r + 1, tokens=tokens, train_loss=result.mean_loss, accepted=K
        )
    # ring all-reduce: each worker sends and receives 2(K−1)/K of the fp32 gradient per step
    n_params = model.num_parameters()
    per_step = 2 * (K - 1) * n_params * FP32_BYTES // K
    total = per_step * R * H
    return Trained(recorder.records, total, total)


def save_result(result: SimResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
