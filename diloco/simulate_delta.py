"""Delta downloads in the simulator (``diloco simulate --downloads delta``).

Every version v the hub publishes also has an int8 delta from v−1 (:mod:`diloco.delta`),
and the *published* parameters θ are defined by those deltas; the outer optimizer keeps
the exact parameters x as it always has. With ``publish_change`` and ``apply_change``, the
very functions the server uses:

    θ_0 = x_0
    d_v = x_v − θ_{v−1}                    (per tensor, flat fp32)
    q_v, change = publish_change(d_v),  θ_v = θ_{v−1} + change

Error feedback is in d_v: what the quantisation of v left out is still in x_v − θ_{v−1}
and goes out with the next delta, so ‖x − θ‖ stays of the size of one round's
quantisation error. Workers start each round from θ; their Δ = θ − θ_worker_end steps x.
A worker that holds θ_{v−1} downloads one delta file (1 byte a parameter, plus one fp32
scale per block) instead of the fp32 checkpoint (4 bytes a parameter).

Every round publishes a version, a step or not (without one the delta carries only what
x − θ still holds). ``Ledger`` counts what each worker downloads: nothing when it holds the
version, the deltas since the one it holds when they are fewer bytes than the checkpoint
(``diloco.delta.catch_up``, as a volunteer decides), else the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco.codec import EncodedTensor, Int8Codec
from diloco.delta import apply_change, catch_up, entries, metadata, publish_change, write_delta
from diloco.simulate_server import SIM_RUN_ID
from diloco.tensorfile import layout

Params = Mapping[str, torch.Tensor]


@dataclass
class DeltaReport:
    """What delta downloads cost and what they changed (``SimResult.delta``)."""

    checkpoint_bytes: int  # the fp32 checkpoint a worker would download instead
    delta_bytes: int  # the last version's delta file: a returning worker's download a round
    final_eval_loss_outer: float | None = None  # x's (the exact outer parameters), for info
    residual_norms: list[float] = field(default_factory=list)  # ‖x − θ‖ after each publication


def delta_nbytes(shapes: Mapping[str, tuple[int, ...]], codec: Int8Codec, *, version: int) -> int:
    """The exact size of the delta file ``diloco.delta.write_delta`` writes for ``version``
    (header and metadata included: the metadata spells the version out)."""
    names = list(shapes)
    meta = metadata(
        run_id=SIM_RUN_ID, version=version, base_version=version - 1, names=names, codec=codec
    )
    listed = entries(shapes, codec)
    head, _ = layout(listed, meta)
    return len(head) + sum(e.nbytes for e in listed)


class Publisher:
    """θ, the published parameters: θ_0 = x_0, then one int8 delta per published version
    (written to ``directory`` as ``delta-<version>.safetensors`` when one is given)."""

    def __init__(self, x0: Params, codec: Int8Codec, directory: Path | None = None) -> None:
        self.codec, self.directory = codec, directory
        self.theta = {n: t.detach().float().clone().contiguous() for n, t in x0.items()}
        self.shapes = {n: tuple(t.shape) for n, t in self.theta.items()}
        self.version = 0
        self.sizes: dict[int, int] = {}  # each version's delta file, in bytes
        self.residual_norms: list[float] = []  # ‖x − θ‖ after each version

    @torch.no_grad()
    def publish(self, x: Params) -> dict[str, EncodedTensor]:
        """Publish the next version towards the exact parameters ``x``: θ moves by the
        decoded delta; returns the delta (each tensor with its parameter's shape, as
        ``write_delta`` stores it)."""
        encoded: dict[str, EncodedTensor] = {}
        for name, theta in self.theta.items():
            flat = theta.view(-1)  # (N,)
            d = x[name].detach().float().reshape(-1) - flat  # (N,) the wanted change
            q, change = publish_change(d, self.codec)
            apply_change(flat, change)
            encoded[name] = EncodedTensor(self.shapes[name], q.data, q.scales)
        self.version += 1
        v = self.version
        self.sizes[v] = delta_nbytes(self.shapes, self.codec, version=v)
        self.residual_norms.append(self.residual_norm(x))
        if self.directory is not None:
            path = self.directory / f"delta-{v:06d}.safetensors"
            write_delta(
                path, encoded, run_id=SIM_RUN_ID, version=v, base_version=v - 1, codec=self.codec
            )
        return encoded

    @torch.no_grad()
    def residual_norm(self, x: Params) -> float:
        """‖x − θ‖₂ over all parameters: what the published θ has not caught up with yet."""
        sq = sum(float((x[n].float() - t).pow(2).sum()) for n, t in self.theta.items())
        return sq**0.5

    def report(self, checkpoint_bytes: int) -> DeltaReport:
        last = self.sizes.get(self.version) or delta_nbytes(self.shapes, self.codec, version=1)
        return DeltaReport(checkpoint_bytes, last, residual_norms=list(self.residual_norms))


class Ledger:
    """What workers download: each one's version held, and a fetch of a newer one costs the
    deltas from it when they add up to fewer bytes than the checkpoint (``catch_up``, as
    the client decides), else the checkpoint; nothing when it holds the version."""

    def __init__(self, publisher: Publisher, checkpoint_bytes: int) -> None:
        self.publisher, self.checkpoint_bytes = publisher, checkpoint_bytes
        self.held: dict[str, int] = {}
        self.bytes = 0

    def fetch(self, who: str, version: int) -> None:
        have = self.held.get(who, -1)
        if have != version:
            sizes = self.publisher.sizes
            wanted = catch_up(have, version, full_nbytes=self.checkpoint_bytes, delta_nbytes=sizes)
            self.bytes += self.checkpoint_bytes if wanted is None else sum(sizes[v] for v in wanted)
        self.held[who] = version
