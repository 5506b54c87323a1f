"""A run's life across the domains: creating one (its data, checkpoint version 0 and round
1), changing its status (resuming restarts the open round's deadline), and its view with the
current round and what it has trained on.

Above ``server.runs``, ``server.checkpoints`` and ``server.rounds``, which it composes;
only its router imports it, so that no domain imports another one back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig
from diloco.model.architectures import build_model
from diloco.model.hf import HFError, load_initial
from diloco.train import parameters_of
from server.checkpoints import service as checkpoints_service
from server.contributors.models import Contributor
from server.http.errors import InvalidConfig, StorageFailed
from server.rounds import service as rounds_service
from server.rounds.models import Contribution
from server.runs import coverage
from server.runs import data as run_data
from server.runs import service as runs_service
from server.runs.models import Run, RunStatus
from server.runs.schemas import Coverage, DataInfo, LatestMetrics, RunOut, RunOwner
from server.settings import Settings
from server.storage import keys
from server.storage.base import Storage
from server.upkeep import memory
from server.webhooks import events as webhooks

log = logging.getLogger("diloco.server.runs")


def _prepare_files(
    storage: Storage,
    *,
    run_id: str,
    cfg: RunConfig,
    source: Path,
    n_shards: int,
    seed: int,
    init: Path | None,
) -> tuple[dict[str, Any], checkpoints_service.VersionFiles, int]:
    """The CPU and disk part of creating a text-file run (runs in a worker thread)."""
    try:
        data = run_data.split_and_store(
            storage, run_id=run_id, cfg=cfg, source=source, n_shards=n_shards
        )
    except OSError as err:
        raise _storage_failed(err) from err
    files, n_params = _write_version_zero(storage, run_id=run_id, cfg=cfg, seed=seed, init=init)
    return data, files, n_params


def _storage_failed(err: OSError) -> StorageFailed:
    return StorageFailed(
        f"the server could not write the run's files ({err.strerror or err}); the operator "
        "should check the free space and permissions of its data dir"
    )


def initial_params(cfg: RunConfig, *, seed: int, init: Path | None) -> dict[str, torch.Tensor]:
    """Version 0's parameters: the given weights (``model.init``: our safetensors, checked
    name by name, shape by shape, finite), or the model initialised under ``seed``."""
    if init is not None:
        try:
            return load_initial(init, cfg.model)
        except HFError as err:
            raise InvalidConfig(str(err)) from None
    torch.manual_seed(seed)
    return parameters_of(build_model(cfg.model))


def _write_version_zero(
    storage: Storage, *, run_id: str, cfg: RunConfig, seed: int, init: Path | None
) -> tuple[checkpoints_service.VersionFiles, int]:
    """Checkpoint version 0 (``initial_params``) and the model's parameter count."""
    params = initial_params(cfg, seed=seed, init=init)
    try:
        hparams = {"lr": cfg.outer.lr, "momentum": cfg.outer.momentum}
        files = checkpoints_service.write_initial(
            storage,
            run_id=run_id,
            params=params,
            hparams=hparams | {"nesterov": cfg.outer.nesterov},
        )
    except OSError as err:
        raise _storage_failed(err) from err
    return files, sum(p.numel() for p in params.values())


async def create(
    *,
    session: AsyncSession,
    storage: Storage,
    settings: Settings,
    cfg: RunConfig,
    data_file: Path,
    data_name: str,
    init_file: Path | None = None,
    owner_id: str | None = None,
) -> Run:
    """Write the run's files, then its rows. On any error what was written under
    ``runs/<id>/`` is removed before the error answer goes out (a commit that fails after
    this returns leaves a folder without a row, which the janitor collects)."""
    run_id = f"run_{secrets.token_hex(6)}"
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(31)
    try:
        data, files, n_params = await asyncio.to_thread(
            _prepare_files,
            storage,
            run_id=run_id,
            cfg=cfg,
            source=data_file,
            n_shards=settings.n_shards,
            seed=seed,
            init=init_file,
        )
        memory.settle_if_imported()  # building version 0's model imported its modules
        config = cfg.pinned().model_dump(mode="json") | {"seed": seed}  # recorded, drawn or given
        config["data"]["path"] = data_name  # the server's copy lives in storage, not at this path
        run = Run(
            id=run_id,
            name=cfg.name,
            status=RunStatus.ACTIVE,
            config=config,
            seed=seed,
            n_params=n_params,
            checkpoint_version=0,
            created_at=datetime.now(UTC),
            owner_id=owner_id,
            **data,
        )
        await _add_rows(session, run, files)
    except BaseException:
        _discard_files(storage, run_id)
        raise
    return run


async def _add_rows(
    session: AsyncSession,
    run: Run,
    files: checkpoints_service.VersionFiles,
    *,
    units: list[tuple[int, int]] | None = None,
    unit_tokens: int = 0,
) -> None:
    """A new run's rows: the run, its data units (a dataset run), version 0, round 1."""
    session.add(run)
    await session.flush()
    if units is not None:
        await coverage.create_units(
            session, run_id=run.id, units=units, tokens=unit_tokens, seed=run.seed
        )
    session.add(checkpoints_service.row_for(files, run_id=run.id, eval_loss=None))
    await rounds_service.open_round(session=session, run=run, index=1, now=datetime.now(UTC))
    await session.flush()


async def create_on_dataset(
    *,
    session: AsyncSession,
    storage: Storage,
    plan: runs_service.DatasetPlan,
    init_file: Path | None = None,
    owner_id: str | None = None,
) -> Run:
    """Write version 0 of a planned dataset run (in a worker thread, before the session
    is used: the caller holds no transaction while it is written), then its rows: the
    run, its data units and round 1."""
    cfg, manifest = plan.cfg, plan.manifest
    run_id = f"run_{secrets.token_hex(6)}"
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(31)
    try:
        files, n_params = await asyncio.to_thread(
            _write_version_zero, storage, run_id=run_id, cfg=cfg, seed=seed, init=init_file
        )
        run = Run(
            id=run_id,
            name=cfg.name,
            status=RunStatus.ACTIVE,
            config=cfg.pinned().model_dump(mode="json") | {"seed": seed},
            seed=seed,
            n_params=n_params,
            checkpoint_version=0,
            created_at=datetime.now(UTC),
            n_shards=len(manifest.shards),
            chunk_len=manifest.shard_tokens,
            train_tokens=manifest.train_tokens,
            val_tokens=manifest.val.tokens,
            shards=[
                {"sha256": s.sha256, "nbytes": s.nbytes, "tokens": s.tokens}
                for s in manifest.shards
            ],
            dataset_id=plan.dataset_id,
            token_dtype=manifest.dtype,
            owner_id=owner_id,
        )
        await _add_rows(session, run, files, units=plan.units, unit_tokens=plan.unit_tokens)
    except BaseException:
        _discard_files(storage, run_id)
        raise
    return run


def _discard_files(storage: Storage, run_id: str) -> None:
    try:
        count = storage.delete_prefix(keys.run(run_id))
    except OSError as err:
        log.error(
            "creating run %s failed, then removing its files: %s (the janitor will)", run_id, err
        )
        return
    if count:
        log.info("creating run %s failed; the %d files it wrote are removed", run_id, count)


async def transition(*, session: AsyncSession, run_id: str, action: str, now: datetime) -> Run:
    """``server.runs.service.transition``; resuming gives the paused round its full time."""
    run = await runs_service.transition(session=session, run_id=run_id, action=action)
    if action == "cancel":
        await webhooks.emit(session, run_id=run_id, event="run.cancelled", data={}, now=now)
    if action == "resume":
        await rounds_service.restart_deadline(session=session, run=run, now=now)
        await session.flush()
    return run


async def tokens_trained(session: AsyncSession, run_id: str) -> int:
    """Tokens trained: the accepted contributions' weights (``rounds.models.Contribution``)."""
    total = await session.scalar(
        select(func.coalesce(func.sum(Contribution.weight), 0)).where(Contribution.run_id == run_id)
    )
    return int(total or 0)


async def run_coverage(session: AsyncSession, run: Run) -> Coverage:
    """``server.runs.coverage.view`` with the tokens the run has trained on."""
    return await coverage.view(session, run, trained=await tokens_trained(session, run.id))


async def view(*, session: AsyncSession, settings: Settings, run: Run, now: datetime) -> RunOut:
    trained = coverage.trained_totals(run, await tokens_trained(session, run.id))
    current = await rounds_service.current_view(
        session=session, settings=settings, run=run, now=now
    )
    last = await rounds_service.last_closed(session=session, run_id=run.id)
    latest = (
        None
        if last is None
        else LatestMetrics(round=last.index, eval_loss=last.eval_loss, train_loss=last.train_loss)
    )
    owner = None if run.owner_id is None else await session.get(Contributor, run.owner_id)
    return RunOut(
        id=run.id,
        name=run.name,
        status=run.status,
        owner=None if owner is None else RunOwner(id=owner.id, name=owner.name),
        created_at=run.created_at,
        config=run.config,
        n_params=run.n_params,
        checkpoint_version=run.checkpoint_version,
        private=run.invite_hash is not None,
        data=DataInfo(
            train_tokens=run.train_tokens,
            val_tokens=run.val_tokens,
            n_shards=run.n_shards,
            chunk_len=run.chunk_len,
            dataset_id=run.dataset_id,
            token_dtype=run.token_dtype,
            tokens_trained=trained.tokens_trained,
            epochs=trained.epochs,
        ),
        current_round=current,
        latest=latest,
    )
