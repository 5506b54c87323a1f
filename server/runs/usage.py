"""What a run holds in the store, by kind: ``GET /runs/{id}/storage`` lists the run's
prefix (``runs/<id>/``) and sorts each key by its kind (``server.storage.keys.kind_of``)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from server.runs.schemas import KindUsage
from server.storage import keys
from server.storage.base import Storage

# every kind a run's key falls in, in the order the API answers them
KINDS = (
    "data",  # data/: the validation tokens and the training shards
    "checkpoints",  # checkpoints/<v>.safetensors: a version's parameters
    "states",  # checkpoints/<v>.state.safetensors: its outer momentum and residual
    "deltas",  # checkpoints/<v>.delta.safetensors: the int8 delta from v - 1
    "contributions",  # rounds/<index>/: accepted contribution blobs
    "incoming",  # incoming/<index>/: direct uploads not yet committed
    "audits",  # audits/<audit>.safetensors: the AdamW states audited volunteers revealed
    "unfinished",  # writes never committed nor aborted (a crash): the janitor's to remove
    "other",  # anything else under the run's prefix (none is expected)
)


def usage(storage: Storage, run_id: str) -> dict[str, KindUsage]:
    """Objects and bytes per kind under ``runs/<run_id>/`` (blocking: lists the store)."""
    prefix = keys.run(run_id)
    found = {kind: KindUsage(objects=0, bytes=0) for kind in KINDS}
    listed = [
        (keys.kind_of(b.key.removeprefix(prefix)), b.nbytes) for b in storage.list_blobs(prefix)
    ]
    listed += [("unfinished", b.nbytes) for b in storage.list_unfinished(prefix)]
    for kind, nbytes in listed:
        found[kind].objects += 1
        found[kind].bytes += nbytes
    return found


# the latest listing of each run's prefix: (store, run) -> (time.monotonic(), when, kinds).
# Anyone may ask, and a listing costs the store one LIST request per 1000 keys: within
# max_age_s the answer is the previous one, and one listing runs at a time
_LISTED: dict[tuple[str, str], tuple[float, datetime, dict[str, KindUsage]]] = {}
_LISTING = asyncio.Lock()


async def listed(
    storage: Storage, run_id: str, *, max_age_s: float
) -> tuple[datetime, dict[str, KindUsage]]:
    """``usage`` as of at most ``max_age_s`` ago, and when it was listed."""
    key = (storage.url, run_id)
    async with _LISTING:
        hit = _LISTED.get(key)
        if hit is not None and time.monotonic() - hit[0] < max_age_s:
            return hit[1], hit[2]
        kinds = await asyncio.to_thread(usage, storage, run_id)
        if len(_LISTED) >= 1024:
            _LISTED.clear()
        _LISTED[key] = (time.monotonic(), datetime.now(UTC), kinds)
        return _LISTED[key][1], kinds
