"""Runs: create (split the data, write checkpoint 0, open round 1), read, change status."""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.architectures import build_model, parameter_shapes
from diloco.close_memory import close_memory_bytes
from diloco.config import RunConfig
from diloco.hf import HFError, load_initial
from diloco.manifest import Manifest
from diloco.train import parameters_of
from server import keys
from server.auth import hash_token, new_token
from server.checkpoints import service as checkpoints_service
from server.datasets import service as datasets_service
from server.errors import (
    InvalidConfig,
    InvalidData,
    InvalidInvite,
    InvalidTransition,
    ModelTooLarge,
    RunNotFound,
    StorageFailed,
)
from server.rounds import service as rounds_service
from server.runs import coverage
from server.runs import data as run_data
from server.runs.models import Run, RunMember, RunStatus
from server.runs.schemas import DataInfo, LatestMetrics, Member, RunOut
from server.settings import Settings
from server.storage import Storage

log = logging.getLogger("diloco.server.runs")
GIB = 1 << 30

# status -> action -> new status; everything else is an invalid transition
TRANSITIONS: dict[RunStatus, dict[str, RunStatus]] = {
    RunStatus.ACTIVE: {"pause": RunStatus.PAUSED, "cancel": RunStatus.CANCELLED},
    RunStatus.PAUSED: {"resume": RunStatus.ACTIVE, "cancel": RunStatus.CANCELLED},
    RunStatus.COMPLETED: {},
    RunStatus.CANCELLED: {},
}


def check_memory(cfg: RunConfig, *, settings: Settings, val_bytes: int) -> None:
    """Refuse a model whose round close would need more memory than one close may use
    here (``diloco.close_memory.close_memory_bytes`` against ``close_memory_share``). Shapes
    only: nothing of the model's size is allocated."""
    need = close_memory_bytes(cfg, val_bytes=val_bytes)
    share = settings.close_memory_share
    if need > share:
        n_params = sum(math.prod(s) for s in parameter_shapes(cfg.model).values())
        raise ModelTooLarge(
            f"model: a round close of this model ({n_params:,} parameters) needs about "
            f"{need / GIB:.1f} GiB, over the {share / GIB:.1f} GiB one close may use on this "
            f"server (a {settings.close_memory_budget / GIB:.1f} GiB budget shared by "
            f"{settings.close_concurrency} concurrent closes); make the model smaller, or "
            "have the operator raise DILOCO_CLOSE_MEMORY_BUDGET_BYTES",
            needed_bytes=need,
            budget_bytes=share,
        )


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
        config = cfg.model_dump(mode="json") | {"seed": seed}  # recorded, drawn or given
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


@dataclass(frozen=True)
class DatasetPlan:
    """A run on a dataset, checked and planned (``plan_on_dataset``), not yet created."""

    cfg: RunConfig  # with the dataset's vocabulary
    manifest: Manifest
    dataset_id: str
    units: list[tuple[int, int]]
    unit_tokens: int


async def plan_on_dataset(
    *, session: AsyncSession, storage: Storage, settings: Settings, cfg: RunConfig
) -> DatasetPlan:
    """Check that a prepared dataset already in storage (``server.datasets``) fits the
    config, record its vocabulary in the config and plan the data units. Nothing of the
    dataset is read but its manifest; ``create_on_dataset`` then creates the run."""
    assert cfg.data.dataset is not None
    row = await datasets_service.get(session, cfg.data.dataset)
    state = await datasets_service.view(session, storage, row)
    if not state.complete:
        raise InvalidData(
            f"data.dataset: {row.id} is missing {len(state.missing)} file(s) "
            f"({', '.join(state.missing[:5])}); upload them first (diloco run create resumes)"
        )
    manifest = datasets_service.manifest_of(row)
    vocab = manifest.tokenizer.vocab_size
    if cfg.model.vocab_size not in (None, vocab):
        raise InvalidConfig(
            f"model.vocab_size: {cfg.model.vocab_size} is not the dataset's vocabulary ({vocab})"
        )
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab})})
    block = cfg.model.block_size
    if manifest.val.tokens < block + 1:
        raise InvalidData(
            f"data.dataset: its validation file has {manifest.val.tokens} tokens, fewer than "
            f"one window of block_size + 1 = {block + 1}"
        )
    unit_tokens = cfg.lease_tokens + 1
    units = coverage.plan_units([s.tokens for s in manifest.shards], unit_tokens)
    if not units:
        raise InvalidConfig(
            f"inner.steps: a lease trains on steps x batch_size x block_size + 1 = "
            f"{unit_tokens:,} consecutive tokens of one shard, and no shard of this dataset "
            f"holds that many (largest {max(s.tokens for s in manifest.shards):,}); lower "
            "inner.steps or inner.batch_size, or prepare with a larger --shard-tokens"
        )
    itemsize = manifest.val.nbytes // manifest.val.tokens
    check_memory(cfg, settings=settings, val_bytes=eval_val_bytes(cfg, settings, itemsize))
    return DatasetPlan(cfg, manifest, row.id, units, unit_tokens)


async def create_on_dataset(
    *, session: AsyncSession, storage: Storage, plan: DatasetPlan, init_file: Path | None = None
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
            config=cfg.model_dump(mode="json") | {"seed": seed},
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
        )
        await _add_rows(session, run, files, units=plan.units, unit_tokens=plan.unit_tokens)
    except BaseException:
        _discard_files(storage, run_id)
        raise
    return run


def eval_val_bytes(cfg: RunConfig, settings: Settings, itemsize: int) -> int:
    """The validation tokens an eval reads (its windows), in bytes as read from storage."""
    return (cfg.eval.windows * cfg.model.block_size + 1) * itemsize


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


async def get(
    *, session: AsyncSession, run_id: str, lock: Literal["update", "share"] | None = None
) -> Run:
    """The run; ``lock`` takes its row lock for the rest of the transaction (always the
    run's before its rounds', so that no two transactions wait on each other)."""
    query = select(Run).where(Run.id == run_id).execution_options(populate_existing=True)
    if lock is not None:
        query = query.with_for_update(read=lock == "share")
    run = await session.scalar(query)
    if run is None:
        raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
    return run


async def list_all(*, session: AsyncSession) -> list[Run]:
    return list(await session.scalars(select(Run).order_by(Run.created_at.desc())))


async def transition(*, session: AsyncSession, run_id: str, action: str, now: datetime) -> Run:
    run = await get(session=session, run_id=run_id, lock="update")
    new = TRANSITIONS[RunStatus(run.status)].get(action)
    if new is None:
        allowed = ", ".join(TRANSITIONS[RunStatus(run.status)]) or "nothing"
        raise InvalidTransition(
            f"cannot {action} a run that is {run.status}; allowed: {allowed}", status=run.status
        )
    run.status = new
    if action == "resume":  # a paused round gets its full time again
        await rounds_service.restart_deadline(session=session, run=run, now=now)
    await session.flush()
    return run


# ---------------------------------------------------------------- private runs


async def new_invite(*, session: AsyncSession, run_id: str) -> str:
    """Make the run private with a new invite code (the old one, if any, stops admitting;
    the members it admitted stay). The code is returned once; only its hash is stored."""
    run = await get(session=session, run_id=run_id, lock="update")
    code = new_token("inv")
    run.invite_hash = hash_token(code)
    await session.flush()
    return code


async def make_public(*, session: AsyncSession, run_id: str) -> None:
    """Anyone may join again; the members stay members (should it go private again)."""
    run = await get(session=session, run_id=run_id, lock="update")
    run.invite_hash = None
    await session.flush()


async def admit(
    *, session: AsyncSession, run_id: str, contributor_id: str, invite: str, now: datetime
) -> Member:
    """Admit the contributor to the private run with its current invite code (again:
    changes nothing); a public run admits anyone without a membership."""
    run = await get(session=session, run_id=run_id)
    if run.invite_hash is None:
        return Member(run_id=run_id, contributor_id=contributor_id, joined_at=None)
    if not hmac.compare_digest(hash_token(invite), run.invite_hash):
        raise InvalidInvite(f"that is not run {run_id}'s invite code; ask its owner for it")
    joined = await session.scalar(
        insert(RunMember)
        .values(run_id=run_id, contributor_id=contributor_id, joined_at=now)
        .on_conflict_do_update(
            index_elements=[RunMember.run_id, RunMember.contributor_id],
            set_={"run_id": RunMember.run_id},  # a no-op that returns the existing row
        )
        .returning(RunMember.joined_at)
    )
    return Member(run_id=run_id, contributor_id=contributor_id, joined_at=joined)


async def view(*, session: AsyncSession, settings: Settings, run: Run, now: datetime) -> RunOut:
    trained = await coverage.view_totals(session, run)
    current = await rounds_service.current_view(
        session=session, settings=settings, run=run, now=now
    )
    last = await rounds_service.last_closed(session=session, run_id=run.id)
    latest = (
        None
        if last is None
        else LatestMetrics(round=last.index, eval_loss=last.eval_loss, train_loss=last.train_loss)
    )
    return RunOut(
        id=run.id,
        name=run.name,
        status=run.status,
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
