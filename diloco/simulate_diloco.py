"""``diloco simulate --mode diloco``: K workers, R rounds, the platform's own code.

Each round every worker trains H inner steps from θ(t−1) (:mod:`diloco.train`), sends Δ
through the codec and the wire format, and the server's side of the round
(:mod:`diloco.simulate_server`) checks each upload, aggregates robustly and applies the
guarded Nesterov step. ``SimOptions.attacks`` turns workers into attackers
(:mod:`diloco.attacks`), for ``bench/attacks.py``. ``SimOptions.downloads="delta"`` has
workers start from the parameters published by int8 deltas (:mod:`diloco.simulate_delta`)
rather than from the outer optimizer's exact ones.
"""

from __future__ import annotations

import torch
from safetensors.torch import save as safetensors_save

from diloco.architectures import build_model
from diloco.attacks import hostile_body
from diloco.codec import Int8Codec
from diloco.config import RunConfig
from diloco.data import Dataset
from diloco.model import LanguageModel
from diloco.outer import OuterOptimizer
from diloco.protocol.rules import assign_lease
from diloco.simulate import (
    Progress,
    Recorder,
    SimOptions,
    Trained,
    batch_source,
    lease_batches,
    stream_generator,
    train_upload,
)
from diloco.simulate_delta import Ledger, Publisher
from diloco.simulate_server import open_round
from diloco.train import InnerTrainer, load_parameters, parameters_of


def run_diloco(
    cfg: RunConfig,
    opts: SimOptions,
    data: Dataset,
    model: LanguageModel,
    device: torch.device,
    progress: Progress | None,
) -> Trained:
    """K workers, R rounds of H inner steps, Δ through codec + wire, and the server's side
    of a round (:mod:`diloco.simulate_server`: checked uploads, the robust aggregate, the
    guarded Nesterov step). ``model`` ends holding the final published parameters: the
    outer optimizer's, or with delta downloads θ (then ``Trained.delta`` reports on both)."""
    R, K = cfg.rounds.max_rounds, opts.workers
    outer = OuterOptimizer(
        parameters_of(model),
        lr=cfg.outer.lr,
        momentum=cfg.outer.momentum,
        nesterov=cfg.outer.nesterov,
    )
    checkpoint_bytes = len(safetensors_save(outer.params))  # what a worker downloads per round
    # delta downloads: θ, published by int8 deltas, is what workers download and start from
    publisher = ledger = None
    if opts.downloads == "delta":
        codec = Int8Codec(cfg.compression.block_size)
        publisher = Publisher(outer.params, codec, opts.delta_dir)
        ledger = Ledger(publisher, checkpoint_bytes)
    # every worker: its own copy of the model, its own AdamW (kept across rounds), its own data
    trainers, streams = [], []
    for i in range(K):
        worker_model = build_model(cfg.model)
        trainers.append(
            InnerTrainer(worker_model, cfg.inner, total_steps=cfg.total_inner_steps, device=device)
        )
        streams.append(batch_source(data.shards[i], cfg, stream_generator(opts.seed, i)))
    drops = stream_generator(opts.seed, 10_000)
    recorder = Recorder(cfg, opts, data, device, progress)
    evaluate_params = recorder.evaluator(build_model(cfg.model))
    base_loss = evaluate_params(outer.params)
    history: list[float] = []  # norms of aggregated contributions: the clipping's reference
    earlier: dict[int, dict[str, torch.Tensor]] = {}  # each worker's Δ of the round before
    bytes_up = bytes_down = tokens = 0
    for r in range(R):
        desk = open_round(cfg, r + 1)
        losses, first_delta = [], None
        start = outer.params if publisher is None else publisher.theta
        for i, trainer in enumerate(trainers):
            # this round's batches: the worker's own stream, or the i-th lease's
            next_batch = streams[i]
            if opts.batches == "lease":
                lease = assign_lease(i, round=r + 1, run_seed=opts.seed, n_shards=K)
                next_batch = lease_batches(data, cfg, lease)
            # download θ(t−1), train H steps, Δ = θ(t−1) − θi through codec and wire
            if ledger is None:
                bytes_down += checkpoint_bytes
            else:
                ledger.fetch(f"worker-{i}", r)
            upload = train_upload(trainer, start, cfg=cfg, round=r + 1, next_batch=next_batch)
            tokens += upload.result.tokens
            losses.append(upload.result.mean_loss)
            chunks = upload.chunks
            if attack := opts.attacks.get(i):  # what a hostile volunteer sends instead
                assert upload.meta is not None
                chunks = [
                    hostile_body(
                        attack,
                        upload.delta,
                        upload.meta,
                        kind=cfg.compression.kind,
                        block_size=cfg.compression.block_size,
                        seed=opts.seed * 1_000 + r,
                        other_delta=first_delta,
                        stale_delta=earlier.get(i, upload.delta),
                    )
                ]
            elif first_delta is None:
                first_delta = upload.delta
            earlier[i] = upload.delta
            bytes_up += sum(len(c) for c in chunks)
            # a dropped upload never reaches the server
            if opts.drop_prob and float(torch.rand((), generator=drops)) < opts.drop_prob:
                continue
            desk.admit(f"worker-{i}@{r + 1}", f"worker-{i}", chunks)
        # the guarded outer step, unless every contribution was lost or refused
        update_norm, accepted, left_out = None, 0, 0
        if desk.admitted:
            stepped = desk.close(
                outer, evaluate=evaluate_params, base_loss=base_loss, history=history
            )
            left_out = len(stepped.left_out)
            if stepped.rejected is None:  # published: the next round starts from it
                assert stepped.eval_loss is not None
                outer, update_norm = stepped.outer, stepped.update_norm
                base_loss, accepted = stepped.eval_loss, len(desk.admitted) - left_out
                norms = [share.norm for share in stepped.aggregate.shares.values()]
                history = [*history, *norms][-cfg.aggregation.history :]
        if publisher is None:
            load_parameters(model, outer.params)
        else:  # version r+1: a delta towards x (only x's residual when no step was taken)
            publisher.publish(outer.params)
            load_parameters(model, publisher.theta)
        recorder.close_round(
            model,
            round=r + 1,
            tokens=tokens,
            train_loss=sum(losses) / len(losses),
            accepted=accepted,
            update_norm=update_norm,
            refused=sum(desk.refused.values()),
            left_out=left_out,
        )
    if publisher is None or ledger is None:
        return Trained(recorder.records, bytes_up // K, bytes_down // K)
    report = publisher.report(checkpoint_bytes)
    down = ledger.bytes // K
    return Trained(recorder.records, bytes_up // K, down, delta=report, outer_params=outer.params)
