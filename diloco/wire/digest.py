"""A SHA-256 of bytes met one piece after the other: taken as they go by, or later.

Hashing is the costliest part of checking an upload (two SHA-256s of every byte: the
body's, against its trailer, and the payload's, for replays). With ``later`` the pieces
are kept, not hashed: views into the caller's chunks, which therefore must not change
(``bytes``); ``work`` hands out those due since the last call and ``run`` hashes them, the
calls in the order the work was taken, on any thread (hashlib lets go of the GIL). So a
server hashes one batch of an upload on other threads while the next one is decoded
(``server.rounds.ingest``), and each digest stays the SHA-256 of the same bytes in the same
order: one definition, whichever thread takes it.
"""

from __future__ import annotations

import hashlib
from typing import Any

Part = bytes | bytearray | memoryview


class StreamDigest:
    def __init__(self, *, later: bool = False) -> None:
        self._sha = hashlib.sha256()
        self._due: list[Part] | None = [] if later else None

    @property
    def later(self) -> bool:
        return self._due is not None

    def update(self, part: Part) -> None:
        if self._due is None:
            self._sha.update(part)
        else:
            self._due.append(part)

    def work(self) -> list[Part]:
        """``later``: the parts due since the last call, in order (none: an empty list)."""
        if self._due is None:
            return []
        work, self._due = self._due, []
        return work

    def run(self, work: list[Part]) -> None:
        """Hash ``work`` (``work``'s lists, run in the order they were taken)."""
        for part in work:
            self._sha.update(part)

    def done(self) -> Any:
        """The hash object, once nothing is due (copy it before updating it further)."""
        assert not self._due, "parts are still due: take work() and run() it first"
        return self._sha
