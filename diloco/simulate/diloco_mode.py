"""``diloco simulate --mode diloco``: K workers, R rounds, the platform's own code.

Each round every worker trains H inner steps from θ(t−1) (:mod:`diloco.train`), sends Δ
through the codec and the wire format, and the server's side of the round
(:mod:`diloco.simulate.server`) checks each upload and closes the round with the server's
own close (:mod:`diloco.outer.close`: robust aggregate, Nesterov step, int8 delta with error
feedback, every step judged before it is published). ``SimOptions.attacks`` turns workers
into attackers (:mod:`diloco.simulate.attacks`), for ``bench/attacks.py``.
``SimOptions.downloads="delta"`` counts what workers download as the deltas since the
version they hold (:mod:`diloco.simulate.downloads`); either way they start from the published
θ, as a volunteer does.
"""

from __future__ import annotations

import torch
from safetensors.torch import save as safetensors_save

from diloco.config import RunConfig
from diloco.data.text import Dataset
from diloco.model.architectures import build_model
from diloco.model.gpt import LanguageModel
from diloco.protocol.state import Refusal
from diloco.simulate.attacks import hostile_body
from diloco.simulate.dealing import Dealer, stream_generator
from diloco.simulate.downloads import DeltaReport, Ledger
from diloco.simulate.run import (
    Progress,
    Recorder,
    SimOptions,
    Trained,
    train_upload,
)
from diloco.simulate.server import SIM_RUN_ID, open_round
from diloco.simulate.versions import Versions
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
    of a round (:mod:`diloco.simulate.server`: checked uploads, the server's close).
    ``model`` ends holding the final published parameters θ (``Trained.delta`` reports
    x = θ + r beside them with delta downloads)."""
    versions = Versions(cfg, parameters_of(model), run_id=SIM_RUN_ID, delta_dir=opts.delta_dir)
    try:
        return _rounds(cfg, opts, data, device, progress, model, versions)
    finally:
        versions.cleanup()


def _rounds(
    cfg: RunConfig,
    opts: SimOptions,
    data: Dataset,
    device: torch.device,
    progress: Progress | None,
    model: LanguageModel,
    versions: Versions,
) -> Trained:
    R, K = cfg.rounds.max_rounds, opts.workers
    checkpoint_bytes = len(safetensors_save(versions.theta))  # what a worker downloads per round
    ledger = Ledger(versions.sizes, checkpoint_bytes) if opts.downloads == "delta" else None
    # every worker: its own copy of the model, its own AdamW (kept across rounds), its own data
    trainers = [
        InnerTrainer(build_model(cfg.model), cfg.inner, total_steps=cfg.total_inner_steps,
                     device=device)
        for _ in range(K)
    ]  # fmt: skip
    dealer = Dealer(data, cfg, batches=opts.batches, seed=opts.seed, workers=K)
    drops = stream_generator(opts.seed, 10_000)
    recorder = Recorder(cfg, opts, data, device, progress)
    judge = recorder.evaluator(build_model(cfg.model))
    history: list[float] = []  # norms of aggregated contributions: the clipping's reference
    earlier: dict[int, dict[str, torch.Tensor]] = {}  # each worker's Δ of the round before
    bytes_up = bytes_down = tokens = 0
    for r in range(R):
        desk = open_round(cfg, r + 1)
        losses, first_delta = [], None
        start = versions.theta
        for i, trainer in enumerate(trainers):
            dealt = dealer.deal(r + 1, i)  # this round's batches (simulate.dealing)
            # download θ(t−1), train H steps, Δ = θ(t−1) − θi through codec and wire
            if ledger is None:
                bytes_down += checkpoint_bytes
            else:
                ledger.fetch(f"worker-{i}", r)
            upload = train_upload(trainer, start, cfg=cfg, round=r + 1, next_batch=dealt.next_batch)
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
            if not isinstance(desk.admit(f"worker-{i}@{r + 1}", f"worker-{i}", chunks), Refusal):
                dealer.trained(dealt)  # the server counts the unit covered at upload
        # the server's close (no step when every contribution was lost or refused); version
        # r+1 is published either way, the next round starts from it
        stepped = desk.close(versions, evaluate=judge, history=history)
        update_norm, left_out, accepted = stepped.update_norm, len(stepped.left_out), 0
        if stepped.update_norm is not None:
            accepted = len(stepped.shares)
            norms = [share.norm for share in stepped.shares.values()]
            history = [*history, *norms][-cfg.aggregation.history :]
        load_parameters(model, versions.theta)
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
    if ledger is None:
        return Trained(recorder.records, bytes_up // K, bytes_down // K)
    last = versions.sizes[versions.version]
    report = DeltaReport(checkpoint_bytes, last, residual_norms=list(versions.residual_norms))
    return Trained(
        recorder.records,
        bytes_up // K,
        ledger.bytes // K,
        delta=report,
        outer_params=versions.exact(),
    )
