"""Who may manage a run: the hub's admin, or the run owner who created it (``owner_id``).
Built on ``server.auth.require_manager`` (the admin, or an account with the owner role)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server.auth import Manager, require_manager
from server.http.errors import NotRunOwner, RunNotFound
from server.http.inputs import RunId
from server.runs.models import Run


async def require_run_manager(run_id: RunId, request: Request) -> Manager:
    """The admin, or the owner of run ``run_id`` (404 for a run that does not exist, to
    anyone who may manage runs at all)."""
    manager = await require_manager(request)
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with sessions() as session:
        owner = await session.execute(select(Run.owner_id).where(Run.id == run_id))
        row = owner.one_or_none()
    if row is None:
        raise RunNotFound(f"no run {run_id!r}; GET /api/v1/runs lists the runs")
    if not manager.admin and row.owner_id != manager.id:
        raise NotRunOwner(
            f"run {run_id} is not yours to manage: only its owner and the hub's admin may"
        )
    return manager


RunManagerAuth = Annotated[Manager, Depends(require_run_manager)]
