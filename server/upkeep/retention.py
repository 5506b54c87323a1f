"""Retention: what of a run's blobs the server deletes as it goes, by the run's
``[retention]`` policy (``diloco.config.RetentionSection``). Rows always stay.

- A checkpoint version outside the newest ``keep_last`` and not a milestone (``v %
  milestone_every == 0``, version 0 included) loses its three files (parameters, outer
  state, delta); its row stays with ``files_deleted_at`` set and its downloads answer
  ``410 gone``. Never retired, whatever the policy says: the latest version, the base of a
  round not yet closed (its close reads it), a version whose eval loss is still pending
  (``server.checkpoints.evals`` reads its parameters), a version whose full files are still
  pending and its base (``server.rounds.full_files`` rebuilds them from it).
  ``keep_last = 0`` keeps every version.
- A contribution's blob goes once its round is closed and ``contribution_grace_s`` has
  passed since; its row (sha256, nbytes, norm, payload_sha256...) stays with
  ``blob_deleted_at`` set, so the ledger can still be checked against what was recorded.
  An audited contribution's blob (``server.audits``) is kept while its audit is undecided,
  and for good once it failed (the evidence); once it passed it goes as any other. The base
  version of an audit not yet decided is kept. So are the blobs of a round whose version's
  full files are pending (a rebuild reads them).

The decision is the pure ``plan(now=..., ...)``; the janitor (``server.upkeep.janitor``) calls
``apply`` on each pass with the blobs it listed.

Mark first, then delete. A row is marked in a committed transaction before its files are
touched, so a row without its mark always has its files: a reader that finds no mark can
serve them (one that read the row just before the mark may see the file vanish under it,
as with any deletion). A crash between the mark and the deletion leaves files of a marked
row, which the next pass finds in its listing and deletes (``finish``). Deleting first
would leave, after such a crash, an unmarked row whose files are gone: a 404 or a failed
close where the API promises bytes.

Several replicas run the janitor at once: the mark is one guarded ``UPDATE ... WHERE
files_deleted_at IS NULL AND <still allowed> RETURNING``, so each row is claimed by exactly
one replica, against the database as it is then (a version that became an open round's
base, or the latest, since the plan was made is not marked); only the replica that marked a
row deletes its files at once. Deleting a file twice (a ``finish`` beside the marker) is
harmless: deletes are idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Exists, and_, exists, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import aliased

from diloco.config import RetentionSection
from diloco.protocol.audit import DECIDED, AuditStatus
from server.checkpoints.models import Checkpoint
from server.metrics import JANITOR_ERRORS, JANITOR_REMOVED
from server.rounds import service as rounds_service
from server.rounds.models import Audit, Contribution, Round
from server.runs.models import Run
from server.storage import keys
from server.storage.base import Storage

log = logging.getLogger("diloco.server.retention")


@dataclass(frozen=True)
class Version:
    """A checkpoint row as the plan needs it."""

    version: int
    keys: tuple[str, ...]  # its files: parameters, state and (from version 1) delta
    retired: bool = False  # files_deleted_at is set
    eval_pending: bool = False  # also while its full files are: its eval waits for them


@dataclass(frozen=True)
class Blob:
    """A contribution row as the plan needs it."""

    id: str
    key: str
    closed_at: datetime | None  # its round's; None: the round is not closed
    retired: bool = False  # blob_deleted_at is set


@dataclass(frozen=True)
class Plan:
    versions: list[tuple[int, str]]  # (version, why) to mark, then delete its files
    contributions: list[tuple[str, str]]  # (contribution id, why) to mark, then delete
    finish: list[tuple[str, str]]  # (key, why): files of rows marked earlier, still there


def keeps(
    version: int, *, latest: int, open_bases: Collection[int], policy: RetentionSection
) -> str:
    """Why ``version``'s files stay, or "" when the policy lets them go."""
    if policy.keep_last == 0:
        return "keep_last = 0 keeps every version"
    if version >= latest:
        return "the latest version"
    if version in open_bases:
        return "the base of a round not yet closed, an audit or a rebuild"
    if version > latest - policy.keep_last:
        return f"one of the last {policy.keep_last}"
    if policy.milestone_every and version % policy.milestone_every == 0:
        return f"a milestone (every {policy.milestone_every})"
    return ""


def plan(
    *,
    now: datetime,
    policy: RetentionSection,
    versions: Sequence[Version],
    open_bases: Collection[int],
    blobs: Sequence[Blob],
    present: Collection[str],
) -> Plan:
    """What one run's retention removes now. ``versions``: the run's checkpoint rows (the
    latest among them); ``open_bases``: base versions of its rounds not yet closed;
    ``blobs``: its contribution rows; ``present``: the keys now in the store."""
    # open_bases also holds the bases of undecided audits and of versions whose full files
    # are pending (server.rounds.full_files)
    latest = max((v.version for v in versions), default=0)
    retire: list[tuple[int, str]] = []
    finish: list[tuple[str, str]] = []
    for v in versions:
        if v.retired:
            finish += [
                (k, f"version {v.version} is retired; a file left") for k in v.keys if k in present
            ]
        elif v.eval_pending:
            continue  # its eval reads it; a later pass retires it
        elif not keeps(v.version, latest=latest, open_bases=open_bases, policy=policy):
            retire.append(
                (
                    v.version,
                    f"not one of the last {policy.keep_last} (latest {latest})"
                    + (
                        f" nor a milestone (every {policy.milestone_every})"
                        if policy.milestone_every
                        else ""
                    ),
                )
            )
    gone: list[tuple[str, str]] = []
    grace = policy.contribution_grace_s
    for b in blobs:
        if b.retired:
            if b.key in present:
                finish.append((b.key, "its contribution is retired; the blob was left"))
        elif (
            grace is not None
            and b.closed_at is not None
            and b.closed_at + timedelta(seconds=grace) <= now
        ):
            gone.append(
                (b.id, f"its round closed at {b.closed_at.isoformat()}, past the {grace:g} s grace")
            )
    return Plan(retire, gone, finish)


async def apply(
    sessions: async_sessionmaker[AsyncSession],
    storage: Storage,
    *,
    present: set[str],
    now: datetime,
) -> None:
    """One retention pass over every run whose policy deletes anything: plan, mark (one
    guarded UPDATE per kind), then delete what this process marked and what marked rows
    left (``present``: the committed keys the janitor listed)."""
    async with sessions() as session:
        runs = list(await session.scalars(select(Run)))
    for run in runs:
        policy = rounds_service.run_config(run).retention
        if policy.keep_last == 0 and policy.contribution_grace_s is None:
            continue
        mine = {k for k in present if k.startswith(keys.run(run.id))}
        async with sessions() as session, session.begin():
            # each query names only the listed keys of its own folder
            listed = {k for k in mine if k.startswith(keys.checkpoints(run.id))}
            versions, open_bases = await _versions(session, run.id, policy, listed)
            listed = {k for k in mine if k.startswith(keys.rounds(run.id))}
            blobs = await _blobs(session, run.id, policy, listed)
        decided = plan(
            now=now,
            policy=policy,
            versions=versions,
            open_bases=open_bases,
            blobs=blobs,
            present=mine,
        )
        removals: list[tuple[str, Sequence[str], str]] = []  # (kind, keys, what and why)
        why = dict(decided.versions)
        async with sessions() as session, session.begin():
            for version, files in await _mark_versions(session, run.id, list(why), now):
                removals.append(
                    ("retired_checkpoint", files, f"run {run.id} version {version}: {why[version]}")
                )
        grace = policy.contribution_grace_s
        if decided.contributions and grace is not None:
            reasons = dict(decided.contributions)
            async with sessions() as session, session.begin():
                for cid, key in await _mark_blobs(
                    session, list(reasons), now - timedelta(seconds=grace), now
                ):
                    removals.append(
                        ("retired_contribution", [key], f"contribution {cid}: {reasons[cid]}")
                    )
        removals += [("retired_leftover", [key], reason) for key, reason in decided.finish]
        await asyncio.to_thread(_delete, storage, removals)


async def _versions(
    session: AsyncSession, run_id: str, policy: RetentionSection, present: Collection[str]
) -> tuple[list[Version], set[int]]:
    """The run's checkpoint rows still kept, those retired whose files are still listed,
    and the bases of its rounds not yet closed."""
    if policy.keep_last == 0:
        return [], set()
    c = Checkpoint
    listed = list(present)
    rows = await session.execute(
        select(c.version, c.params_key, c.state_key, c.delta_key, c.files_deleted_at)
        .add_columns(c.eval_loss, c.full_files_at)
        .where(c.run_id == run_id)
        .where(
            c.files_deleted_at.is_(None)
            | c.params_key.in_(listed)
            | c.state_key.in_(listed)
            | c.delta_key.in_(listed)
        )
    )
    versions = [
        Version(
            version=v,
            keys=tuple(k for k in (params, state, delta) if k),
            retired=deleted is not None,
            eval_pending=loss is None or full is None,
        )
        for v, params, state, delta, deleted, loss, full in rows
    ]
    bases = await session.scalars(
        select(Round.base_version).where(Round.run_id == run_id, Round.state != "closed")
    )
    audited = await session.scalars(  # an audit not yet decided replays from its round's base
        select(Audit.round_index - 1).where(
            Audit.run_id == run_id, Audit.status.not_in(list(DECIDED))
        )
    )
    rebuilt = await session.scalars(  # a rebuild of pending full files reads their base
        select(c.version - 1).where(c.run_id == run_id, c.full_files_at.is_(None))
    )
    return versions, set(bases) | set(audited) | set(rebuilt)


async def _blobs(
    session: AsyncSession, run_id: str, policy: RetentionSection, present: Collection[str]
) -> list[Blob]:
    """The run's contributions whose blob is kept, and those retired whose blob is listed."""
    if policy.contribution_grace_s is None:
        return []
    c = Contribution
    rows = await session.execute(
        select(c.id, c.blob_key, Round.state, Round.closed_at, c.blob_deleted_at)
        .join(Round, and_(Round.run_id == c.run_id, Round.index == c.merged_into_round))
        .where(c.run_id == run_id)
        .where(c.blob_deleted_at.is_(None) | c.blob_key.in_(list(present)))
        # an audit not yet decided replays it; a failed one keeps it as the evidence
        .where(~exists().where(Audit.contribution_id == c.id, Audit.status != AuditStatus.PASSED))
        .where(~_rebuild_reads(c))
    )
    return [
        Blob(cid, key, closed_at if state == "closed" else None, retired=deleted is not None)
        for cid, key, state, closed_at, deleted in rows
    ]


async def _mark_versions(
    session: AsyncSession, run_id: str, versions: list[int], now: datetime
) -> list[tuple[int, list[str]]]:
    """Mark the versions still allowed to go, as the database is now; those marked here
    and their files. Another replica's marks, a new latest or a new open round's base, and a
    pending eval leave a version out."""
    if not versions:
        return []
    c, newer = Checkpoint, aliased(Checkpoint)
    marked = await session.execute(
        update(c)
        .where(c.run_id == run_id, c.version.in_(versions), c.files_deleted_at.is_(None))
        .where(c.eval_loss.is_not(None), c.full_files_at.is_not(None))
        .where(exists().where(newer.run_id == run_id, newer.version > c.version))
        .where(  # a rebuild of the next version's full files reads this one
            ~exists().where(
                newer.run_id == run_id,
                newer.version == c.version + 1,
                newer.full_files_at.is_(None),
            )
        )
        .where(
            ~exists().where(
                Round.run_id == run_id, Round.state != "closed", Round.base_version == c.version
            )
        )
        .values(files_deleted_at=now)
        .returning(c.version, c.params_key, c.state_key, c.delta_key)
        .execution_options(synchronize_session=False)
    )
    return [(v, [k for k in (p, s, d) if k]) for v, p, s, d in marked]


async def _mark_blobs(
    session: AsyncSession, ids: list[str], closed_by: datetime, now: datetime
) -> list[tuple[str, str]]:
    """Mark the contributions whose round is closed since ``closed_by`` or before; those
    marked here and their blob keys."""
    c = Contribution
    marked = await session.execute(
        update(c)
        .where(c.id.in_(ids), c.blob_deleted_at.is_(None))
        .where(
            exists().where(
                Round.run_id == c.run_id,
                Round.index == c.merged_into_round,  # the step that reads it, late or not
                Round.state == "closed",
                Round.closed_at <= closed_by,
            )
        )
        .where(~_rebuild_reads(c))
        .values(blob_deleted_at=now)
        .returning(c.id, c.blob_key)
        .execution_options(synchronize_session=False)
    )
    return [(cid, key) for cid, key in marked]


def _rebuild_reads(c: type[Contribution]) -> Exists:
    """The contribution's round published a version whose full files are still pending: a
    rebuild of them reads its blob (``server.rounds.full_files``)."""
    return exists().where(
        Checkpoint.run_id == c.run_id,
        Checkpoint.version == c.merged_into_round,
        Checkpoint.full_files_at.is_(None),
    )


def _delete(storage: Storage, removals: Iterable[tuple[str, Sequence[str], str]]) -> None:
    for kind, doomed, why in removals:
        try:
            for key in doomed:
                storage.delete(key)
        except OSError as err:  # the row is marked: the next pass's finish tries again
            JANITOR_ERRORS.inc()
            log.error("retention: could not delete %s (%s): %s", ", ".join(doomed), why, err)
            continue
        JANITOR_REMOVED.labels(kind).inc()
        log.info("retention: deleted %s: %s", ", ".join(doomed), why)


async def counts(session: AsyncSession, run_id: str) -> dict[str, int]:
    """How many of the run's versions and contribution blobs are kept and retired."""
    kept_version = Checkpoint.files_deleted_at.is_(None).label("kept")
    kept_blob = Contribution.blob_deleted_at.is_(None).label("kept")
    versions = await session.execute(
        select(kept_version, func.count()).where(Checkpoint.run_id == run_id).group_by(kept_version)
    )
    blobs = await session.execute(
        select(kept_blob, func.count()).where(Contribution.run_id == run_id).group_by(kept_blob)
    )
    v, k = dict(versions.all()), dict(blobs.all())
    return {
        "versions_kept": v.get(True, 0),
        "versions_retired": v.get(False, 0),
        "contributions_kept": k.get(True, 0),
        "contributions_retired": k.get(False, 0),
    }
