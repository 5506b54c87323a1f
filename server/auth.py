"""Bearer tokens: the admin token for run management, contributor tokens for volunteers.

Tokens are 256-bit random strings; only their sha256 is stored (a leaked database holds no
usable token). Comparisons of the admin token are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select

from server.contributors.models import Contributor
from server.db import SessionDep
from server.errors import Forbidden, Unauthorized


def new_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send your token as 'Authorization: Bearer <token>'")
    return token.strip()


def require_admin(request: Request) -> None:
    token = bearer_token(request)
    expected: str = request.app.state.admin_token
    if not hmac.compare_digest(hash_token(token), hash_token(expected)):
        if token.startswith("ctr_"):
            raise Forbidden("this needs the admin token, not a contributor token")
        raise Unauthorized("the admin token is wrong; it is in <data-dir>/admin-token")


async def require_contributor(request: Request, session: SessionDep) -> Contributor:
    token = bearer_token(request)
    found = await session.scalar(
        select(Contributor).where(Contributor.token_hash == hash_token(token))
    )
    if found is None:
        raise Unauthorized("unknown contributor token; register with POST /api/v1/contributors")
    return found


AdminAuth = Annotated[None, Depends(require_admin)]
ContributorAuth = Annotated[Contributor, Depends(require_contributor)]
