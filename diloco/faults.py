"""Fault injection for crash tests: make a process fail or die at a named point.

Code calls ``faults.hit("close.write")`` after each stage it wants testable; a test arms
the injector (in the style of torchft's ``EventInjector``), either in process::

    faults = FaultInjector().fail_at("close.aggregate", times=2)

or in a child process through a setting (``DILOCO_FAULTS``), in the same words::

    close.aggregate=fail*2,close.write=die,volunteer.upload=die@2

``fail`` raises :class:`InjectedFault` (the caller's error handling runs), ``die`` sends the
process SIGKILL (nothing runs: a crash), ``stall`` sleeps ``STALL_S`` in the thread that hit
the point (a slow close, for a test to act while it computes: use it only at points hit
off the event loop, the close's compute stages; ``stall:S`` sleeps S seconds instead, e.g.
``volunteer.step=stall:0.5@3*1000``: a volunteer that slows down from its third step on).
``@n`` fires from the n-th hit of the point on
(counting from 1), ``*k`` fires k times (default once). An unarmed injector costs one dict
lookup per hit. Production processes never arm one.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

# Every point that code hits; arming another name is a typo, refused at once.
POINTS = frozenset(
    {
        "close.claim",  # a worker has claimed a closing round and read its inputs
        "close.aggregate",  # the contributions are summed (the pass: files not yet committed)
        "close.step",  # the outer step is applied (the same pass)
        "close.eval",  # the step is judged (evaluated on the judging sample when finite)
        # the version's delta is durable (fsynced, in the store), its parameters and outer
        # state written, not committed; not yet published
        "close.write",
        "close.publish",  # the transaction that publishes the version has committed
        # the closer committed the version's parameters and outer state; the row not yet
        # marked (server.rounds.full_files)
        "close.full",
        # a rebuild of a version's parameters and outer state ran and matched the published
        # sha256s; not yet committed
        "full.rebuild",
        "eval.version",  # a published version's eval loss is about to be measured
        "score.arrival",  # an arrived upload is about to be scored by the loss
        "fold.arrival",  # an arrived upload is about to be folded into its round's sum
        "volunteer.upload",  # a volunteer is about to upload its contribution
        "volunteer.step",  # a volunteer finished an inner step (in its training thread)
    }
)
_SPEC = re.compile(
    r"^(?P<point>[a-z.]+)=(?P<action>fail|die|stall)(?::(?P<seconds>\d+(?:\.\d+)?))?"
    r"(?:@(?P<at>\d+))?(?:\*(?P<times>\d+))?$"
)

Kind = Literal["fail", "die", "stall"]
STALL_S = 5.0  # how long a stall lasts


class InjectedFault(RuntimeError):
    """Raised at an armed ``fail`` point."""


@dataclass
class _Rule:
    kind: Kind
    at: int  # fire from this hit on (1-based)
    times: int  # fire this many times
    seconds: float = 0.0  # how long a stall sleeps


class FaultInjector:
    def __init__(self) -> None:
        self._rules: dict[str, _Rule] = {}
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()  # points are hit from worker threads too

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """An injector armed from ``point=action[@n][*k],...``; an empty spec arms nothing."""
        injector = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = _SPEC.match(part)
            if m is None:
                raise ValueError(f"fault {part!r}: expected point=fail|die|stall[:S][@n][*k]")
            if m["seconds"] is not None and m["action"] != "stall":
                raise ValueError(f"fault {part!r}: only a stall takes :SECONDS")
            at, times = int(m["at"] or 1), int(m["times"] or 1)
            seconds = STALL_S if m["seconds"] is None else float(m["seconds"])
            injector._arm(m["point"], m["action"], at=at, times=times, seconds=seconds)  # type: ignore[arg-type]
        return injector

    def fail_at(self, point: str, *, at: int = 1, times: int = 1) -> FaultInjector:
        return self._arm(point, "fail", at=at, times=times)

    def _arm(
        self, point: str, kind: Kind, *, at: int, times: int, seconds: float = STALL_S
    ) -> FaultInjector:
        if point not in POINTS:
            raise ValueError(f"fault point {point!r} is unknown; known: {sorted(POINTS)}")
        if at < 1 or times < 1:
            raise ValueError(f"fault {point}: @n and *k count from 1, got @{at} *{times}")
        if not (0.0 <= seconds <= 3600.0):
            raise ValueError(f"fault {point}: a stall lasts 0 to 3600 s, got {seconds}")
        self._rules[point] = _Rule(kind, at, times, seconds)
        return self

    def hit(self, point: str) -> None:
        """Passing ``point``: fail or die here if a test armed it for this hit."""
        if not self._rules:
            return
        with self._lock:
            rule = self._rules.get(point)
            if rule is None:
                return
            n = self._hits[point] = self._hits.get(point, 0) + 1
            fire = rule.at <= n < rule.at + rule.times
        if not fire:
            return
        if rule.kind == "stall":
            if n == rule.at:  # a stall may fire on every step: say so once
                print(f"fault injected: stalling at {point} (hit {n})", file=sys.stderr, flush=True)
            time.sleep(rule.seconds)
            return
        if rule.kind == "die":
            print(f"fault injected: dying at {point} (hit {n})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"fault injected at {point} (hit {n})")

    def hits(self, point: str) -> int:
        return self._hits.get(point, 0)
