"""A published version's full files — its parameters and its outer state — made durable
off the close's critical path: delta first.

A close (``server.rounds.closing``) publishes a version as soon as its delta is durable
(what a returning volunteer needs); the row says its full files are pending
(``full_files_at`` NULL) and records what a rebuild of them needs (``Recipe``). Then:

1. **Commit** (the closing process): it holds the version's claim from the publishing
   transaction on (``full_claim_expires_at``, ``claim_ttl_s``, renewed while it works),
   writes the files by the close's second pass (``diloco.outer.rebuild.Rest``: the close
   wrote the delta alone; this pass takes the round's running sum, when this process
   folded it, and is checked against the published sha256s), commits them (fsync, rename;
   on object storage, the upload: ``Pending``) and marks the row. This is the usual path.
2. **Rebuild** (any round worker, ``finish_next``): a version whose claim expired — its
   closer died or failed before marking it — is claimed and its files rebuilt from the
   stored uploads (``diloco.outer.rebuild``: the version's pass run again with exactly the
   recorded inputs, checked against the published sha256s before anything is committed),
   committed, and the row marked. A failed rebuild is logged and tried again after
   ``close_retry_base_s``.

Files under a version's full keys are only ever committed with that version's published
bytes (the commit follows the publishing transaction; a rebuild follows its check), so a
crash between the commit and the mark leaves only the mark to do: a version whose two
files are both in the store is marked without a rebuild.

Until the mark: the next round's close does not claim its round (``claims.claim_next``
waits for the base's full files), the version's eval, the scoring on arrival against it
and retention leave it alone, its base version and its contributions' blobs are kept
(a rebuild reads them), and its parameters' download answers ``503 checkpoint_pending``
(a returning volunteer catches up by the delta meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Update, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from diloco.config import RunConfig
from diloco.faults import FaultInjector
from diloco.outer.attempt import CloseInputs, Upload, VersionPaths, folding
from diloco.outer.chunked import Outputs
from diloco.outer.rebuild import Rest, rebuild
from server.checkpoints.models import Checkpoint
from server.metrics import CLOSE_STAGE_SECONDS
from server.rounds import notify
from server.rounds.models import Contribution, Round
from server.runs import service as runs_service
from server.settings import Settings
from server.storage import keys
from server.storage.base import Storage
from server.storage.staging import Stage

log = logging.getLogger("diloco.rounds")


@dataclass(frozen=True)
class Recipe:
    """What a rebuild of a version's full files needs besides the run's config (its
    aggregation, outer lr schedule and codecs) and the base version: the contributions the
    close kept, in its order, with the weight and the norm it took for each, and the
    clipping's history (the norms of the run's earlier aggregated contributions)."""

    contributions: list[tuple[str, float, float]]  # (id, weight, norm)
    history: list[float]

    def to_json(self) -> dict:
        """Floats as JSON numbers: Python writes the shortest text that reads back exactly."""
        return {"contributions": [list(c) for c in self.contributions], "history": self.history}

    @classmethod
    def from_json(cls, data: dict) -> Recipe:
        return cls(
            [(str(i), float(w), float(n)) for i, w, n in data["contributions"]],
            [float(h) for h in data["history"]],
        )


class Pending:
    """A close's full files, still to be written (``Rest``), and the stage they go to (on
    object storage, its scratch folder) with the close's inputs: ``commit`` or ``discard``
    it. ``held``: the round's fold lock, taken by the close and let go by ``discard``, so
    that the round's running sum stays while the second pass may read it
    (``server.rounds.fold_sums``)."""

    def __init__(
        self, stage: Stage, rest: Rest, at: keys.VersionKeys, held: threading.Lock | None = None
    ) -> None:
        self.stage, self.rest, self.at = stage, rest, at
        self._held = held
        self.outputs: Outputs | None = None

    def commit(self) -> None:
        """Write the parameters and the outer state (checked against the published
        sha256s), fsync and rename them; put them into the store."""
        try:
            self.outputs = self.rest.write()
            self.outputs.commit_rest()
            self.stage.publish([self.at.params, self.at.state])
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove what is not committed, and the stage; let the fold lock go (once)."""
        try:
            if self.outputs is not None:
                self.outputs.abort()
            self.stage.close()
        finally:
            held, self._held = self._held, None
            if held is not None:
                held.release()


async def commit_published(
    *,
    sessions: async_sessionmaker[AsyncSession],
    settings: Settings,
    executor: Executor,
    faults: FaultInjector,
    run_id: str,
    version: int,
    pending: Pending,
) -> bool:
    """The closing process's commit of the version it just published (module docstring,
    1); True once the row is marked. A failure is logged and the claim let go: a rebuild
    finishes the version (``finish_next``)."""
    hold = asyncio.create_task(_renew(sessions, settings, run_id, version))
    try:

        def commit() -> None:
            pending.commit()
            faults.hit("close.full")

        await asyncio.get_running_loop().run_in_executor(executor, commit)
        await _mark(sessions, run_id, version)
        return True
    except asyncio.CancelledError:
        raise
    except Exception:  # a rebuild finishes it
        log.exception("run %s version %d: committing its full files failed", run_id, version)
        await _release(sessions, run_id, version, settings.close_retry_base_s)
        return False
    finally:
        pending.discard()  # nothing left after a commit
        hold.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hold


@dataclass(frozen=True)
class _Job:
    run_id: str
    version: int
    cfg: RunConfig
    row: Checkpoint  # the version's, detached
    base: Checkpoint  # version − 1's
    blobs: list[tuple[str, str, float, float]]  # (id, blob key, weight, norm), in order
    history: list[float]
    check_seed: int  # its round's (diloco.outer.checks)


async def finish_next(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    settings: Settings,
    executor: Executor,
    faults: FaultInjector,
) -> bool:
    """Claim the oldest version whose full files are pending and whose claim expired,
    rebuild and commit them, mark it (module docstring, 2); False when there was none."""
    now = datetime.now(UTC)
    async with sessions() as session, session.begin():
        job = await _claim(session, settings, now)
    if job is None:
        return False
    hold = asyncio.create_task(_renew(sessions, settings, job.run_id, job.version))
    started = time.perf_counter()
    try:
        rebuilt = await asyncio.get_running_loop().run_in_executor(
            executor, _rebuild_and_commit, storage, job, faults
        )
    except asyncio.CancelledError:
        raise
    except Exception as err:  # missing blobs, a mismatch, an injected fault: tried again
        log.error(
            "run %s version %d: rebuilding its full files failed (%s: %s); tried again in %g s",
            job.run_id, job.version, type(err).__name__, err, settings.close_retry_base_s,
        )  # fmt: skip
        await _release(sessions, job.run_id, job.version, settings.close_retry_base_s)
        return True
    finally:
        hold.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hold
    await _mark(sessions, job.run_id, job.version)
    CLOSE_STAGE_SECONDS.labels("rebuild").observe(time.perf_counter() - started)
    how = "rebuilt and committed" if rebuilt else "found committed, not yet marked"
    log.info("run %s version %d: full files %s", job.run_id, job.version, how)
    return True


async def _claim(session: AsyncSession, settings: Settings, now: datetime) -> _Job | None:
    c = Checkpoint
    row = await session.scalar(
        select(c)
        .where(
            c.full_files_at.is_(None),
            c.rebuild.is_not(None),  # a close's version (there is no other pending kind)
            c.full_claim_expires_at.is_(None) | (c.full_claim_expires_at < now),
        )
        .order_by(c.created_at)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    if row is None:
        return None
    row.full_claim_expires_at = now + timedelta(seconds=settings.claim_ttl_s)
    run = await runs_service.get(session=session, run_id=row.run_id)
    base = await session.get_one(Checkpoint, (row.run_id, row.version - 1))
    assert row.rebuild is not None
    recipe = Recipe.from_json(row.rebuild)
    ids = [cid for cid, _, _ in recipe.contributions]
    blob_keys = dict(
        (await session.execute(select(Contribution.id, Contribution.blob_key).where(
            Contribution.id.in_(ids)))).all()
    )  # fmt: skip
    blobs = [(cid, blob_keys[cid], w, n) for cid, w, n in recipe.contributions]
    cfg = runs_service.run_config(run)
    seed = await session.scalar(
        select(Round.check_seed).where(Round.run_id == row.run_id, Round.index == row.version)
    )
    assert seed is not None
    return _Job(row.run_id, row.version, cfg, row, base, blobs, recipe.history, seed)


def _rebuild_and_commit(storage: Storage, job: _Job, faults: FaultInjector) -> bool:
    """The version's full files in the store: rebuilt and committed (True), or found there."""
    at = keys.version(job.run_id, job.version)
    if storage.exists(at.params) and storage.exists(at.state):  # committed, not yet marked
        return False
    if storage.scratch_dir is not None:  # the rebuilt delta's, checked then dropped
        storage.scratch_dir.mkdir(parents=True, exist_ok=True)
    with Stage(storage) as stage, tempfile.TemporaryDirectory(dir=storage.scratch_dir) as tmp:
        paths = stage.inputs([job.base.params_key, job.base.state_key])
        blobs = stage.inputs([key for _, key, _, _ in job.blobs], missing_ok=True)
        inputs = CloseInputs(
            run_id=job.run_id,
            version=job.version,
            cfg=job.cfg,
            base_params=paths[job.base.params_key],
            base_state=paths[job.base.state_key],
            uploads=[Upload(cid, blobs[key], w, n) for cid, key, w, n in job.blobs],
            history=job.history,
            quorum=len(job.blobs),
            out=VersionPaths(
                stage.output(at.params), stage.output(at.state), Path(tmp) / "delta.safetensors"
            ),
            check_seed=job.check_seed,
            # a folded round's terms, from its plan, every upload read (its running sum, if
            # any, is the closer's): the exact sum is the same bits either way
            fold=folding(job.cfg, job.history),
        )
        assert job.row.delta_sha256 is not None
        out = rebuild(inputs, params_sha256=job.row.sha256, delta_sha256=job.row.delta_sha256)
        try:
            faults.hit("full.rebuild")
            out.commit_rest()
            stage.publish([at.params, at.state])
        finally:
            out.abort()
    return True


async def _mark(sessions: async_sessionmaker[AsyncSession], run_id: str, version: int) -> None:
    """The version's full files are durable: say so, let go of its claim, and wake the
    round workers (the next round's close waits for them)."""
    async with sessions() as session, session.begin():
        await session.execute(
            _pending(run_id, version).values(
                full_files_at=datetime.now(UTC), full_claim_expires_at=None
            )
        )
        await notify.rounds_changed(session, run_id)


async def _release(
    sessions: async_sessionmaker[AsyncSession], run_id: str, version: int, after_s: float
) -> None:
    """Let go of the version's claim: a rebuild may claim it ``after_s`` from now."""
    until = datetime.now(UTC) + timedelta(seconds=after_s)
    await _pending_row(sessions, run_id, version, full_claim_expires_at=until)


async def _renew(
    sessions: async_sessionmaker[AsyncSession], settings: Settings, run_id: str, version: int
) -> None:
    """Keep the version's claim while this process works on it."""
    while True:
        await asyncio.sleep(settings.claim_ttl_s / 3)
        until = datetime.now(UTC) + timedelta(seconds=settings.claim_ttl_s)
        await _pending_row(sessions, run_id, version, full_claim_expires_at=until)


async def _pending_row(
    sessions: async_sessionmaker[AsyncSession], run_id: str, version: int, **values: object
) -> None:
    """Set ``values`` on the version's row while its full files are pending."""
    async with sessions() as session, session.begin():
        await session.execute(_pending(run_id, version).values(**values))


def _pending(run_id: str, version: int) -> Update:
    return update(Checkpoint).where(
        Checkpoint.run_id == run_id,
        Checkpoint.version == version,
        Checkpoint.full_files_at.is_(None),
    )
