"""Bearer tokens: the admin token for run management, contributor tokens for volunteers.

Tokens are 256-bit random strings; only their sha256 is stored (a leaked database holds no
usable token). Comparisons of the admin token are constant-time.

A contributor's actions (``ContributorAuth``: upload, lease release, profile update) move
its ``last_seen_at`` in the same statement that finds it: one ``UPDATE ... RETURNING`` in
its own short transaction, committed at once. So the time counts even when the action
itself is refused, and no row lock is held through a long upload. Join and heartbeat, the
frequent ones, do the same inside their own single facts statement
(``server.rounds.leases``). Reads of one's own profile (``ContributorReadAuth``) leave it
alone.

A banned contributor (``banned_at`` set by an admin) is refused on every path with ``403
banned`` and the admin's reason, from the moment the ban commits: each request reads the
row afresh, nothing is cached.

Who manages runs (``Manager``): the admin, every run; an account the admin made a run
``owner`` (``server.accounts``), the runs it created. Roles are read afresh on each request
too: a revoked owner gets 403 on its own runs from the moment the revocation commits.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server.contributors.models import Contributor, ContributorRole
from server.http.errors import (
    Banned,
    BannedFromRun,
    Forbidden,
    Unauthorized,
)


def new_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(request: Request) -> str:
    return bearer_of(request.headers.get("authorization", ""))


def bearer_of(header: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or ``401 unauthorized``."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send your token as 'Authorization: Bearer <token>'")
    return token.strip()


def require_admin(request: Request) -> None:
    if not is_admin(request):
        if bearer_token(request).startswith("ctr_"):
            raise Forbidden("this needs the admin token, not a contributor token")
        raise Unauthorized("the admin token is wrong; it is in <data-dir>/admin-token")


UNKNOWN_TOKEN = "unknown contributor token; register with POST /api/v1/contributors"


def banned(reason: str | None) -> Banned:
    """The answer to a banned contributor's request."""
    return Banned(f"this contributor is banned by the hub's admin: {reason or 'no reason given'}")


def banned_from_run(run_id: str, reason: str) -> BannedFromRun:
    """The answer to a contributor banned from one run, on that run."""
    return BannedFromRun(f"you are banned from run {run_id} by its owner: {reason}")


async def _find_contributor(request: Request, *, touch: bool) -> Contributor:
    token_hash = hash_token(bearer_token(request))
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with sessions() as session, session.begin():
        if touch:
            found = await session.scalar(
                update(Contributor)
                .where(Contributor.token_hash == token_hash)
                .values(last_seen_at=datetime.now(UTC))
                .returning(Contributor)
            )
        else:
            found = await session.scalar(
                select(Contributor).where(Contributor.token_hash == token_hash)
            )
    if found is None:
        raise Unauthorized(UNKNOWN_TOKEN)
    if found.banned_at is not None:
        raise banned(found.ban_reason)
    return found


async def require_contributor(request: Request) -> Contributor:
    """The contributor behind the token, marked as seen now."""
    return await _find_contributor(request, touch=True)


async def read_contributor(request: Request) -> Contributor:
    """The contributor behind the token, without marking it as seen."""
    return await _find_contributor(request, touch=False)


def is_admin(request: Request) -> bool:
    """Whether the request carries the admin token (constant-time)."""
    token = bearer_token(request)
    expected: str = request.app.state.admin_token
    return hmac.compare_digest(hash_token(token), hash_token(expected))


async def has_role(request: Request, contributor_id: str, role: str) -> bool:
    """Whether the admin granted the account ``role`` (read afresh)."""
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with sessions() as session:
        found = await session.scalar(
            select(ContributorRole.role).where(
                ContributorRole.contributor_id == contributor_id, ContributorRole.role == role
            )
        )
    return found is not None


async def require_verifier(request: Request) -> str:
    """The admin token, or a contributor the admin made a ``verifier``: who it is ("admin"
    or the contributor's id)."""
    if is_admin(request):
        return "admin"
    contributor = await read_contributor(request)
    if not await has_role(request, contributor.id, "verifier"):
        raise Forbidden(
            "this needs the admin token or a verifier's (the admin grants the role: "
            f"POST /api/v1/contributors/{contributor.id}/roles)"
        )
    return contributor.id


@dataclass(frozen=True)
class Manager:
    """Who manages runs: the admin (``id`` None) or a run owner (its contributor id)."""

    id: str | None
    name: str

    @property
    def admin(self) -> bool:
        return self.id is None

    @property
    def who(self) -> str:
        """As the hub records who did something: "admin" or the owner's id."""
        return self.id or "admin"


ADMIN = Manager(None, "admin")


async def require_manager(request: Request) -> Manager:
    """The admin, or a contributor the admin made a run ``owner``."""
    if is_admin(request):
        return ADMIN
    contributor = await read_contributor(request)
    if not await has_role(request, contributor.id, "owner"):
        raise Forbidden(
            "this needs the admin token or a run owner's (the admin grants the role: "
            f'POST /api/v1/contributors/{contributor.id}/roles with {{"role": "owner"}})'
        )
    return Manager(contributor.id, contributor.name)


AdminAuth = Annotated[None, Depends(require_admin)]
VerifierAuth = Annotated[str, Depends(require_verifier)]
ManagerAuth = Annotated[Manager, Depends(require_manager)]
ContributorAuth = Annotated[Contributor, Depends(require_contributor)]
ContributorReadAuth = Annotated[Contributor, Depends(read_contributor)]
