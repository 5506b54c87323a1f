"""Runs: plan a run on a dataset, read, change status, private runs' invites and members.

Creating a run (its data, checkpoint 0 and round 1), resuming one and its view with the
current round compose several domains: they live in ``server.lifecycle``."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from diloco.config import RunConfig, parse_config
from diloco.data.manifest import Manifest
from diloco.data.units import plan_units
from diloco.model.architectures import parameter_count
from diloco.outer.memory import close_memory_bytes
from server.auth import hash_token, new_token
from server.datasets import service as datasets_service
from server.http.errors import (
    InvalidConfig,
    InvalidData,
    InvalidInvite,
    InvalidTransition,
    ModelTooLarge,
    RunNotFound,
)
from server.runs.models import Run, RunMember, RunStatus
from server.runs.schemas import Member
from server.settings import Settings
from server.storage.base import Storage

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
    here (``diloco.outer.memory.close_memory_bytes`` against ``close_memory_share``). Shapes
    only: nothing of the model's size is allocated."""
    need = close_memory_bytes(cfg, val_bytes=val_bytes)
    share = settings.close_memory_share
    if need > share:
        n_params = parameter_count(cfg.model)
        raise ModelTooLarge(
            f"model: a round close of this model ({n_params:,} parameters) needs about "
            f"{need / GIB:.1f} GiB, over the {share / GIB:.1f} GiB one close may use on this "
            f"server (a {settings.close_memory_budget / GIB:.1f} GiB budget shared by "
            f"{settings.close_concurrency} concurrent closes); make the model smaller, or "
            "have the operator raise DILOCO_CLOSE_MEMORY_BUDGET_BYTES",
            needed_bytes=need,
            budget_bytes=share,
        )


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
    units = plan_units([s.tokens for s in manifest.shards], unit_tokens)
    if not units:
        raise InvalidConfig(
            f"inner.steps: a lease trains on steps x batch_size x block_size + 1 = "
            f"{unit_tokens:,} consecutive tokens of one shard, and no shard of this dataset "
            f"holds that many (largest {max(s.tokens for s in manifest.shards):,}); lower "
            "inner.steps or inner.batch_size, or prepare with a larger --shard-tokens"
        )
    itemsize = manifest.val.nbytes // manifest.val.tokens
    check_memory(cfg, settings=settings, val_bytes=eval_val_bytes(cfg, itemsize))
    return DatasetPlan(cfg, manifest, row.id, units, unit_tokens)


def eval_val_bytes(cfg: RunConfig, itemsize: int) -> int:
    """The validation tokens an eval reads (its windows), in bytes as read from storage."""
    return (cfg.eval.windows * cfg.model.block_size + 1) * itemsize


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


def run_config(run: Run) -> RunConfig:
    """The run's config, as recorded at its creation."""
    return parse_config(run.config)


async def list_all(*, session: AsyncSession, owner_id: str | None = None) -> list[Run]:
    """Every run, newest first; only ``owner_id``'s when given."""
    query = select(Run).order_by(Run.created_at.desc())
    if owner_id is not None:
        query = query.where(Run.owner_id == owner_id)
    return list(await session.scalars(query))


async def transition(*, session: AsyncSession, run_id: str, action: str) -> Run:
    """The run's new status after ``action`` (its row locked); resuming also restarts the
    open round's deadline, which ``server.lifecycle.transition`` does."""
    run = await get(session=session, run_id=run_id, lock="update")
    new = TRANSITIONS[RunStatus(run.status)].get(action)
    if new is None:
        allowed = ", ".join(TRANSITIONS[RunStatus(run.status)]) or "nothing"
        raise InvalidTransition(
            f"cannot {action} a run that is {run.status}; allowed: {allowed}", status=run.status
        )
    run.status = new
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
