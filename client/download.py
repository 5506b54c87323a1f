"""Resumable, verified downloads of checkpoints and shards.

A download streams into ``<dest>.part`` beside its destination. If the connection drops,
the part stays on disk, and the next attempt (in this process or after a restart) asks only
for the rest: ``Range: bytes=<have>-`` with ``If-Range: "<sha256>"``, so a server whose
file has changed since answers the whole file (200) instead of a mismatched tail. The
finished file is checked against the sha256 the server announced before it is renamed into
place; a file that does not match is discarded, part included, so the next attempt starts
from zero. A reader therefore never sees a partial or unverified file at ``dest``.

Two workers sharing one cache may race on the same part file; the sha256 check catches the
mix-up (and a retry starts over), so the worst case is a wasted download, never a bad file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from client.http import CHUNK, DownloadError, RetryableError, error_from
from diloco.atomic import commit

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass(frozen=True)
class Fetched:
    """One finished download: ``resumed_from`` bytes came from an earlier part file and
    ``transferred`` bytes over the network this time."""

    path: Path
    nbytes: int
    resumed_from: int
    transferred: int


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _hash_prefix(path: Path) -> tuple[hashlib._Hash, int]:
    """The running sha256 of a part file and its length (resume continues from there)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            size += len(block)
    return digest, size


def _resume_start(resp: aiohttp.ClientResponse, have: int) -> int:
    """Where the body of this answer starts in the file: ``have`` for a 206 that continues
    the part, 0 for a 200 (the whole file, e.g. If-Range did not match)."""
    if resp.status == 200:
        return 0
    found = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
    if resp.status != 206 or found is None or int(found.group(1)) != have:
        raise RetryableError(
            DownloadError(
                f"{resp.url} answered {resp.status} with Content-Range "
                f"{resp.headers.get('Content-Range')!r} to a request for bytes {have}-; "
                "the partial download was discarded"
            )
        )
    return have


async def fetch_once(
    session: aiohttp.ClientSession,
    url: str,
    dest: Path,
    expected_sha256: str,
    *,
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
    if_range: bool = True,
) -> Fetched:
    """One attempt: resume or start ``<dest>.part``, verify, rename to ``dest``.

    A dropped connection raises (aiohttp.ClientError / TimeoutError) with the part kept for
    the next attempt; a sha256 mismatch raises :class:`RetryableError` with the part gone.
    ``if_range=False`` for an object store's URL: its ETag is not our sha256, and its keys
    never change content (the sha256 check still catches a mix-up)."""
    part = part_path(dest)
    digest, have = _hash_prefix(part) if part.exists() else (hashlib.sha256(), 0)
    request_headers = dict(headers)
    if have:
        request_headers["Range"] = f"bytes={have}-"
        if if_range:
            request_headers["If-Range"] = f'"{expected_sha256}"'
    async with session.get(url, headers=request_headers, timeout=timeout) as resp:
        if resp.status == 416:  # the part is longer than the file: it cannot be ours
            part.unlink(missing_ok=True)
            raise RetryableError(
                DownloadError(f"{url}: the partial download did not fit the file; starting over")
            )
        if resp.status >= 400:
            raise await error_from(resp)
        start = _resume_start(resp, have) if have else 0
        if start == 0 and have:
            digest, have = hashlib.sha256(), 0  # the server sent the whole file
        resumed_from = have
        with open(part, "r+b" if start else "wb") as f:
            f.seek(start)
            f.truncate()
            async for chunk in resp.content.iter_chunked(CHUNK):
                digest.update(chunk)
                f.write(chunk)
                have += len(chunk)
    if digest.hexdigest() != expected_sha256:
        part.unlink(missing_ok=True)
        raise RetryableError(
            DownloadError(
                f"{url} arrived with sha256 {digest.hexdigest()} but the server announced "
                f"{expected_sha256}; the file was discarded. Try again; if it persists, tell "
                "the run's operator"
            )
        )
    commit(part, dest)  # fsync, rename, fsync the folder
    return Fetched(dest, have, resumed_from, have - resumed_from)
