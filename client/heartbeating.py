"""The volunteer's heartbeats while it holds a lease, at the interval the server advises.

The lease names the first interval; each heartbeat's answer names the one to follow from
then on (``heartbeat_interval_s``: the run's own, or longer when the hub is busy).
``diloco.protocol.heartbeats.next_heartbeat`` says when the next one goes: one interval
later, or, when the advice changed, at a random point of the new interval, so that the
volunteers who heard the change together do not heartbeat together. Each answer is fed to
the volunteer's reactions (``diloco.protocol.volunteer``): train on, or stop training for
the lease (``lost``), or stop altogether (``fatal``).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable

from client.api import ApiError, RetryPolicy, ServerAPI, ServerUnreachable
from client.lease import Lease
from client.progress import Reporter
from client.worker_options import Reactions
from diloco.protocol.heartbeats import advised, next_heartbeat
from diloco.protocol.volunteer import Do, Request, heartbeat_every

Latest = Callable[[], tuple[int | None, float | None]]  # the last step and loss trained


class Heartbeats:
    """One lease's heartbeats; ``sleep`` and ``draw`` (uniform in [0, 1)) are the loop's
    clock and dice."""

    def __init__(
        self,
        api: ServerAPI,
        react: Reactions,
        say: Reporter,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.api, self.react, self.say = api, react, say
        self.sleep, self.draw = sleep, draw
        self.fatal: ApiError | None = None  # an answer that stops the volunteer (banned...)
        self.lost_why = ""  # why the heartbeats gave the lease up

    async def run(self, lease: Lease, latest: Latest, lost: threading.Event) -> None:
        """Until cancelled, or until an answer sets ``lost`` (abandon the lease, or stop for
        ``fatal``)."""
        interval = wait = heartbeat_every(lease.heartbeat_interval_s)
        warned: set[str] = set()  # one line per kind of answer per lease
        while True:
            await self.sleep(wait)
            quick = RetryPolicy(attempts=3, base_delay_s=0.5, max_delay_s=2.0, total_s=interval)
            step, loss = latest()
            advice = None
            try:
                answer = await self.api.heartbeat(
                    lease.run_id, lease.round, lease.lease_id, step, loss, retry=quick
                )
                advice = advised(answer)
            except ApiError as err:
                reaction = self.react.to(Request.HEARTBEAT, err)
                if reaction.do in (Do.ABANDON, Do.FATAL):  # stop training now
                    self.lost_why = reaction.why
                    if reaction.do is Do.FATAL:  # the worker raises it
                        self.fatal = err
                    lost.set()
                    return
                if err.code not in warned:
                    warned.add(err.code)
                    if reaction.do is Do.CARRY_ON:  # merged late
                        self.say.info(reaction.why)
                    else:
                        self.say.warn(f"heartbeat for round {lease.round}: {err}; still training")
            except ServerUnreachable as err:
                if "unreachable" not in warned:
                    warned.add("unreachable")
                    self.say.warn(f"heartbeat for round {lease.round}: {err}; still training")
            interval, wait = next_heartbeat(interval, advice, self.draw())
