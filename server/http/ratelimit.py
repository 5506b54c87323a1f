"""Rate limits per client address on what a stranger can do cheaply and often: register,
run the speed test, upload (``limits``: moving windows, counted in this process's memory).

Each limit is a setting in ``limits``' notation (``server.settings``: ``20/hour``, or several
as ``5/minute;100/day``; empty: no limit). A request over one is answered ``429
rate_limited`` with ``Retry-After`` (whole seconds, at least 1: when the window lets the
next one in) before anything else is done: before the token is looked up, before a byte of
the body is read.

The address is the TCP peer's (``request.client.host``). uvicorn replaces it with the
``X-Forwarded-For`` address only when the peer is a proxy it trusts (its
``--forwarded-allow-ips``, ``FORWARDED_ALLOW_IPS``; 127.0.0.1 by default). Several servers
behind one load balancer count separately: each holds its own counters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum

from fastapi import Depends, Request, params
from limits import RateLimitItem, parse_many
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from server.http.errors import RateLimited
from server.settings import Settings


class Action(StrEnum):
    """What is counted; each has its own limit (``Settings.rate_<action>``)."""

    REGISTER = "register"
    SPEEDTEST = "speedtest"
    UPLOAD = "upload"


class RateLimits:
    """One process's counters, one set of limits per action."""

    def __init__(self, settings: Settings) -> None:
        self._items: dict[Action, list[RateLimitItem]] = {
            action: parse_many(rule) if (rule := settings.rate_limit(action)) else []
            for action in Action
        }
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def check(self, action: Action, address: str) -> None:
        """Count one request of ``action`` from ``address``, or raise ``RateLimited``
        (without counting it) when any of the action's limits is spent."""
        items = self._items[action]
        for item in items:
            if not self._limiter.test(item, action, address):
                raise self._refusal(action, item, address)
        for item in items:  # no await since the test: every one has room
            self._limiter.hit(item, action, address)

    def _refusal(self, action: Action, item: RateLimitItem, address: str) -> RateLimited:
        reset = self._limiter.get_window_stats(item, action, address).reset_time
        wait = max(1, math.ceil(reset - time.time()))
        return RateLimited(
            f"too many {action} requests from {address}: at most {item.amount} per "
            f"{item.get_expiry()} s; try again in {wait} s",
            retry_after_s=wait,
        )


def limit(action: Action) -> Callable[[Request], Awaitable[None]]:
    """A route dependency that counts the request against ``action``'s limit."""

    async def check(request: Request) -> None:
        limits: RateLimits = request.app.state.rate_limits
        limits.check(action, request.client.host if request.client else "unknown")

    return check


def depends(action: Action) -> list[params.Depends]:
    """``dependencies=`` for a route decorator: they run before any other dependency."""
    return [Depends(limit(action))]
