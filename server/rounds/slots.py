"""How many uploads this process receives at once: at most ``max_uploads_in_flight`` in all,
and ``max_uploads_per_contributor`` for any one contributor.

An upload holds a connection, a temp blob and a decoder while it streams; a contributor
that opens a hundred at once (or a botnet that opens thousands) would hold that many. A
slot is taken before the body is read and given back in a ``finally`` whatever the upload
does (accepted, refused, dropped by ``server.http.body_timeout``, its client gone); past a cap
the answer is ``429 too_many_uploads`` with ``Retry-After``. The counts are this
process's: several API processes (``--role api``) each have their own.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from server.http.errors import TooManyUploads

RETRY_AFTER_S = 5.0  # what a refused uploader is told to wait before sending again


class UploadSlots:
    """Counts of the uploads in flight; the event loop is the only writer (no lock)."""

    def __init__(self, *, total: int, per_contributor: int) -> None:
        self.total = total
        self.per_contributor = per_contributor
        self.in_flight = 0
        self.by_contributor: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, contributor_id: str) -> Iterator[None]:
        """A slot for one upload of ``contributor_id`` while the block runs; raises
        ``TooManyUploads`` (and holds nothing) when a cap is reached."""
        if self.by_contributor[contributor_id] >= self.per_contributor:
            raise TooManyUploads(
                f"you already have {self.per_contributor} uploads in flight, the most one "
                "contributor may; retry when one has finished",
                retry_after_s=RETRY_AFTER_S,
            )
        if self.in_flight >= self.total:
            raise TooManyUploads(
                f"the server is receiving {self.total} uploads, the most it takes at once; "
                "retry shortly",
                retry_after_s=RETRY_AFTER_S,
            )
        self.in_flight += 1
        self.by_contributor[contributor_id] += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.by_contributor[contributor_id] -= 1
            if not self.by_contributor[contributor_id]:
                del self.by_contributor[contributor_id]
