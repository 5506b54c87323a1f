"""The janitor: removes what interrupted work left in the data dir, at start and then every
``janitor_interval_s``.

Nothing younger than ``temp_max_age_s`` (by its mtime) is touched, so that work in progress,
in this process or in another server on the same data dir, is never collected. Older than
that, it removes:

- ``temp_file``: temp files of interrupted atomic writes anywhere in storage
  (``Storage.list_unfinished``: an upload or a checkpoint write cut by a kill or a crash),
  and files in ``<data_dir>/tmp`` (run data being received; a killed server leaves them);
- ``orphan_blob``: contribution blobs under ``runs/<id>/rounds/<index>/`` that no
  ``contributions.blob_key`` references (a crash between the blob's commit and its row);
- ``stale_upload``: a direct upload (``runs/<id>/incoming/<index>/``) never committed: its
  commit deletes it, so one this old was abandoned (the volunteer died between its PUT and
  its commit, or PUT again after);
- ``orphan_run``: a ``runs/<id>/`` folder with no ``runs`` row (a run creation that crashed
  before its transaction committed). Only folders that hold no more than a creation writes
  (``data/`` and checkpoint 0) are removed: trained checkpoints or contributions without a
  row mean this database is not the one the data dir belongs to, and such a folder is kept,
  with a warning, rather than destroying a trained model.

Each pass then applies the runs' retention policies (``server.upkeep.retention``: old checkpoint
versions and the blobs of closed rounds), with the listing it made.

The decision is the pure ``plan(now=..., ...)``; ``Janitor`` only scans, asks the database,
calls it and removes. One line per removal says why; ``diloco_janitor_removed_total{kind}``
counts them. A removal that fails is logged and counted (``diloco_janitor_errors_total``)
and the pass goes on; a pass that fails (the database is down) is logged and the next one
comes on time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from server.metrics import JANITOR_ERRORS, JANITOR_PASSES, JANITOR_REMOVED
from server.rounds.models import Contribution
from server.runs.models import Run
from server.settings import Settings
from server.storage import keys
from server.storage.base import BlobInfo, Storage
from server.upkeep import retention

log = logging.getLogger("diloco.server.janitor")


@dataclass(frozen=True)
class Removal:
    kind: str  # temp_file | orphan_blob | orphan_run: the metric's label
    target: str  # a storage key, a key prefix ending in "/" (orphan_run), or a local path
    reason: str
    local: bool = False  # target is a file under <data_dir>/tmp, not a storage key


@dataclass(frozen=True)
class Scan:
    """What is on disk, before the database is asked."""

    blobs: list[BlobInfo]  # committed blobs under runs/
    unfinished: list[BlobInfo]  # temp files of unfinished writes, anywhere in storage
    tmp_files: list[tuple[Path, float]]  # files in <data_dir>/tmp and their mtimes


@dataclass(frozen=True)
class Plan:
    removals: list[Removal]
    kept: list[str]  # why an old folder without a run row is kept anyway


def old_round_blobs(blobs: Iterable[BlobInfo], *, known_runs: set[str], cutoff: float) -> list[str]:
    """Keys of contribution blobs (``runs/<id>/rounds/<index>/<name>``) of runs that have a
    row, written before ``cutoff``: those the database must be asked about."""
    return [
        b.key
        for b in blobs
        if b.modified <= cutoff and keys.run_of(b.key) in known_runs and keys.is_contribution(b.key)
    ]


def _ago(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def plan(
    *, now: float, max_age: float, scan: Scan, known_runs: set[str], referenced: set[str]
) -> Plan:
    """What to remove and why; ``referenced`` holds the blob keys that have a row among
    ``old_round_blobs`` (others may be left out)."""
    cutoff = now - max_age
    removals: list[Removal] = []
    kept: list[str] = []

    # run folders without a row: all of it at once, once even its newest file is old
    newest: dict[str, float] = {}  # run id -> its folder's newest mtime
    beyond_creation: dict[str, str] = {}  # run id -> a file a run creation never writes
    for info in scan.blobs + scan.unfinished:
        run_id = keys.run_of(info.key)
        if run_id is not None and run_id not in known_runs:
            newest[run_id] = max(newest.get(run_id, info.modified), info.modified)
    for info in scan.blobs:
        run_id = keys.run_of(info.key)
        if run_id in newest and not keys.written_at_creation(info.key):
            beyond_creation.setdefault(run_id, info.key.removeprefix(keys.run(run_id)))
    orphans: set[str] = set()
    for run_id, last in sorted(newest.items()):
        if last > cutoff:
            continue  # a creation may be under way
        prefix = keys.run(run_id)
        if trained := beyond_creation.get(run_id):
            kept.append(
                f"{prefix} has no run row in this database but holds {trained}, more than a "
                "run creation writes; kept. Is this data dir the one of this database?"
            )
            continue
        orphans.add(run_id)
        removals.append(
            Removal(
                "orphan_run",
                prefix,
                f"no run {run_id} in the database, last written {_ago(now - last)} ago "
                "(a run creation that failed or crashed)",
            )
        )

    for info in scan.unfinished:
        if keys.run_of(info.key) not in orphans and info.modified <= cutoff:
            reason = f"an unfinished write, last written {_ago(now - info.modified)} ago"
            removals.append(Removal("temp_file", info.key, reason))
    for info in scan.blobs:
        parts = info.key.split("/")
        if (
            len(parts) == 5
            and parts[2] == "incoming"
            and keys.run_of(info.key) not in orphans
            and info.modified <= cutoff
        ):
            reason = f"a direct upload never committed, put {_ago(now - info.modified)} ago"
            removals.append(Removal("stale_upload", info.key, reason))
    for key in old_round_blobs(scan.blobs, known_runs=known_runs, cutoff=cutoff):
        if key not in referenced:
            reason = "no contribution references it (a crash between its commit and its row)"
            removals.append(Removal("orphan_blob", key, reason))
    for path, mtime in scan.tmp_files:
        if mtime <= cutoff:
            reason = f"an upload never finished, last written {_ago(now - mtime)} ago"
            removals.append(Removal("temp_file", str(path), reason, local=True))
    return Plan(removals, kept)


class Janitor:
    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], storage: Storage, settings: Settings
    ) -> None:
        self.sessions = sessions
        self.storage = storage
        self.tmp_dir = settings.data_dir / "tmp"
        self.interval = settings.janitor_interval_s
        self.max_age = settings.temp_max_age_s

    async def run(self) -> None:
        """A pass now, then one every ``janitor_interval_s``, until cancelled."""
        while True:
            try:
                await self.sweep()
            except Exception:  # the database is down, a bug: say so, try again next time
                log.exception("janitor: the pass failed; the next one is in %.0f s", self.interval)
            await asyncio.sleep(self.interval)

    async def sweep(self) -> Plan:
        """One pass: scan, ask the database, decide, remove."""
        now = time.time()
        cutoff = now - self.max_age
        scan = await asyncio.to_thread(self._scan)
        on_disk = {r for i in scan.blobs + scan.unfinished if (r := keys.run_of(i.key))}
        referenced: set[str] = set()
        async with self.sessions() as session:
            known = set(await session.scalars(select(Run.id).where(Run.id.in_(on_disk))))
            asked = old_round_blobs(scan.blobs, known_runs=known, cutoff=cutoff)
            for run_id in sorted({r for key in asked if (r := keys.run_of(key))}):
                query = select(Contribution.blob_key).where(Contribution.run_id == run_id)
                referenced |= set(await session.scalars(query))
        result = plan(
            now=now, max_age=self.max_age, scan=scan, known_runs=known, referenced=referenced
        )
        for sentence in result.kept:
            log.warning("janitor: %s", sentence)
        await asyncio.to_thread(self._remove, result.removals)
        present = {b.key for b in scan.blobs}
        await retention.apply(
            self.sessions, self.storage, present=present, now=datetime.fromtimestamp(now, UTC)
        )
        JANITOR_PASSES.inc()
        return result

    def _scan(self) -> Scan:
        tmp_files = []
        if self.tmp_dir.is_dir():
            for entry in os.scandir(self.tmp_dir):
                if entry.is_file(follow_symlinks=False):
                    try:
                        tmp_files.append((Path(entry.path), entry.stat().st_mtime))
                    except FileNotFoundError:
                        continue  # finished (and removed) meanwhile
        return Scan(
            blobs=list(self.storage.list_blobs(keys.RUNS)),
            unfinished=list(self.storage.list_unfinished("")),
            tmp_files=tmp_files,
        )

    def _remove(self, removals: list[Removal]) -> None:
        for item in removals:
            try:
                if item.kind == "orphan_run":
                    count = self.storage.delete_prefix(item.target)
                    what = f"{item.target} ({count} files)"
                elif item.local:
                    Path(item.target).unlink(missing_ok=True)
                    what = item.target
                else:
                    self.storage.delete(item.target)
                    what = item.target
            except OSError as err:
                JANITOR_ERRORS.inc()
                log.error("janitor: could not remove %s (%s): %s", item.target, item.reason, err)
                continue
            JANITOR_REMOVED.labels(item.kind).inc()
            log.info("janitor: removed %s: %s", what, item.reason)
