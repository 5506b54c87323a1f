"""SIGINT and SIGTERM for ``diloco serve``, from its first line to its last.

uvicorn installs its own handlers while it serves; on the way out it restores the ones it
found and raises the signal again, so that the default action happens once it has shut
down. Python's default action for SIGTERM is to die on the spot, before any ``finally``:
the embedded Postgres was left running after every ``kill``. ``StopSignals`` installs the
handlers uvicorn finds, and they do what the phase of the process needs:

- starting (the database, migrations): the signal raises ``Stopped`` at once, so start-up
  unwinds through the caller's ``finally``; inside ``deferred()`` (starting the embedded
  Postgres, which must not be left running without its handle) it waits for the block end;
- serving: uvicorn's handlers run; a signal that comes before uvicorn has installed them
  tells the server to exit as soon as it has started; the one uvicorn raises again after
  its shutdown is recorded;
- stopping (the cleanup): recorded only, so that the cleanup runs to its end.

``received`` is the first stop signal, for the exit status (128 + its number).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Literal, Protocol

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A stop signal during start-up. A BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class _Exits(Protocol):
    should_exit: bool  # uvicorn.Server's flag: shut down at the next tick


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None
        self._phase: Literal["starting", "serving", "stopping"] = "starting"
        self._deferring = False
        self._server: _Exits | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._phase == "starting" and not self._deferring:
            raise Stopped(signum)
        if self._phase == "serving" and self._server is not None:
            self._server.should_exit = True

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a stop signal until the block ends, then stop (during start-up)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self.received is not None and self._phase == "starting":
            raise Stopped(self.received)

    def serving(self, server: _Exits) -> None:
        self._server, self._phase = server, "serving"

    def stopping(self) -> None:
        self._phase = "stopping"

    def restore(self) -> None:
        """Put back the handlers found at the start."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
