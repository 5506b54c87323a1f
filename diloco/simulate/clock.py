"""Simulated time for ``diloco simulate --mode protocol``: actions scheduled at datetimes,
run in (time, scheduling order), so the same inputs give the same run and no wall clock
is ever read."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from datetime import UTC, datetime

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)  # the simulated clock starts here


class EventClock:
    def __init__(self, start: datetime) -> None:
        self.now = start
        self._queue: list[tuple[datetime, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties at one time run in the order scheduled

    def at(self, when: datetime, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._order), action))

    def run(self, *, until: datetime | None, stop: Callable[[], bool]) -> bool:
        """Run the actions in order until none is left or ``stop()`` says so; True if the
        next one was past ``until`` (the clock then reads ``until``)."""
        while self._queue and not stop():
            when, _, action = heapq.heappop(self._queue)
            if until is not None and when > until:
                self.now = until
                return True
            self.now = when
            action()
        return False
