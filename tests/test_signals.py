"""server.signals: what SIGINT and SIGTERM do in each phase of ``diloco serve``, with real
signals raised in this (main) thread. test_serve_stop.py checks the whole on real servers."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from server.signals import Stopped, StopSignals


@pytest.fixture
def stops() -> Iterator[StopSignals]:
    handlers = StopSignals()
    try:
        yield handlers
    finally:
        handlers.restore()


def test_a_signal_during_start_up_stops_it_at_once(stops: StopSignals):
    with pytest.raises(Stopped) as stopped:
        signal.raise_signal(signal.SIGTERM)

    assert stopped.value.signum == signal.SIGTERM
    assert stops.received == signal.SIGTERM


def test_a_signal_while_deferred_waits_for_the_end_of_the_block(stops: StopSignals):
    finished = False

    with pytest.raises(Stopped) as stopped, stops.deferred():
        signal.raise_signal(signal.SIGINT)
        finished = True  # e.g. the embedded Postgres is started and its handle kept

    assert finished and stopped.value.signum == signal.SIGINT


def test_a_deferred_block_without_a_signal_goes_on(stops: StopSignals):
    with stops.deferred():
        pass

    assert stops.received is None


def test_a_signal_before_uvicorn_takes_over_tells_the_server_to_exit(stops: StopSignals):
    server = SimpleNamespace(should_exit=False)
    stops.serving(server)

    signal.raise_signal(signal.SIGTERM)  # no exception: uvicorn's loop sees the flag

    assert server.should_exit is True
    assert stops.received == signal.SIGTERM


def test_signals_during_the_cleanup_are_recorded_and_the_first_one_counts(stops: StopSignals):
    stops.serving(SimpleNamespace(should_exit=False))
    signal.raise_signal(signal.SIGINT)  # the one uvicorn hands back after its shutdown
    stops.stopping()

    signal.raise_signal(signal.SIGTERM)  # an impatient second signal: cleanup goes on

    assert stops.received == signal.SIGINT


def test_restore_puts_back_the_handlers_found_at_the_start():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stops = StopSignals()
    installed = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    stops.restore()

    assert installed != before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
