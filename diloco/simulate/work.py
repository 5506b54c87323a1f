"""A simulated worker's round, as a volunteer's: train from the round's version (with overlap,
after steps taken ahead from its own last round, folding the version in), Δ through the
run's codec with error feedback, and the contribution body the wire carries; and what such a
body weighs for a model, from its shapes alone. Every mode of ``diloco simulate`` that trains
workers calls ``train_upload`` (:mod:`diloco.simulate.diloco_mode`,
:mod:`diloco.simulate.events`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.config import RunConfig
from diloco.model.gpt import LanguageModel
from diloco.outer.optimizer import pseudo_gradient
from diloco.simulate.server import SIM_RUN_ID
from diloco.train import Ahead, Batch, InnerResult, InnerTrainer, parameters_of, snapshot
from diloco.wire.contribution import ContributionMeta, encode_contribution
from diloco.wire.exchange import codec_for, encode_delta
from diloco.wire.header import body_bytes, prefix_and_header, specs_for


@dataclass(frozen=True)
class Upload:
    """One worker's round as it goes over the wire."""

    chunks: list[bytes]  # the encoded body (diloco.wire.contribution)
    codec: dict  # the codec's description, as the header names it
    result: InnerResult  # steps, tokens, losses of the inner loop
    delta: dict[str, torch.Tensor] = field(repr=False)  # Δ before the codec (for attacks)
    meta: ContributionMeta | None = None  # the header it was sent with

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)


def train_upload(
    trainer: InnerTrainer,
    params: dict[str, torch.Tensor],
    *,
    cfg: RunConfig,
    round: int,
    next_batch: Callable[[], Batch],
    steps: int | None = None,
    ahead: Ahead | None = None,
) -> Upload:
    """What a volunteer does for round ``round`` (from 1): load θ(t−1) = ``params``, train
    ``steps`` (its lease's H; None: the run's H) steps from global step (round − 1)·H,
    Δ = θ(t−1) − θi through the codec and the wire format. The trainer's AdamW state
    carries over from its previous rounds (its first moment zeroed with ``[inner]
    reset_momentum``: ``InnerTrainer.start_lease``, as the client does).

    ``ahead``: overlap (``train_ahead``). Its steps were the first of these, taken from the
    worker's own end of the round before while θ(t−1) was still being published;
    ``InnerTrainer.start_after`` folds their progress onto θ(t−1) and the rest follow (at
    least one). The tokens are the rest's, and the steps ahead's when ``ahead.counted``."""
    H = cfg.inner.steps
    n = steps or H
    k = trainer.start_after(params, ahead)
    rest = trainer.run(max(1, n - k), start_step=(round - 1) * H + k, next_batch=next_batch)
    first = InnerResult(0, 0) if ahead is None else ahead.result
    counted = first.tokens if ahead is not None and ahead.counted else 0
    result = InnerResult(k + rest.steps, counted + rest.tokens, first.losses + rest.losses)
    delta = pseudo_gradient(params, snapshot(trainer.model))
    # the worker's error-feedback residual, kept with its AdamW state, as the client does
    encoded, codec, trainer.error_feedback = encode_delta(
        delta, cfg.compression, trainer.error_feedback
    )
    meta = ContributionMeta(
        run_id=SIM_RUN_ID,
        round=round,
        base_version=round - 1,
        tokens=result.tokens,
        inner_steps=steps or H,
        loss=result.mean_loss,
        codec=codec,
    )
    return Upload(list(encode_contribution(meta, encoded)), codec, result, delta, meta)


def upload_nbytes(cfg: RunConfig, model: LanguageModel) -> int:
    """The size of a volunteer's upload body for ``model`` under the run's codec, from the
    shapes alone (``specs_for``, as the server's upload limit is computed)."""
    codec = codec_for(cfg.compression)
    specs = specs_for(codec, {n: tuple(p.shape) for n, p in parameters_of(model).items()})
    steps = cfg.inner.steps
    meta = ContributionMeta(
        run_id=SIM_RUN_ID,
        round=1,
        base_version=0,
        tokens=steps * cfg.tokens_per_step,
        inner_steps=steps,
        loss=0.0,
        codec=codec.describe(),
    )
    return body_bytes(len(prefix_and_header(meta, specs)), specs)
