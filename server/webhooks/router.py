"""The routes of webhooks: a run's (its owner or the admin) and the hub's (the admin: every
run's events). The URL is checked when set (``addresses``): a bad one is 422 naming why."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Request
from sqlalchemy import func, select
from sqlalchemy.sql.elements import ColumnElement

from server.auth import AdminAuth
from server.db import SessionDep
from server.http.errors import InvalidRequest, NotFound
from server.http.inputs import RunId
from server.runs.access import RunManagerAuth
from server.webhooks import addresses
from server.webhooks.models import Webhook, WebhookDelivery
from server.webhooks.schemas import LastDelivery, WebhookIn, WebhookList, WebhookOut

API = "/api/v1"
router = APIRouter(prefix=API, tags=["webhooks"])

MAX_PER_RUN = 10  # a run's webhooks (and the hub's), each an event's worth of POSTs
WebhookId = Annotated[str, Path(pattern=r"^whk_[0-9a-f]{16}$", description="whk_<16 hex>")]


def _scope(run_id: str | None) -> ColumnElement[bool]:
    """The webhooks of run ``run_id``, or the hub's (None)."""
    return Webhook.run_id == run_id if run_id is not None else Webhook.run_id.is_(None)


async def _create(
    session: SessionDep, request: Request, body: WebhookIn, run_id: str | None, by: str
) -> WebhookOut:
    settings = request.app.state.settings
    try:
        await addresses.resolve(
            addresses.parse(body.url), addresses.networks(settings.webhook_allow_networks)
        )
    except addresses.UnsafeAddress as err:
        raise InvalidRequest(f"url: {err}") from None
    held = await session.scalar(select(func.count(Webhook.id)).where(_scope(run_id)))
    if (held or 0) >= MAX_PER_RUN:
        raise InvalidRequest(f"url: at most {MAX_PER_RUN} webhooks here; delete one first")
    hook = Webhook(
        id=f"whk_{secrets.token_hex(8)}",
        run_id=run_id,
        url=body.url,
        format=body.format,
        events=body.events,
        secret=secrets.token_hex(32),
        eval_rise=body.eval_rise,
        created_by=by,
        created_at=datetime.now(UTC),
    )
    session.add(hook)
    await session.flush()
    return _out(hook, None).model_copy(update={"secret": hook.secret})


def _out(hook: Webhook, last: WebhookDelivery | None) -> WebhookOut:
    return WebhookOut(
        id=hook.id,
        run_id=hook.run_id,
        url=hook.url,
        format=hook.format,
        events=list(hook.events),
        eval_rise=hook.eval_rise,
        created_by=hook.created_by,
        created_at=hook.created_at,
        last=None
        if last is None
        else LastDelivery(
            id=last.id,
            event=last.event,
            attempts=last.attempts,
            status=last.status,
            delivered_at=last.delivered_at,
            next_at=last.next_at,
            last_error=last.last_error,
        ),
    )


async def _list(session: SessionDep, run_id: str | None) -> WebhookList:
    hooks = list(
        await session.scalars(select(Webhook).where(_scope(run_id)).order_by(Webhook.created_at))
    )
    out = []
    for hook in hooks:
        last = await session.scalar(
            select(WebhookDelivery)
            .where(WebhookDelivery.webhook_id == hook.id)
            .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id)
            .limit(1)
        )
        out.append(_out(hook, last))
    return WebhookList(webhooks=out)


async def _delete(session: SessionDep, run_id: str | None, webhook_id: str) -> None:
    hook = await session.get(Webhook, webhook_id)
    if hook is None or hook.run_id != run_id:
        raise NotFound(f"no webhook {webhook_id!r} here")
    await session.delete(hook)


@router.post("/runs/{run_id}/webhooks", status_code=201)
async def add_run_webhook(
    run_id: RunId, body: WebhookIn, request: Request, session: SessionDep, who: RunManagerAuth
) -> WebhookOut:
    """A URL that gets this run's events, signed with the ``secret`` in this answer (shown
    only here). Its owner or the admin; a URL that is not http(s), holds credentials, or
    reaches a loopback, private, link-local or metadata address is 422."""
    return await _create(session, request, body, run_id, who.who)


@router.get("/runs/{run_id}/webhooks")
async def run_webhooks(run_id: RunId, session: SessionDep, _: RunManagerAuth) -> WebhookList:
    """The run's webhooks, each with its latest delivery (its owner or the admin)."""
    return await _list(session, run_id)


@router.delete("/runs/{run_id}/webhooks/{webhook_id}", status_code=204)
async def delete_run_webhook(
    run_id: RunId, webhook_id: WebhookId, session: SessionDep, _: RunManagerAuth
) -> None:
    """Stop a webhook; what it had queued is dropped."""
    await _delete(session, run_id, webhook_id)


@router.post("/webhooks", status_code=201)
async def add_hub_webhook(
    body: WebhookIn, request: Request, session: SessionDep, _: AdminAuth
) -> WebhookOut:
    """A URL that gets every run's events (admin token)."""
    return await _create(session, request, body, None, "admin")


@router.get("/webhooks")
async def hub_webhooks(session: SessionDep, _: AdminAuth) -> WebhookList:
    return await _list(session, None)


@router.delete("/webhooks/{webhook_id}", status_code=204)
async def delete_hub_webhook(webhook_id: WebhookId, session: SessionDep, _: AdminAuth) -> None:
    await _delete(session, None, webhook_id)
