"""Delta downloads in the simulator (``diloco simulate --downloads delta``).

Every version the close publishes has an int8 delta from the version before
(``diloco.wire.delta``), written by the close itself beside the parameters
(``diloco.simulate.versions``), as on the server; the published parameters θ are the base's
plus the decoded delta, what the quantisation left out is carried in the residual r, and
θ + r is the exact Nesterov iterate x. Workers start each round from θ whatever they
download (the fp32 checkpoint holds θ too, as the server's does): ``downloads`` says what
they are counted to download. A worker that holds θ_{v−1} downloads one delta file (1 byte
a parameter, plus one fp32 scale per block) instead of the fp32 checkpoint (4 bytes a
parameter).

``Ledger`` counts what each worker downloads: nothing when it holds the version, the deltas
since the one it holds when they are fewer bytes than the checkpoint
(``diloco.wire.delta.catch_up``, as a volunteer decides), else the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco.wire.delta import catch_up


@dataclass
class DeltaReport:
    """What delta downloads cost (``SimResult.delta``)."""

    checkpoint_bytes: int  # the fp32 checkpoint a worker would download instead
    delta_bytes: int  # the last version's delta file: a returning worker's download a round
    final_eval_loss_outer: float | None = None  # x = θ + r's, for information
    residual_norms: list[float] = field(default_factory=list)  # ‖x − θ‖ after each version


class Ledger:
    """What workers download: each one's version held, and a fetch of a newer one costs the
    deltas from it when they add up to fewer bytes than the checkpoint (``catch_up``, as
    the client decides), else the checkpoint; nothing when it holds the version.
    ``sizes``: each published version's delta file, in bytes (kept up to date by the
    caller)."""

    def __init__(self, sizes: Mapping[int, int], checkpoint_bytes: int) -> None:
        self.sizes, self.checkpoint_bytes = sizes, checkpoint_bytes
        self.held: dict[str, int] = {}
        self.bytes = 0

    def fetch(self, who: str, version: int) -> None:
        have = self.held.get(who, -1)
        if have != version:
            sizes = self.sizes
            wanted = catch_up(have, version, full_nbytes=self.checkpoint_bytes, delta_nbytes=sizes)
            self.bytes += self.checkpoint_bytes if wanted is None else sum(sizes[v] for v in wanted)
        self.held[who] = version
