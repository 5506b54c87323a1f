"""The routes of ``/api/v1/runs`` that compose domains (``server.lifecycle.service``):
create a run, list and read runs with their current round, coverage, storage (retention
reads the rounds), pause, resume and cancel. The routes of a run's invites and members are
in ``server.runs.router``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile

from diloco.config import ConfigError, RunConfig, parse_config
from diloco.model.architectures import parameter_count
from server.accounts import service as accounts
from server.auth import Manager, ManagerAuth
from server.contributors.models import Contributor
from server.db import SessionDep
from server.http.errors import InvalidConfig, InvalidRequest, NotFound, UploadTooLarge
from server.http.inputs import ContributorId, OwnerFilter, RunId, check_text, declared_length
from server.lifecycle import service
from server.rounds import bans
from server.runs import service as runs_service
from server.runs import usage
from server.runs.access import RunManagerAuth
from server.runs.limits import check_limits
from server.runs.models import Run, RunBan
from server.runs.schemas import (
    Coverage,
    KindUsage,
    RunBanIn,
    RunBanList,
    RunBanOut,
    RunList,
    RunOut,
    StorageUsage,
)
from server.settings import Settings
from server.upkeep import retention

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["config", "data"],
                    "properties": {
                        "config": {"type": "string", "description": "the run config as JSON"},
                        "data": {"type": "string", "format": "binary"},
                    },
                }
            }
        },
    }
}


@router.post("", status_code=201, openapi_extra=CREATE_BODY)
async def create_run(request: Request, session: SessionDep, manager: ManagerAuth) -> RunOut:
    """Create a run from a config (JSON) and its data: a text file (multipart ``data``), or
    a prepared dataset already uploaded (``data.dataset`` = its id, no file part). The admin
    token, or a run owner's: the run is then the owner's, within its quota (403
    ``quota_exceeded`` names the quota: runs not ended, parameters, data bytes)."""
    settings = request.app.state.settings
    declared_length(
        request.headers.get("content-length"),
        limit=settings.max_data_bytes + settings.max_init_bytes,  # each part is checked below
        what="a data file and weights",
        too_large=UploadTooLarge,
    )
    async with request.form(max_files=2, max_fields=1, max_part_size=1 << 20) as form:
        raw, data, init = form.get("config"), form.get("data"), form.get("init")
        if not isinstance(raw, str):
            raise InvalidRequest("config: a multipart field with the run config as JSON is needed")
        cfg = _parse_config(raw)
        if not manager.admin:  # before any file is written: runs at once, the model's size
            assert manager.id is not None
            known = cfg.data.path is not None or cfg.model.vocab_size is not None
            params = parameter_count(cfg.model) if known else None
            await accounts.check_run(session, settings, manager.id, params=params)
        async with _init_file(cfg, init, settings) as init_file:
            if init_file is not None:  # the config records the name the weights came under
                assert isinstance(init, UploadFile)
                name = check_text(
                    Path(init.filename or "init").name, what="init (file name)", max_length=255
                )
                model = cfg.model.model_copy(update={"init": name})
                cfg = cfg.model_copy(update={"model": model})
            run = await _create(request, session, manager, cfg, data, init_file)
    return await service.view(session=session, settings=settings, run=run, now=datetime.now(UTC))


INIT_HEADER_BYTES = 16 << 20  # a safetensors header and alignment, generously


def _spool(source: IO[bytes], target: IO[bytes], *, limit: int, too_large: str) -> None:
    """Copy an uploaded part to its temp file, refusing it past ``limit`` bytes. Up to a
    GiB of data or 16 GiB of weights: run it in a worker thread (``asyncio.to_thread``),
    so that the event loop goes on answering every volunteer's heartbeat meanwhile."""
    while block := source.read(1 << 20):
        target.write(block)
        if target.tell() > limit:
            raise UploadTooLarge(too_large)
    target.flush()


@contextlib.asynccontextmanager
async def _init_file(
    cfg: RunConfig, init: object, settings: Settings
) -> AsyncIterator[Path | None]:
    """The starting weights' part (``model.init``) copied to a temp file, or None."""
    if init is None and cfg.model.init is None:
        yield None
        return
    if not isinstance(init, UploadFile):
        raise InvalidRequest(
            "init: model.init names starting weights: send them as a multipart file part `init`"
        )
    if cfg.model.init is None:
        raise InvalidRequest("init: a weights file part needs model.init in the config")
    tmp_dir = Path(settings.data_dir) / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    limit = settings.max_init_bytes
    if cfg.data.path is not None or cfg.model.vocab_size is not None:  # the shapes are known
        limit = min(limit, 4 * parameter_count(cfg.model) + INIT_HEADER_BYTES)
    with tempfile.NamedTemporaryFile(dir=tmp_dir, suffix=".safetensors") as tmp:
        too_large = f"init: over {limit} bytes, more than this run's model in fp32 needs"
        await asyncio.to_thread(_spool, init.file, tmp, limit=limit, too_large=too_large)
        yield Path(tmp.name)


async def _create(
    request: Request,
    session: SessionDep,
    manager: Manager,
    cfg: RunConfig,
    data: object,
    init: Path | None,
) -> Run:
    settings = request.app.state.settings
    storage = request.app.state.storage
    check_limits(cfg, settings)
    if cfg.data.dataset is not None:
        if data is not None:
            raise InvalidRequest("data: a run on a dataset (data.dataset) takes no data file")
        return await _create_on_dataset(request, session, manager, cfg, init)
    if not isinstance(data, UploadFile):
        raise InvalidRequest("data: a multipart file part with the training text is needed")
    # before anything of the model's size exists: can this server close its rounds?
    runs_service.check_memory(
        cfg, settings=settings, val_bytes=int((data.size or 0) * cfg.data.val_fraction)
    )
    tmp_dir = Path(settings.data_dir) / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=tmp_dir, suffix=".txt") as tmp:
        limit = settings.max_data_bytes
        too_large = f"the data file is over the {limit}-byte limit"
        await asyncio.to_thread(_spool, data.file, tmp, limit=limit, too_large=too_large)
        if manager.id is not None:  # held until the run's rows commit
            data_bytes = Path(tmp.name).stat().st_size
            await accounts.check_run(session, settings, manager.id, data_bytes=data_bytes)
            await accounts.hold_runs(session, settings, manager.id)
        return await service.create(
            session=session,
            storage=storage,
            settings=settings,
            cfg=cfg,
            data_file=Path(tmp.name),
            data_name=check_text(
                Path(data.filename or "data.txt").name, what="data (file name)", max_length=255
            ),
            init_file=init,
            owner_id=manager.id,
        )


async def _create_on_dataset(
    request: Request, session: SessionDep, manager: Manager, cfg: RunConfig, init: Path | None
) -> Run:
    settings, storage = request.app.state.settings, request.app.state.storage
    plan = await runs_service.plan_on_dataset(
        session=session, storage=storage, settings=settings, cfg=cfg
    )
    if manager.id is not None:
        data_bytes = sum(s.nbytes for s in plan.manifest.shards)
        params = parameter_count(plan.cfg.model)
        await accounts.check_run(
            session, settings, manager.id, params=params, data_bytes=data_bytes
        )
    # claim, compute, publish: no pooled connection waits while version 0 is written
    await session.commit()
    if manager.id is not None:  # held until the run's rows commit
        await accounts.hold_runs(session, settings, manager.id)
    return await service.create_on_dataset(
        session=session, storage=storage, plan=plan, init_file=init, owner_id=manager.id
    )


def _parse_config(raw: str) -> RunConfig:
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as err:  # also: huge integers, deep nesting
        raise InvalidConfig(f"config: not valid JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise InvalidConfig("config: must be a JSON object")
    try:
        return parse_config(parsed)
    except ConfigError as err:
        raise InvalidConfig(str(err)) from None


@router.get("/{run_id}/coverage")
async def run_coverage(run_id: RunId, session: SessionDep) -> Coverage:
    """What the run has trained on: tokens and epochs; for a dataset run, its units (a
    lease's tokens of one shard) handed out and covered, and per shard."""
    run = await runs_service.get(session=session, run_id=run_id)
    return await service.run_coverage(session, run)


@router.get("")
async def list_runs(request: Request, session: SessionDep, owner: OwnerFilter = None) -> RunList:
    """Every run, newest first; ``owner``: only the runs that account owns."""
    settings, now = request.app.state.settings, datetime.now(UTC)
    runs = await runs_service.list_all(session=session, owner_id=owner)
    return RunList(
        runs=[await service.view(session=session, settings=settings, run=r, now=now) for r in runs]
    )


@router.get("/{run_id}")
async def get_run(run_id: RunId, request: Request, session: SessionDep) -> RunOut:
    run = await runs_service.get(session=session, run_id=run_id)
    return await service.view(
        session=session, settings=request.app.state.settings, run=run, now=datetime.now(UTC)
    )


@router.get("/{run_id}/storage")
async def storage_usage(run_id: RunId, request: Request, session: SessionDep) -> StorageUsage:
    """What the run holds in the store now, by kind (objects and bytes, from a listing of
    its prefix), its retention policy, and how many versions and contribution blobs that
    policy has deleted so far (their rows stay)."""
    run = await runs_service.get(session=session, run_id=run_id)
    policy = runs_service.run_config(run).retention
    counted = await retention.counts(session, run_id)
    settings = request.app.state.settings
    listed_at, kinds = await usage.listed(
        request.app.state.storage, run_id, max_age_s=settings.storage_usage_max_age_s
    )
    total = KindUsage(
        objects=sum(k.objects for k in kinds.values()), bytes=sum(k.bytes for k in kinds.values())
    )
    return StorageUsage(
        run_id=run_id,
        listed_at=listed_at,
        kinds=kinds,
        total=total,
        retention=policy.model_dump(),
        **counted,
    )


async def _transition(run_id: RunId, action: str, request: Request, session: SessionDep) -> RunOut:
    now = datetime.now(UTC)
    run = await service.transition(session=session, run_id=run_id, action=action, now=now)
    return await service.view(
        session=session, settings=request.app.state.settings, run=run, now=now
    )


@router.post("/{run_id}/pause")
async def pause(run_id: RunId, request: Request, session: SessionDep, _: RunManagerAuth) -> RunOut:
    """No new leases; the open round stops closing until resumed."""
    return await _transition(run_id, "pause", request, session)


@router.post("/{run_id}/resume")
async def resume(run_id: RunId, request: Request, session: SessionDep, _: RunManagerAuth) -> RunOut:
    """Back to active; the open round gets a fresh deadline."""
    return await _transition(run_id, "resume", request, session)


@router.post("/{run_id}/cancel")
async def cancel(run_id: RunId, request: Request, session: SessionDep, _: RunManagerAuth) -> RunOut:
    """Stop the run for good; its checkpoints stay downloadable."""
    return await _transition(run_id, "cancel", request, session)


# ---------------------------------------------------------------- bans from one run


def _ban_out(
    ban: RunBan, name: str, *, excluded: int | None = None, released: int | None = None
) -> RunBanOut:
    return RunBanOut(
        run_id=ban.run_id,
        contributor_id=ban.contributor_id,
        contributor_name=name,
        reason=ban.reason,
        banned_by=ban.banned_by,
        banned_at=ban.banned_at,
        excluded=excluded,
        released=released,
    )


@router.get("/{run_id}/bans")
async def list_run_bans(run_id: RunId, session: SessionDep, _: RunManagerAuth) -> RunBanList:
    """Who is banned from the run, newest first, with reasons (its owner or the admin)."""
    rows = await bans.run_bans(session, run_id)
    return RunBanList(run_id=run_id, bans=[_ban_out(ban, name) for ban, name in rows])


@router.post("/{run_id}/bans")
async def ban_from_run(
    run_id: RunId, body: RunBanIn, session: SessionDep, manager: RunManagerAuth
) -> RunBanOut:
    """Ban a contributor from this run (its owner or the admin): its joins and uploads here
    are refused with 403 ``banned_from_run`` and the reason, its work in the run's rounds
    not yet closed is left out (no credit), its leases here released. The rest of the hub
    still takes it (a hub-wide ban is the admin's: ``POST /contributors/{id}/ban``)."""
    account = await session.get(Contributor, body.contributor_id)
    if account is None:
        raise NotFound(f"no contributor {body.contributor_id!r}")
    ban, excluded, released = await bans.ban_from_run(
        session=session,
        run_id=run_id,
        contributor_id=account.id,
        reason=check_text(body.reason, what="reason", max_length=500),
        by=manager.who,
        now=datetime.now(UTC),
    )
    return _ban_out(ban, account.name, excluded=excluded, released=released)


@router.delete("/{run_id}/bans/{contributor_id}", status_code=204)
async def lift_run_ban(
    run_id: RunId, contributor_id: ContributorId, session: SessionDep, _: RunManagerAuth
) -> None:
    """Lift a ban from this run (its owner or the admin); 404 when there is none. Work it
    left out stays left out."""
    if not await bans.lift_run_ban(session=session, run_id=run_id, contributor_id=contributor_id):
        raise NotFound(f"{contributor_id!r} is not banned from run {run_id}")
