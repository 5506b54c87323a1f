"""Sending the queued deliveries, in the background of a worker process.

Each pass takes the due deliveries (``FOR UPDATE SKIP LOCKED``: replicas share the queue
without sending one twice) and holds them by moving ``next_at`` a send's time ahead, then
sends them at once, each with its own timeout, outside any transaction. A 2xx ends a
delivery; anything else (an error status, a timeout, a refused address) is retried after
``retry_base_s · 2^(attempt-1)`` (at most an hour) until ``max_attempts``. A receiver that
hangs costs its own delivery's timeout, never a close nor the other deliveries.

The signature: ``X-DiLoCo-Signature: t=<unix seconds>,sha256=<hex>``, the HMAC-SHA256
with the webhook's secret of ``<t>.<the body's bytes>``; a receiver recomputes it and
refuses an old ``t`` (a replay).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import aiohttp
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server.settings import Settings
from server.webhooks import addresses
from server.webhooks.models import Webhook, WebhookDelivery

log = logging.getLogger("diloco.server.webhooks")

BATCH = 32  # deliveries taken per pass
MAX_BACKOFF_S = 3600.0


def signature(secret: str, timestamp: int, payload: bytes) -> str:
    """The ``X-DiLoCo-Signature`` header's value for ``payload`` sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256)
    return f"t={timestamp},sha256={mac.hexdigest()}"


@dataclass(frozen=True)
class Outcome:
    status: int | None  # the receiver's answer (None: none came)
    error: str | None  # None: delivered (a 2xx)


async def send(
    url: str,
    payload: bytes,
    headers: dict[str, str],
    *,
    allowed: tuple[addresses.Network, ...],
    timeout_s: float,
) -> Outcome:
    """POST ``payload`` to ``url`` once: its address checked now, the connection pinned to
    what was checked, no redirect followed."""
    try:
        target = addresses.parse(url)
        found = await addresses.resolve(target, allowed)
    except addresses.UnsafeAddress as err:
        return Outcome(None, f"refused: {err}")
    connector = aiohttp.TCPConnector(
        resolver=addresses.PinnedResolver(target.host, found), use_dns_cache=False
    )
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as http,
            http.post(url, data=payload, headers=headers, allow_redirects=False) as resp,
        ):
            await resp.read()
            if 200 <= resp.status < 300:
                return Outcome(resp.status, None)
            return Outcome(resp.status, f"answered {resp.status}")
    except TimeoutError:
        return Outcome(None, f"no answer within {timeout_s:g} s")
    except aiohttp.ClientError as err:
        return Outcome(None, f"{type(err).__name__}: {err}"[:500])


class Deliverer:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], settings: Settings) -> None:
        self.sessions, self.settings = sessions, settings
        self.allowed = addresses.networks(settings.webhook_allow_networks)
        self._sending: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                try:
                    for delivery, hook in await self.take_due():  # each on its own: a
                        task = asyncio.create_task(self._one(delivery, hook))  # slow one
                        self._sending.add(task)  # holds up no other
                        task.add_done_callback(self._sending.discard)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("webhook delivery pass failed; trying again")
                await asyncio.sleep(self.settings.webhook_poll_s)
        finally:
            for task in list(self._sending):
                task.cancel()

    async def take_due(self) -> list[tuple[WebhookDelivery, Webhook]]:
        """The deliveries due now, each held (``next_at`` moved a send's time ahead)."""
        now = datetime.now(UTC)
        hold = timedelta(seconds=self.settings.webhook_timeout_s + 30)
        async with self.sessions() as session, session.begin():
            rows = (
                await session.execute(
                    select(WebhookDelivery, Webhook)
                    .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
                    .where(WebhookDelivery.next_at <= now)
                    .order_by(WebhookDelivery.next_at)
                    .limit(BATCH)
                    .with_for_update(of=WebhookDelivery, skip_locked=True)
                )
            ).all()
            for delivery, _ in rows:
                delivery.next_at = now + hold  # ours while it is sent
        return list(rows)

    async def _one(self, delivery: WebhookDelivery, hook: Webhook) -> None:
        payload = json.dumps(delivery.body, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "DiLoCo-Hub-Webhook",
            "X-DiLoCo-Event": delivery.event,
            "X-DiLoCo-Delivery": delivery.id,
            "X-DiLoCo-Signature": signature(hook.secret, int(time.time()), payload),
        }
        outcome = await send(
            hook.url,
            payload,
            headers,
            allowed=self.allowed,
            timeout_s=self.settings.webhook_timeout_s,
        )
        attempts = delivery.attempts + 1
        now = datetime.now(UTC)
        if outcome.error is None:
            done: dict[str, object] = {"delivered_at": now, "next_at": None}
        elif attempts >= self.settings.webhook_max_attempts:
            done = {"next_at": None}
            log.warning("webhook %s: %s given up: %s", hook.id, delivery.id, outcome.error)
        else:
            wait = min(self.settings.webhook_retry_base_s * 2 ** (attempts - 1), MAX_BACKOFF_S)
            done = {"next_at": now + timedelta(seconds=wait)}
        async with self.sessions() as session, session.begin():
            await session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == delivery.id)
                .values(attempts=attempts, status=outcome.status, last_error=outcome.error, **done)
            )
