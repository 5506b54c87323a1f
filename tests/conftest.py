"""Shared fixtures: a small generated corpus and a tiny run config that trains in seconds."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.config import RunConfig, parse_config

WORDS = (
    "the a king queen sword crown river castle night morning speaks walks dreams "
    "of with under over and but my thy thou art noble gentle sweet bitter"
).split()


def make_corpus(n_bytes: int, seed: int = 0) -> str:
    """Deterministic pseudo-English with enough structure for a model to learn from."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize() + ".\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:n_bytes]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(make_corpus(40_000))
    return path


def tiny_config(data_path: Path, **sections: dict) -> RunConfig:
    raw: dict = {
        "name": "tiny",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"path": str(data_path), "val_fraction": 0.1},
        "inner": {"steps": 2, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2},
        "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
        "rounds": {"max_rounds": 3, "quorum": 1},
        "compression": {"kind": "int8", "block_size": 256},
    }
    for name, values in sections.items():
        raw[name].update(values)
    return parse_config(raw)


# ---------------------------------------------------------------- real servers and databases


@pytest.fixture(scope="session")
def pg_admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.support.pg import drop_templates, server_url

    url = server_url(tmp_path_factory.mktemp("embedded-pg"))
    yield url
    drop_templates()  # while the server still runs (the embedded one stops at exit)


@pytest.fixture
def database_url(pg_admin_url: str):  # type: ignore[no-untyped-def]
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        yield url


def server_run_config(**sections: dict) -> dict:
    """A run config (as the API takes it) small enough to train rounds in seconds here."""
    raw: dict = {
        "name": "api-test",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"path": "corpus.txt", "val_fraction": 0.1, "chunk_size": 1024},
        "inner": {"steps": 3, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2},
        "rounds": {"quorum": 1, "timeout_s": 600, "max_rounds": 5},
        "compression": {"kind": "int8", "block_size": 256},
    }
    for name, values in sections.items():
        raw[name].update(values)
    return raw


@pytest.fixture(scope="module")
def server(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One `diloco serve` process per test module, on its own migrated database."""
    from tests.support.live import ServerProcess
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        proc = ServerProcess(data_dir=tmp_path_factory.mktemp("srv"), database_url=url)
        try:
            yield proc.wait_ready()
        finally:
            proc.stop()


@pytest.fixture
def http(server):  # type: ignore[no-untyped-def]
    with server.client() as client:
        yield client


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real S3 API server (SeaweedFS) on 127.0.0.1 for the whole session."""
    from tests.support.s3 import S3Server

    proc = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The AWS_* variables of the test S3 server, set in this process for the test."""
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


# ------------------------------------------------------------------ parallel runs (xdist)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep together on one pytest-xdist worker the tests of a module that share a fixture
    wider than a test (a module's `diloco serve`, its browser), so each such fixture is set
    up once; every other test is scheduled on its own (``--dist loadgroup``). Then order
    the work so the longest units start first: those marked ``slow``, then shared modules,
    then single tests, which fill the gaps at the end. Tests marked ``cpu_bound`` (benches
    that keep every core busy) share one group, so they run one after another on one worker
    instead of starving each other into their timeouts, and they start first."""
    shared = {_module(item) for item in items if _uses_a_wide_fixture(item)}
    slow = {_module(item) for item in items if item.get_closest_marker("slow")}
    for item in items:
        if item.get_closest_marker("cpu_bound"):
            item.add_marker(pytest.mark.xdist_group("cpu-bound"))
        elif _module(item) in shared:
            item.add_marker(pytest.mark.xdist_group(_module(item)))

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("cpu_bound"):
            return 0
        grouped = _module(item) in shared
        if item.get_closest_marker("slow") or (grouped and _module(item) in slow):
            return 1
        return 2 if grouped else 3

    items.sort(key=rank)  # stable: a module's tests keep their order


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _uses_a_wide_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        defs and defs[-1].scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
    )
