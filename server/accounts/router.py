"""The routes of accounts: roles and quotas (admin token), the accounts list (admin), and
``GET /api/v1/whoami`` (any token: what it may do)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from server.accounts import service
from server.accounts.schemas import AccountList, Quota, QuotaIn, Role, RoleIn, Roles, WhoAmI
from server.auth import AdminAuth, is_admin, read_contributor
from server.db import SessionDep
from server.http.errors import Forbidden
from server.http.inputs import ContributorId

API = "/api/v1"
router = APIRouter(prefix=f"{API}/contributors", tags=["accounts"])
hub_router = APIRouter(prefix=API, tags=["accounts"])

ROLE_PATH = Path(pattern=r"^(verifier|owner)$", description="a role: verifier or owner")


@router.post("/{contributor_id}/roles")
async def grant_role(
    contributor_id: ContributorId, body: RoleIn, _: AdminAuth, session: SessionDep
) -> Roles:
    """Give an account a role (admin token): ``verifier`` claims and decides audits;
    ``owner`` creates runs and manages its own."""
    return await service.grant(session, contributor_id, body.role, datetime.now(UTC))


@router.delete("/{contributor_id}/roles/{role}")
async def revoke_role(
    contributor_id: ContributorId,
    role: Annotated[str, ROLE_PATH],
    _: AdminAuth,
    session: SessionDep,
) -> Roles:
    """Take a role back (admin token); revoking one it does not hold changes nothing. A
    revoked owner's runs stay (the admin manages them); the owner gets 403 on them."""
    return await service.revoke(session, contributor_id, role)


@router.get("/{contributor_id}/quota")
async def get_quota(contributor_id: ContributorId, request: Request, session: SessionDep) -> Quota:
    """A run owner's quota (admin token, or the owner's own)."""
    if not is_admin(request):
        me = await read_contributor(request)
        if me.id != contributor_id:
            raise Forbidden("a quota is shown to its owner and to the hub's admin only")
    await service.account(session, contributor_id)
    return await service.quota(session, request.app.state.settings, contributor_id)


@router.put("/{contributor_id}/quota")
async def set_quota(
    contributor_id: ContributorId,
    body: QuotaIn,
    request: Request,
    _: AdminAuth,
    session: SessionDep,
) -> Quota:
    """Set a run owner's quota (admin token): runs not ended at once, a run's model
    parameters, a run's data bytes; null takes the hub's default. Runs already created
    stay; the next creation is checked against it."""
    settings = request.app.state.settings
    return await service.set_quota(session, settings, contributor_id, body, datetime.now(UTC))


@hub_router.get("/accounts")
async def list_accounts(
    _: AdminAuth,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> AccountList:
    """Every account, newest first, with its roles, runs owned, ban and quarantine (admin)."""
    total, rows = await service.accounts(session, limit=limit, offset=offset)
    return AccountList(total=total, accounts=rows)


@hub_router.get("/whoami")
async def whoami(request: Request, session: SessionDep) -> WhoAmI:
    """What the token sent may do: the admin's, or a contributor's roles (and a run owner's
    quota). Does not count as activity. 401 for a token the hub does not know."""
    if is_admin(request):
        return WhoAmI(
            kind="admin", id=None, name="admin", roles=["admin"], can_create_runs=True, quota=None
        )
    me = await read_contributor(request)
    roles = (await service.roles_of(session, me.id)).roles
    owner = Role.OWNER in roles
    settings = request.app.state.settings
    return WhoAmI(
        kind="contributor",
        id=me.id,
        name=me.name,
        roles=roles,
        can_create_runs=owner,
        quota=await service.quota(session, settings, me.id) if owner else None,
    )
