"""Make real contributions in the test process: the same library calls a volunteer makes.

Used where a test needs control over what is uploaded (bad input, the crash-and-restart
reference check); the end-to-end tests run the real ``diloco join`` processes instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file as load_params

from diloco.checkpoint import MOMENTUM_PREFIX, RESIDUAL_PREFIX
from diloco.config import RunConfig, parse_config
from diloco.data.text import random_batch
from diloco.model.gpt import GPT
from diloco.outer.fold import FoldPlan
from diloco.outer.inspection import UploadInspector
from diloco.outer.optimizer import pseudo_gradient
from diloco.outer.robust import Source, robust_aggregate
from diloco.protocol.reputation import counted_weight, standing
from diloco.protocol.rules import upload_weight
from diloco.train import InnerTrainer, load_parameters, snapshot
from diloco.wire.codec import EncodedTensor
from diloco.wire.contribution import ContributionMeta, decode_contribution, encode_contribution
from diloco.wire.delta import DeltaCodec, apply_change, publish_change
from diloco.wire.exchange import codec_for, delta_codec_for, encode_delta
from diloco.wire.header import FRESH, ReplayRecord
from diloco.wire.tensorfile import TensorFileReader
from tests.support.live import wait_for

API = "/api/v1"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def post_run(
    http: httpx.Client,
    config: Mapping[str, Any],
    data: bytes | None = None,
    *,
    token: str | None = None,
) -> httpx.Response:
    """``POST /runs`` with a generated corpus unless ``data`` is given, as the admin or, with
    ``token``, as that run owner; the answer, whatever it is."""
    from tests.conftest import make_corpus
    from tests.support.live import admin_headers

    return http.post(
        f"{API}/runs",
        data={"config": json.dumps(dict(config))},
        files={"data": ("corpus.txt", data or make_corpus(120_000).encode(), "text/plain")},
        headers=admin_headers() if token is None else auth(token),
    )


def create_run(
    http: httpx.Client,
    config: Mapping[str, Any],
    data: bytes | None = None,
    *,
    token: str | None = None,
) -> dict[str, Any]:
    """``post_run``'s created run (the 201 is asserted)."""
    r = post_run(http, config, data, token=token)
    assert r.status_code == 201, r.text
    return dict(r.json())


def account(http: httpx.Client, name: str) -> tuple[str, str]:
    """A new account: (its id, its token)."""
    r = http.post(f"{API}/contributors", json={"name": name})
    assert r.status_code == 201, r.text
    return str(r.json()["id"]), str(r.json()["token"])


def owner(http: httpx.Client, name: str) -> tuple[str, str]:
    """A new account the admin made a run owner: (its id, its token)."""
    from tests.support.live import admin_headers

    cid, token = account(http, name)
    r = http.post(
        f"{API}/contributors/{cid}/roles", json={"role": "owner"}, headers=admin_headers()
    )
    assert r.status_code == 200 and "owner" in r.json()["roles"], r.text
    return cid, token


def register(http: httpx.Client, name: str) -> str:
    r = http.post(f"{API}/contributors", json={"name": name})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


@dataclass
class Work:
    """One volunteer's finished round, ready to upload (and to encode again, bit for bit)."""

    lease: dict[str, Any]
    meta: ContributionMeta
    encoded: dict[str, EncodedTensor]
    delta: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # before the codec

    def body(self, **meta_changes: Any) -> bytes:
        meta = self.meta
        if meta_changes:
            meta = ContributionMeta(**{**meta.__dict__, **meta_changes})
        return b"".join(encode_contribution(meta, self.encoded))


def fetch_params(http: httpx.Client, url: str) -> dict[str, torch.Tensor]:
    """A version's parameters: a lease's URL is the bucket's, or this server's while they
    are pending (it redirects to the bucket once they are durable)."""
    r = http.get(url, follow_redirects=True)
    assert r.status_code == 200, r.text
    return safetensors_load(r.content)


def train(
    http: httpx.Client,
    token: str,
    run_id: str,
    *,
    steps: int | None = None,
    start: dict[str, torch.Tensor] | None = None,
    seed: int | None = None,
) -> Work:
    """join -> download -> H AdamW steps -> Δ -> int8, as the volunteer client does. What
    a cheat does instead: ``start``, train from these parameters (an older version: a
    stale base) and send the change as if from the lease's; ``seed``, draw the batches
    with this seed instead of the lease's (other data than it was given)."""
    r = http.post(f"{API}/runs/{run_id}/join", headers=auth(token))
    assert r.status_code == 200, r.text
    lease = r.json()
    cfg = parse_config(lease["config"])
    base = start if start is not None else fetch_params(http, lease["checkpoint"]["url"])
    raw = http.get(lease["shard"]["url"]).content
    shard = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    shard = shard.view(-1, lease["shard"]["chunk_len"])
    torch.manual_seed(0)
    trainer = InnerTrainer(
        GPT(cfg.model.gpt_config()),
        cfg.inner,
        total_steps=cfg.total_inner_steps,
        device=torch.device("cpu"),
    )
    load_parameters(trainer.model, base)
    gen = torch.Generator().manual_seed(lease["seed"] if seed is None else seed)
    h = steps or lease["inner_steps"]
    result = trainer.run(
        h,
        start_step=lease["start_step"],
        next_batch=lambda: random_batch(
            shard, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size, generator=gen
        ),
    )
    delta = pseudo_gradient(base, snapshot(trainer.model))
    encoded, codec, _ = encode_delta(delta, cfg.compression)
    meta = ContributionMeta(
        run_id=run_id,
        round=lease["round"],
        base_version=lease["base_version"],
        tokens=result.tokens,
        inner_steps=h,
        loss=result.mean_loss,
        codec=codec,
        # a new InnerTrainer each call: the lease begins fresh, in fp32, in one pass
        replay=ReplayRecord(FRESH, "fp32", cfg.inner.batch_size),
    )
    return Work(lease=lease, meta=meta, encoded=encoded, delta=delta)


def upload(http: httpx.Client, token: str, work: Work, body: bytes | None = None) -> httpx.Response:
    lease = work.lease
    return http.put(
        f"{API}/runs/{lease['run_id']}/rounds/{lease['round']}/contribution",
        content=work.body() if body is None else body,
        headers={**auth(token), "Content-Type": "application/octet-stream"},
    )


@dataclass
class Reference:
    """A version as the server must publish it: parameters, momentum, delta residual."""

    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    residual: dict[str, torch.Tensor]


def read_outer_state(path: Path) -> Reference:
    """A version's state file as a ``Reference`` (``params`` empty: they are not in it)."""
    with TensorFileReader(path) as f:
        by = {e: f.tensor(e) for e in f.entries}
    return Reference(
        {},
        {
            n.removeprefix(MOMENTUM_PREFIX): t
            for n, t in by.items()
            if n.startswith(MOMENTUM_PREFIX)
        },
        {
            n.removeprefix(RESIDUAL_PREFIX): t
            for n, t in by.items()
            if n.startswith(RESIDUAL_PREFIX)
        },
    )


def reference_step(
    run: Mapping[str, Any],
    base: Mapping[str, torch.Tensor],
    works: list[Work],
    state: Reference | None = None,
    *,
    staleness: Sequence[int] = (),
    standings: Sequence[float] = (),
    round: int | None = None,
    history: Sequence[float] = (),
) -> Reference:
    """What the server must compute for a round from these uploads (in the order they were
    accepted): ``reference_close`` of their bodies, each weighted by the tokens it counts
    for (late work: discounted by its ``staleness``, one per work, 0 when not given; times
    its contributor's standing then, one per work, a new account's when not given).
    ``round``: the round whose step it is (default: the first work's)."""
    cfg = parse_config(run["config"])
    stale = list(staleness) or [0] * len(works)
    earned = list(standings) or [standing(0, 0)] * len(works)
    bodies = [
        (work.body(), counted_weight(upload_weight(work.meta.tokens, cfg.lease_tokens), s, e))
        for work, s, e in zip(works, stale, earned, strict=True)
    ]
    return reference_close(
        cfg, base, bodies, round=round or works[0].lease["round"], state=state, history=history
    )


def reference_close(
    cfg: RunConfig,
    base: Mapping[str, torch.Tensor],
    bodies: Sequence[tuple[bytes, float]],
    *,
    round: int,
    state: Reference | None = None,
    history: Sequence[float] = (),
) -> Reference:
    """A round's close from its uploads' bodies and weights (in the order they were
    accepted), with whole tensors and the library's in-memory aggregate: each body
    inspected as ingest does (its norm), the run's robust aggregate, one outer step at
    round ``round``'s lr from the base version's momentum and residual (``state``; none for
    round 1), published through the run's delta codec (``diloco.wire.delta``). ``history``:
    the norms of the run's earlier aggregated contributions, the clipping's reference in a
    small round, and a folded round's (``diloco.outer.fold``)."""
    shapes = {n: tuple(p.shape) for n, p in base.items()}
    codec = codec_for(cfg.compression).describe()
    sources = []
    for i, (body, weight) in enumerate(bodies):
        _, encoded = decode_contribution(body, shapes, codec=codec)
        inspector = UploadInspector(codec)
        for name, tensor in encoded.items():
            inspector.add(name, tensor)
        sources.append(Source(str(i), float(weight), inspector.norm, lambda body=body: [body]))
    aggregate = robust_aggregate(
        sources, shapes=shapes, codec=codec, policy=cfg.aggregation, history=list(history),
        fold=FoldPlan.of_run(cfg, history),
    )  # fmt: skip
    return outer_reference(
        base,
        aggregate.delta,
        # the round's outer lr, as the server takes it (OuterSection.lr_at)
        hyper=(
            cfg.outer.lr_at(round, cfg.rounds.max_rounds),
            cfg.outer.momentum,
            cfg.outer.nesterov,
        ),
        codec=delta_codec_for(cfg.compression),
        state=state,
    )


def outer_reference(
    base: Mapping[str, torch.Tensor],
    delta: Mapping[str, torch.Tensor],
    *,
    hyper: tuple[float, float, bool],
    codec: DeltaCodec,
    state: Reference | None = None,
) -> Reference:
    """The tests' one reference of the outer step, in plain torch: ``torch.optim.SGD``
    (Nesterov as configured) with the aggregate ``delta`` as the gradient, from the base's
    momentum and residual (``state``; none for the first step), published through the
    delta in ``codec`` with error feedback. The optimizer steps the residual r, so that
    r − lr·u is the value d to publish; θ moves by decode(quantise(d)) and r keeps d − that."""
    lr, momentum, nesterov = hyper
    residual = {
        n: (
            torch.zeros(t.numel()) if state is None else state.residual[n].reshape(-1).clone()
        ).requires_grad_(True)
        for n, t in base.items()
    }
    sgd = torch.optim.SGD(
        list(residual.values()), lr=lr, momentum=momentum, nesterov=nesterov, foreach=False
    )
    for n, r in residual.items():
        r.grad = delta[n].reshape(-1).float().clone()
        if state is not None:
            sgd.state[r]["momentum_buffer"] = state.momentum[n].reshape(-1).clone()
    sgd.step()
    out = Reference({}, {}, {})
    with torch.no_grad():
        for name, theta in base.items():
            r = residual[name]
            _, change = publish_change(r.detach().clone(), codec)
            new = theta.reshape(-1).float().clone()
            apply_change(new, change)
            r.sub_(change)
            out.params[name] = new.view(theta.shape)
            # no momentum (μ = 0): SGD keeps no buffer; the state file holds m = g then
            buffer = sgd.state[r].get("momentum_buffer", r.grad)
            out.momentum[name] = buffer.clone().view(theta.shape)
            out.residual[name] = r.detach().clone().view(theta.shape)
    return out


def close_rounds(http: httpx.Client, token: str, run_id: str, n: int) -> None:
    """Rounds 1..n close, one upload each; round n + 1 stays open on version n."""
    for index in range(1, n + 1):
        work = train(http, token, run_id, steps=1)
        assert upload(http, token, work).status_code == 201

        def closed(i: int = index) -> bool:
            return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"]) == i

        wait_for(closed, timeout=120, what=f"round {index} to close")


def assert_reference_closes(database_url: str, blobs: Path, run_id: str, cfg: RunConfig) -> int:
    """Every published version of the run is, bit for bit, the reference close of its
    round's stored uploads, each weighed as the server counts it (``counted_weight``: its
    staleness and its contributor's standing then; the exact sum's grid depends on the
    weights themselves) and clipped against the history the server had; the number of
    versions checked. Waits first for the versions' full files, which the server writes
    after it publishes (docs/protocol.md, "Delta first")."""
    from tests.support.pg import rows

    pending = "SELECT version FROM checkpoints WHERE run_id = $1 AND full_files_at IS NULL"
    wait_for(
        lambda: not rows(database_url, pending, run_id),
        timeout=60,
        what="every published version's parameters and outer state to be durable",
    )
    uploads = rows(
        database_url,
        "SELECT round_index, blob_key, weight, staleness, standing, norm FROM contributions "
        "WHERE run_id = $1 AND aggregated_at IS NOT NULL ORDER BY created_at, id",
        run_id,
    )
    folder = blobs / "runs" / run_id / "checkpoints"
    history: list[float] = []
    versions = max(u["round_index"] for u in uploads)
    for v in range(1, versions + 1):
        base = load_params(folder / f"{v - 1}.safetensors")
        state = read_outer_state(folder / f"{v - 1}.state.safetensors") if v > 1 else None
        mine = [u for u in uploads if u["round_index"] == v]
        bodies = [
            (
                (blobs / u["blob_key"]).read_bytes(),
                float(counted_weight(u["weight"], u["staleness"], u["standing"] or 1.0)),
            )
            for u in mine
        ]
        want = reference_close(cfg, base, bodies, round=v, state=state, history=history)
        published = load_params(folder / f"{v}.safetensors")
        assert published.keys() == want.params.keys(), v
        assert all(torch.equal(published[k], want.params[k]) for k in want.params), v
        history += [float(u["norm"]) for u in mine]
    return versions
