"""A dataset run's data units, as the server deals them to leases: one definition for the
server (:mod:`server.runs.coverage`, which keeps the counts in Postgres) and the simulator
(:class:`UnitDealer`, which keeps them in memory).

A unit is ``inner.steps x batch_size x block_size + 1`` consecutive tokens of one shard of
the prepared dataset: the windows of one lease's H steps, each read once
(:func:`diloco.data.text.range_batches`). Consecutive units share their boundary token; a
shard's tail shorter than a unit is never dealt. At creation the units get a position in an
order shuffled by the run seed; a lease takes the unit least trained on, then least handed
out, then first by position, so every unit is handed out once per pass, spread over the
dataset, and a unit whose lease came to nothing goes first in the next pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_units(shard_tokens: Sequence[int], unit_tokens: int) -> list[tuple[int, int]]:
    """(shard, start) of every unit of a dataset whose shards hold ``shard_tokens``."""
    step = unit_tokens - 1
    return [
        (shard, k * step)
        for shard, tokens in enumerate(shard_tokens)
        for k in range(max(0, (tokens - 1) // step))
    ]


def unit_positions(n_units: int, seed: int) -> list[int]:
    """Each unit's position in the run's dealing order (a permutation of 0..n-1)."""
    return np.random.default_rng(seed).permutation(n_units).tolist()


class UnitDealer:
    """The server's choice of a lease's unit over in-memory counts: the unit least trained
    on, then least handed out, then first by position (``server.runs.coverage.PICK_UNIT``)."""

    def __init__(self, n_units: int, seed: int) -> None:
        if n_units < 1:
            raise ValueError("a dataset run needs at least one unit")
        self.position = np.asarray(unit_positions(n_units, seed), dtype=np.int64)
        self.issued = np.zeros(n_units, dtype=np.int64)
        self.trained = np.zeros(n_units, dtype=np.int64)

    def pick(self) -> int:
        """Hand out a unit (its index in :func:`plan_units`' list)."""
        # np.lexsort sorts by its last key first
        unit = int(np.lexsort((self.position, self.issued, self.trained))[0])
        self.issued[unit] += 1
        return unit

    def record(self, unit: int) -> None:
        """An accepted contribution trained on ``unit``."""
        self.trained[unit] += 1
