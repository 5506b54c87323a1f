"""Which data a simulated worker trains on in a round (``SimOptions.batches``).

- ``worker``: worker i draws random windows from shard i with its own generator, kept
  across rounds (the simulator's original dealing; published GPT benchmarks use it).
- ``lease``: as the platform deals it. On a text run the round's i-th lease trains on the
  shard and with the seed :func:`diloco.protocol.rules.assign_lease` gives it (random
  windows of the shard, a fresh generator per round). On a prepared dataset each lease takes
  a data unit as the server's ``PICK_UNIT`` does (:class:`diloco.data.units.UnitDealer`: the
  least trained, then least handed out, then first in the run seed's order), and reads each
  of its windows once in an order seeded by the lease (``diloco.data.text.range_batches``,
  as the client does); a unit counts as trained when its upload reaches the server.

``ddp`` and ``single`` deal the same way: with ``lease``, ddp's K ranks each take a lease
per round and step together on their batches; single is one volunteer taking every lease.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from diloco.config import RunConfig
from diloco.data.text import AHEAD_SEED, Dataset, lease_stream, random_batch
from diloco.data.units import UnitDealer, plan_units
from diloco.outer.scoring import Picks, WindowPicker, Windows, lease_picks
from diloco.protocol.rules import assign_lease
from diloco.protocol.state import LeaseAssignment

Batch = tuple[torch.Tensor, torch.Tensor]


def stream_generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def batch_source(shard: torch.Tensor, cfg: RunConfig, gen: torch.Generator) -> Callable[[], Batch]:
    def next_batch() -> Batch:
        return random_batch(
            shard, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size, generator=gen
        )

    return next_batch


def lease_batches(
    data: Dataset,
    cfg: RunConfig,
    lease: LeaseAssignment,
    units: Units | None = None,
    unit: int | None = None,
    *,
    ahead: bool = False,
) -> Callable[[], Batch]:
    """A lease's batches, as the volunteer client draws them (``lease_stream``): each window
    of its data ``unit`` once on a dataset run, else random windows of its shard; either
    way from a generator seeded with its seed, fresh for the round. ``ahead``: the batches
    of the steps trained ahead after it (``[inner] overlap``): the same data again, pass
    after pass, in an order of their own."""
    seed = lease.seed + AHEAD_SEED if ahead else lease.seed
    if unit is not None:
        assert units is not None, "a lease with a unit comes from a dataset's units"
        tokens = units.tensors[unit]
    else:
        tokens = data.shards[lease.shard]
    return lease_stream(
        tokens,
        ranged=unit is not None,
        batch_size=cfg.inner.batch_size,
        block_size=cfg.model.block_size,
        seed=seed,
        repeat=ahead,
    )


class Units:
    """A prepared dataset's data units as tensors, dealt to leases in the server's order."""

    def __init__(self, data: Dataset, cfg: RunConfig, seed: int) -> None:
        assert data.train is not None, "units are a prepared dataset's"
        offsets = [0, *accumulate(data.shard_tokens)]  # each shard's first token in train
        length = cfg.lease_tokens + 1
        self.tensors = [
            data.train[offsets[shard] + start : offsets[shard] + start + length]
            for shard, start in plan_units(data.shard_tokens, length)
        ]
        if not self.tensors:
            raise ValueError(f"no shard of the dataset holds a unit of {length} tokens")
        self.cfg = cfg
        self.dealer = UnitDealer(len(self.tensors), seed)

    @classmethod
    def of(cls, data: Dataset, cfg: RunConfig, seed: int) -> Units | None:
        """The units of a prepared dataset; None for a text run (leases take shards)."""
        return None if data.train is None else cls(data, cfg, seed)

    def pick(self) -> int:
        return self.dealer.pick()

    def trained(self, unit: int) -> None:
        self.dealer.record(unit)


@dataclass
class Dealt:
    """One worker's data for one round; the windows its scoring reads are kept as it draws
    them (``own``)."""

    source: Callable[[], Batch]
    unit: int | None = None  # the data unit of a dataset run's lease
    picks: Picks = field(default_factory=dict)  # the windows the close scores it on
    picker: WindowPicker = field(init=False)

    def __post_init__(self) -> None:
        self.picker = WindowPicker(self.picks)

    def next_batch(self) -> Batch:
        batch = self.source()
        self.picker.take(batch)
        return batch

    def own(self) -> Windows | None:
        """The windows of ``picks`` it trained on (the close scores the upload on them, as the
        server reads them again from the lease's stream); None when it drew none of them."""
        return self.picker.windows()


class Dealer:
    """Deals each (round, worker) its batches, per ``batches`` (see the module's doc)."""

    def __init__(
        self, data: Dataset, cfg: RunConfig, *, batches: str, seed: int, workers: int
    ) -> None:
        if batches not in ("worker", "lease"):
            raise ValueError(f"batches must be worker or lease, got {batches!r}")
        self.data, self.cfg, self.batches, self.seed = data, cfg, batches, seed
        n = min(workers, len(data.shards)) if batches == "worker" else 0
        self.streams = [
            batch_source(data.shards[i], cfg, stream_generator(seed, i)) for i in range(n)
        ]
        self.units = Units.of(data, cfg, seed) if batches == "lease" else None

    def deal(self, round: int, worker: int, secret: int | None = None) -> Dealt:
        """Worker ``worker``'s (from 0) batches for round ``round`` (from 1); with the round's
        ``secret`` (its check seed) the windows its scoring reads are kept (``lease_picks``:
        the lease's seed, or the worker's number where it keeps one stream)."""
        if self.batches == "worker":
            return Dealt(self.streams[worker], picks=self._picks(secret, worker))
        n_shards = len(self.data.shards)
        lease = assign_lease(worker, round=round, run_seed=self.seed, n_shards=n_shards)
        unit = None if self.units is None else self.units.pick()
        batches = lease_batches(self.data, self.cfg, lease, self.units, unit)
        return Dealt(batches, unit, self._picks(secret, lease.seed))

    def _picks(self, secret: int | None, lease: int) -> Picks:
        if secret is None or not self.cfg.aggregation.score_windows:
            return {}
        return lease_picks(self.cfg, steps=self.cfg.inner.steps, secret=secret, lease=lease)

    def trained(self, dealt: Dealt) -> None:
        """The worker's upload reached the server: its unit is covered."""
        if dealt.unit is not None and self.units is not None:
            self.units.trained(dealt.unit)
