"""The events a webhook can get, their bodies, and ``emit``: a delivery row per webhook
that wants the event, in the caller's transaction (it commits, or rolls back, with what
made the event happen)."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any, Literal, get_args

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.runs.models import Run
from server.webhooks.models import Webhook, WebhookDelivery

EventName = Literal[
    "run.completed", "run.cancelled", "round.stalled", "round.close_failing", "eval.rising"
]
# event -> what it says, with the run's name and the event's data filled in
EVENTS: dict[EventName, str] = {
    "run.completed": "run {run} completed: its last round ({round}) closed",
    "run.cancelled": "run {run} was cancelled",
    "round.stalled": "run {run}, round {round}: its deadline passed below quorum; {reason}",
    "round.close_failing": "run {run}, round {round}: {attempts} attempts to close it failed; "
    "the latest: {error}",
    "eval.rising": "run {run}, version {version}: eval loss {eval_loss:.4f} is {ratio:.2f}x "
    "the best so far ({best:.4f})",
}
assert set(EVENTS) == set(get_args(EventName))  # one list of events


def body(
    fmt: str, event: EventName, run: Run, data: dict[str, Any], at: datetime
) -> dict[str, Any]:
    """What is POSTed: our JSON (``json``), or a chat's incoming-webhook shape with the
    sentence (``slack``: ``text``; ``discord``: ``content``)."""
    sentence = "DiLoCo Hub: " + EVENTS[event].format(run=f"{run.name} ({run.id})", **data)
    if fmt == "slack":
        return {"text": sentence}
    if fmt == "discord":
        return {"content": sentence[:2000]}  # Discord's limit
    return {
        "event": event,
        "run_id": run.id,
        "run_name": run.name,
        "at": at.isoformat(),
        "summary": sentence,
        "data": data,
    }


async def emit(
    session: AsyncSession,
    *,
    run_id: str,
    event: EventName,
    data: dict[str, Any],
    now: datetime,
    ratio: float | None = None,
) -> int:
    """Queue ``event`` for every webhook of the run and of the hub that asks for it (for
    ``eval.rising``: whose bound ``ratio`` passes); how many deliveries were queued."""
    hooks = list(
        await session.scalars(
            select(Webhook).where(or_(Webhook.run_id == run_id, Webhook.run_id.is_(None)))
        )
    )
    wanted = [h for h in hooks if event in h.events and (ratio is None or ratio > h.eval_rise)]
    if not wanted:
        return 0
    run = await session.get_one(Run, run_id)
    for hook in wanted:
        session.add(
            WebhookDelivery(
                id=f"dlv_{secrets.token_hex(8)}",
                webhook_id=hook.id,
                event=event,
                body=body(hook.format, event, run, data, now),
                attempts=0,
                next_at=now,
                created_at=now,
            )
        )
    return len(wanted)
