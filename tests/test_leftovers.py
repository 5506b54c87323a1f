"""Nothing left behind, against real ``diloco serve`` processes on a real Postgres: a run
creation that fails after writing removes its files before answering, and the janitor
removes exactly the stale and orphan leftovers (old by their mtime), at start and then
periodically, and keeps going when one of them cannot be removed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from server.storage import keys
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, create_run, register, train, upload
from tests.support.live import ServerProcess, admin_headers, wait_for

OLD = 2 * 3600.0  # seconds: past the grace age the servers below are given
GRACE = {"temp_max_age_s": 600}


def plant(path: Path, *, age: float = OLD) -> Path:
    """A file whose mtime is ``age`` seconds ago (0: now)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"left behind")
    make_old(path, age)
    return path


def make_old(path: Path, age: float = OLD) -> None:
    then = time.time() - age
    os.utime(path, (then, then))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def metric(server: ServerProcess, series: str) -> float:
    """One series of /metrics, e.g. ``diloco_janitor_removed_total{kind="orphan_run"}``."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} is not in /metrics")


def removed(server: ServerProcess, kind: str) -> float:
    return metric(server, f'diloco_janitor_removed_total{{kind="{kind}"}}')


def serve(data_dir: Path, database_url: str, **settings: object) -> ServerProcess:
    return ServerProcess(data_dir=data_dir, database_url=database_url, **settings).wait_ready()


@contextmanager
def running(server: ServerProcess) -> Iterator[ServerProcess]:
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def undeletable(folder: Path) -> Iterator[None]:
    """Nothing in ``folder`` can be removed while the block runs: its write bit off for a
    normal user, the immutable attribute for root (root ignores the bits). Skips the test
    where neither works (chattr missing, or a file system without the attribute)."""
    undo: Callable[[], object]
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = lambda: folder.chmod(0o755)  # noqa: E731
    else:
        chattr = shutil.which("chattr")
        if chattr is None:
            pytest.skip("running as root without chattr: cannot make a file undeletable")
        done = subprocess.run([chattr, "+i", str(folder)], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"chattr +i does not work here: {done.stderr.decode(errors='replace')}")
        undo = lambda: subprocess.run([chattr, "-i", str(folder)], check=True)  # noqa: E731
    try:
        probe = folder / "probe"
        try:
            probe.touch()
        except PermissionError:
            pass  # locked, as wanted
        else:
            probe.unlink()
            pytest.skip(f"{folder} stayed writable")
        yield
    finally:
        undo()


# ---------------------------------------------------------------- a failed run creation


def test_a_run_creation_that_fails_after_writing_leaves_no_files(database_url, tmp_path):
    # Prepare: the server cannot write a file over 1 MiB. The data (120 kB: shards of a few
    # kB) fits; checkpoint 0 of this model (1.6 M parameters, 6.6 MB) does not
    data_dir = tmp_path / "srv"
    big = server_run_config(model={"n_layer": 2, "n_head": 4, "n_embd": 256, "block_size": 32})

    with running(serve(data_dir, database_url, max_file_bytes=1 << 20)) as server:
        with server.client() as http:
            # Execute
            r = http.post(
                f"{API}/runs",
                data={"config": json.dumps(big)},
                files={"data": ("corpus.txt", make_corpus(120_000).encode(), "text/plain")},
                headers=admin_headers(),
            )
            runs = http.get(f"{API}/runs").json()["runs"]
            small = create_run(http, server_run_config())  # and the server goes on
        log = server.output()

    # Assert: a clear answer, no run, and nothing of it on disk
    assert r.status_code == 507, r.text
    assert r.json()["error"] == "storage_failed" and "File too large" in r.json()["detail"]
    assert runs == []
    assert sorted(p.name for p in (data_dir / "blobs" / keys.RUNS).iterdir()) == [small["id"]]
    assert files_under(data_dir / "tmp") == []
    wrote = re.search(r"creating run (run_\w+) failed; the (\d+) files it wrote are removed", log)
    assert wrote is not None and int(wrote.group(2)) > 0, log[-3000:]  # it failed after writing


# ---------------------------------------------------------------- the janitor


def test_leftovers_from_before_a_restart_are_collected_when_the_server_starts(
    database_url, tmp_path
):
    # Prepare: what a killed server left: a half-created run, a half-received upload
    data_dir = tmp_path / "srv"
    blobs = data_dir / "blobs"
    half_run = blobs / keys.run("run_00000000dead")
    plant(half_run / "data" / "val.bin")
    plant(half_run / "checkpoints" / ".0.safetensors.tmp-0a1b2c3d4e5f")
    old_upload = plant(data_dir / "tmp" / "tmpk2j3h4.txt")
    young_upload = plant(data_dir / "tmp" / "tmpfresh.txt", age=0)

    # Execute: a server whose next periodic pass is an hour away
    with running(serve(data_dir, database_url, janitor_interval_s=3600, **GRACE)) as server:
        # (the janitor removes, then logs: under load the line can trail the removal)
        wait_for(
            lambda: (
                not half_run.exists()
                and not old_upload.exists()
                and f"janitor: removed {old_upload}" in server.output()
            ),
            timeout=60,
            what="the janitor's pass at start",
        )
        log = server.output()

    # Assert
    assert young_upload.exists()
    assert (
        "janitor: removed runs/run_00000000dead/ (2 files): no run run_00000000dead in the "
        "database" in log
    )
    assert f"janitor: removed {old_upload}: an upload never finished" in log


def test_a_periodic_pass_removes_exactly_the_stale_and_orphan_leftovers(database_url, tmp_path):
    data_dir = tmp_path / "srv"
    blobs = data_dir / "blobs"
    with running(serve(data_dir, database_url, janitor_interval_s=0.5, **GRACE)) as server:
        # Prepare: a real run with one accepted contribution, all of its files made old:
        # none of them may go, the contribution's blob included
        with server.client() as http:
            run = create_run(http, server_run_config(rounds={"quorum": 2}))
            token = register(http, "alice")
            assert upload(http, token, train(http, token, run["id"])).status_code == 201
        run_dir = blobs / keys.run(run["id"])
        run_files = files_under(run_dir)
        for path in run_files:
            make_old(path)
        (referenced,) = files_under(run_dir / "rounds" / "1")
        stale = [
            plant(run_dir / "checkpoints" / ".1.safetensors.tmp-0a1b2c3d4e5f"),
            plant(run_dir / "rounds" / "1" / "ctr_ghost-00000000.bin"),
            plant(blobs / keys.val("run_00000000dead")),
            plant(data_dir / "tmp" / "tmpold.txt"),
        ]
        young = [
            plant(run_dir / "rounds" / "1" / ".ctr_late-0000.bin.tmp-0a1b2c3d4e5f", age=0),
            plant(run_dir / "rounds" / "1" / "ctr_late-11111111.bin", age=0),
            plant(blobs / keys.val("run_0000000fresh"), age=0),
            plant(data_dir / "tmp" / "tmpnew.txt", age=0),
        ]
        trained_no_row = plant(blobs / keys.version("run_00000trained", 5).params)

        # Execute: wait for the stale ones to go, then for two more whole passes
        wait_for(lambda: not any(p.exists() for p in stale), timeout=60, what="the stale leftovers")
        passes = metric(server, "diloco_janitor_passes_total")
        wait_for(
            lambda: metric(server, "diloco_janitor_passes_total") >= passes + 2,
            timeout=60,
            what="two more janitor passes",
        )
        counts = {k: removed(server, k) for k in ("temp_file", "orphan_blob", "orphan_run")}
        log = server.output()
        with server.client() as http:
            assert http.get(f"{API}/runs/{run['id']}/checkpoints/latest").status_code == 200

    # Assert: exactly the stale ones went
    assert [p for p in young if not p.exists()] == []
    assert referenced in run_files and [p for p in run_files if not p.exists()] == []
    assert trained_no_row.exists()
    assert counts == {"temp_file": 2, "orphan_blob": 1, "orphan_run": 1}
    assert "runs/run_00000trained/ has no run row in this database" in log
    assert f"removed runs/{run['id']}/rounds/1/ctr_ghost-00000000.bin: no contribution" in log


def test_a_leftover_that_cannot_be_removed_is_logged_and_the_others_still_go(
    database_url, tmp_path
):
    # Prepare: two half-created runs; the first in the janitor's order cannot be removed
    data_dir = tmp_path / "srv"
    runs = data_dir / "blobs" / keys.RUNS
    stuck = plant(runs / "run_0000000stuck" / "data" / "val.bin")
    loose = plant(runs / "run_1111111loose" / "data" / "val.bin")

    with undeletable(stuck.parent):
        with running(serve(data_dir, database_url, janitor_interval_s=0.5, **GRACE)) as server:
            # Execute
            wait_for(lambda: not loose.exists(), timeout=60, what="the removable leftover")
            errors = metric(server, "diloco_janitor_errors_total")
            passes = metric(server, "diloco_janitor_passes_total")
            wait_for(
                lambda: metric(server, "diloco_janitor_passes_total") >= passes + 2,
                timeout=60,
                what="two more janitor passes",
            )
            errors_later = metric(server, "diloco_janitor_errors_total")
            log = server.output()

        # Assert: logged, counted, tried again each pass, and the loop goes on
        assert stuck.exists()
    assert errors >= 1 and errors_later >= errors + 2
    assert "janitor: could not remove runs/run_0000000stuck/" in log
    assert "janitor: removed runs/run_1111111loose/ (1 files)" in log
