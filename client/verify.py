"""Audits by replay, the verifier's side (``diloco verify``; docs/verification.md).

A lease is trained again here as the volunteer's client trained it: the same
``LocalTrainer`` from the lease's base version, on its data and seed, for the steps the
upload says it took, from the AdamW state it began from (revealed and checked against the
SHA-256 the upload committed to, or fresh), in its precision and micro-batch; the result is
encoded by the run's codec with the revealed error-feedback residual, as the volunteer's
was. ``compare`` then measures the replayed update against the uploaded one
(``diloco.protocol.audit.Verdict``).

What cannot be replayed is one of two things, and the difference matters: ``Unverifiable``
(nothing to hold against the volunteer: the blob is past retention, the run lets
volunteers train ahead) is never reported to the server; ``VolunteerFault`` (the state it
revealed does not load for this run's model) fails the audit.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from client.api import ServerAPI
from client.fetch import Fetcher
from client.lease import parse_lease
from client.optimizer_state import OptimizerStateError
from client.progress import Reporter
from client.training import DivergedError, LocalTrainer
from diloco.config import parse_config
from diloco.precision import PrecisionError
from diloco.protocol.audit import Verdict
from diloco.wire.codec import EncodedTensor, codec_from_description
from diloco.wire.contribution import WireFormatError, checked_decode, decode_contribution
from diloco.wire.header import FRESH


@dataclass(frozen=True)
class Unverifiable:
    """Why this lease cannot be replayed, through no fault of the volunteer's."""

    why: str


@dataclass(frozen=True)
class VolunteerFault:
    """Why this lease cannot be replayed, by the volunteer's doing: the audit fails."""

    why: str


Finding = Verdict | Unverifiable | VolunteerFault


def compare(replayed: Mapping[str, torch.Tensor], uploaded: Mapping[str, torch.Tensor]) -> Verdict:
    """Cosine, relative error and norm ratio of the replayed update against the uploaded
    one, over every parameter, accumulated in float64."""
    dot = rr = uu = diff = 0.0
    for name, u in uploaded.items():
        r, u64 = replayed[name].double().flatten(), u.double().flatten()
        dot += float(r @ u64)
        rr += float(r @ r)
        uu += float(u64 @ u64)
        diff += float(((r - u64) ** 2).sum())
    ru, un = math.sqrt(rr), math.sqrt(uu)
    if un == 0.0:  # an all-zero upload: reproduced only by an all-zero replay
        return Verdict(1.0 if ru == 0.0 else 0.0, 0.0 if ru == 0.0 else math.inf, math.inf)
    cosine = dot / (ru * un) if ru > 0.0 else 0.0
    return Verdict(max(-1.0, min(1.0, cosine)), math.sqrt(diff) / un, ru / un)


def _decoded(
    codec_description: dict[str, Any], tensors: Mapping[str, EncodedTensor]
) -> dict[str, torch.Tensor]:
    codec = codec_from_description(codec_description)
    return {name: checked_decode(name, codec, t) for name, t in tensors.items()}


async def replay(
    api: ServerAPI,
    entry: Mapping[str, Any],
    *,
    device: torch.device,
    say: Reporter,
    workdir: Path | None = None,
) -> Finding:
    """Train the lease of a ledger entry (``GET …/rounds/{i}/ledger/{contributor}``) again
    and compare with its upload."""
    record, blob, state = entry.get("replay"), entry.get("contribution"), entry.get("state")
    if record is None:
        return Unverifiable(
            "the upload carries no replay record (its volunteer trained ahead of the lease, "
            "which a run with [inner] overlap allows)"
        )
    if blob is None:
        return Unverifiable("the upload's blob is no longer kept (the run's retention)")
    if record["start"] != FRESH and state is None:
        return Unverifiable(
            "the lease began from an AdamW state the server does not hold (only audited "
            "uploads reveal theirs, and a passed audit's is deleted)"
        )
    lease = parse_lease(entry["lease"])
    cfg = parse_config(dict(lease.config))
    with tempfile.TemporaryDirectory(prefix="diloco-verify-", dir=workdir) as tmp:
        root = Path(tmp)
        fetcher = Fetcher(api, say, root)
        params, shard = await fetcher.inputs(lease, cfg.model.block_size)
        body_path = await fetcher.file(
            "the upload", blob["url"], root / "upload.bin", blob["sha256"]
        )
        state_path = None
        if state is not None:
            state_path = await fetcher.file(
                "the revealed AdamW state",
                state["url"],
                root / "start.safetensors",
                state["sha256"],
            )
        try:
            meta, uploaded = decode_contribution(body_path.read_bytes())
        except WireFormatError as err:
            return VolunteerFault(f"the stored upload does not decode: {err}")
        return await asyncio.to_thread(
            _train_again, lease, params, shard, state_path, record, meta.inner_steps,
            _decoded(meta.codec, uploaded), device,
        )  # fmt: skip


def _train_again(
    lease: Any,
    params: dict[str, torch.Tensor],
    shard: torch.Tensor,
    state_path: Path | None,
    record: Mapping[str, Any],
    steps: int,
    uploaded: dict[str, torch.Tensor],
    device: torch.device,
) -> Finding:
    try:
        local = LocalTrainer(
            device, precision=str(record["precision"]), micro_batch=int(record["micro_batch"])
        )
    except PrecisionError as err:
        return Unverifiable(f"this machine cannot train in the upload's precision: {err}")
    local.prepare(lease.config)
    if state_path is not None:
        try:
            local.restore_state(state_path, run_id=lease.run_id)
        except OptimizerStateError as err:
            return VolunteerFault(f"the revealed AdamW state does not load: {err}")
    result = local.train(
        lease,
        params,
        shard,
        on_step=lambda done, loss, tokens: None,
        stop=lambda: False,
        until=lambda done: "replayed" if done >= steps else None,
    )
    try:
        body = local.contribution(lease, params, result)
    except DivergedError as err:
        return VolunteerFault(f"training from the revealed state diverges: {err}")
    replayed = _decoded(body.meta.codec, body.tensors)
    return compare(replayed, uploaded)
