"""One hostile volunteer among honest ones, through a real server, for every attack of
``diloco.simulate.attacks``: its upload is refused or bounded, the published checkpoint is finite,
the round's update stays within a small multiple of the honest update, and refused or
excluded work earns no credit. Then the guard: with robust aggregation off, a step that an
attacker blows up is discarded and published again without it."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
import torch

from diloco.config import parse_config
from diloco.data.text import random_batch
from diloco.model.gpt import GPT
from diloco.protocol.reputation import counted_weight, standing
from diloco.simulate.attacks import ATTACKS, CHECKED, TRAINING, Attack, hostile_body
from diloco.train import load_parameters
from diloco.wire.exchange import encode_delta
from server.storage import keys
from tests.conftest import server_run_config
from tests.support.contribute import (
    API,
    Work,
    auth,
    create_run,
    fetch_params,
    read_outer_state,
    reference_step,
    register,
    train,
    upload,
)
from tests.support.live import ServerProcess, wait_for

HONEST = 4
REFUSED = {"huge_scales": (400, "non_finite"), "replay": (409, "replayed_upload")}


def update_norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a))


def finite(params: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in params.values())


def version(http: httpx.Client, run_id: str) -> int:
    return int(http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"])


def close_round(
    http: httpx.Client,
    run: dict,
    honest: list[str],
    attacker: str,
    attack: Attack | None,
    *,
    stale: Work | None = None,
    older: dict[str, torch.Tensor] | None = None,
) -> tuple[httpx.Response, list[Work], Work]:
    """Everyone joins and trains; the honest upload, then the attacker (honest too when
    ``attack`` is None; a training attack trains from ``older`` parameters or on other
    batches); the round closes."""
    works = {token: train(http, token, run["id"], steps=1) for token in honest}
    if attack == "stale_base":
        works[attacker] = train(http, attacker, run["id"], steps=1, start=older)
    elif attack == "other_data":
        works[attacker] = train(http, attacker, run["id"], steps=1, seed=12345)
    else:
        works[attacker] = train(http, attacker, run["id"], steps=1)
    before = version(http, run["id"])
    for token in honest:
        assert upload(http, token, works[token]).status_code == 201
    mine, cfg = works[attacker], parse_config(run["config"])
    body = None
    if attack is not None and attack not in TRAINING:
        body = hostile_body(
            attack,
            mine.delta,
            mine.meta,
            kind=cfg.compression.kind,
            block_size=cfg.compression.block_size,
            other_delta=works[honest[0]].delta,
            stale_delta=stale.delta if stale else None,
            peers=[works[t].delta for t in honest],
        )
    sent = upload(http, attacker, mine, body=body)
    if sent.status_code >= 400:  # refused: it stops, so the round need not wait for it
        index = mine.lease["round"]
        http.delete(f"{API}/runs/{run['id']}/rounds/{index}/lease", headers=auth(attacker))
    wait_for(lambda: version(http, run["id"]) == before + 1, timeout=60, what="the round")
    return sent, [works[t] for t in honest], mine


def credit_of(http: httpx.Client, run_id: str, index: int, name: str) -> float:
    listed = http.get(f"{API}/runs/{run_id}/rounds/{index}/contributions").json()
    return sum(c["credit"] for c in listed["contributions"] if c["contributor_name"] == name)


@pytest.mark.parametrize("attack", ATTACKS)
def test_one_attacker_is_refused_or_bounded(
    server: ServerProcess, http: httpx.Client, attack: Attack
) -> None:
    # Prepare: four honest volunteers and one attacker on a run that closes with all five
    config = server_run_config(rounds={"quorum": HONEST, "target": HONEST + 1, "max_rounds": 3})
    run = create_run(http, config)
    honest = [register(http, f"honest-{attack}-{i}") for i in range(HONEST)]
    attacker = register(http, f"attacker-{attack}")
    stale = older = None
    if attack in ("stale", "stale_base"):  # round 1 honest by all; the attacker keeps its Δ
        older = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/latest")  # and base
        _, _, stale = close_round(http, run, honest, attacker, None)
    base = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/latest")
    index = version(http, run["id"]) + 1

    # Execute
    sent, works, _ = close_round(http, run, honest, attacker, attack, stale=stale, older=older)

    # Assert: refused with its code, or taken and bounded
    if attack in REFUSED:
        status, code = REFUSED[attack]
        assert (sent.status_code, sent.json()["error"]) == (status, code), sent.text
    else:
        assert sent.status_code == 201, sent.text
    published = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/{index}")
    assert finite(published)
    moved = update_norm(published, base)
    # the honest update: computed here from the honest uploads alone (from the base
    # version's momentum: round 2, for the stale attack, carries round 1's)
    state = None
    if index > 1:
        checkpoints = server.data_dir / "blobs" / keys.checkpoints(run["id"])
        state = read_outer_state(checkpoints / f"{index - 1}.state.safetensors")
    honest_norm = update_norm(reference_step(run, base, works, state).params, base)
    assert moved <= 2.0 * honest_norm, (attack, moved, honest_norm)
    name = f"attacker-{attack}"
    if attack in REFUSED:
        assert credit_of(http, run["id"], index, name) == 0
    listed = http.get(f"{API}/runs/{run['id']}/rounds/{index}/contributions").json()
    by_name = {c["contributor_name"]: c for c in listed["contributions"]}
    if attack in CHECKED:  # the close's checks leave it out: unpaid, the reason shown
        mine = by_name[name]
        assert mine["credit"] == 0 and not mine["aggregated"], mine
        assert mine["excluded"].startswith(f"{CHECKED[attack]}: "), mine
        assert mine["checks"]["code"] == CHECKED[attack]
        me = http.get(f"{API}/contributors/me", headers=auth(attacker)).json()
        assert me["recent"][0]["excluded"].startswith(f"{CHECKED[attack]}: "), me["recent"]
    mine = by_name.get(name)
    if mine is not None and attack != "token_inflation":  # (whose work is honest)
        # nothing an attacker sent earns confirmed credit: left out (0), or pending until
        # an audit of its work decides (tests/test_escrow.py: the quiet ones forfeit it)
        assert mine["credit"] == 0 or mine["credit_status"] == "pending", mine
    for i in range(HONEST):  # no honest volunteer is ever left out by a check
        work = by_name[f"honest-{attack}-{i}"]
        assert work["aggregated"] and work["checks"]["code"] is None, work
        # scored on its lease's windows, read again by the server: it lowered the loss
        assert work["checks"]["own_gain"] > 0 or work["checks"]["other_gain"] > 0, work
    for c in listed["contributions"]:  # telemetry for every aggregated contribution
        if c["aggregated"]:
            assert c["norm"] > 0 and c["cosine"] is not None and 0 < c["clip"] <= 1
    if attack == "token_inflation":  # weighed (and credited) as one lease's work, no more
        cfg = parse_config(run["config"])
        mine = next(c for c in listed["contributions"] if c["contributor_name"] == name)
        # (times a new account's standing, as every upload of its is)
        counted = counted_weight(cfg.lease_tokens, 0, mine["standing"])
        assert mine["standing"] == standing(0, 0) and mine["weight"] == counted
        assert cfg.lease_tokens < mine["tokens"]
        n_params = http.get(f"{API}/runs/{run['id']}").json()["n_params"]
        assert mine["credit"] == pytest.approx(6 * n_params * counted)


def blown_up(run: dict, work: Work) -> bytes:
    """``work``'s upload with its Δ 10^4 times too long: finite, so it is taken."""
    blown: dict[str, Any] = {n: t * 1e4 for n, t in work.delta.items()}
    cfg = parse_config(run["config"])
    return hostile_body(
        "scaled10", blown, work.meta, kind=cfg.compression.kind,
        block_size=cfg.compression.block_size,
    )  # fmt: skip


def test_the_guard_discards_a_step_an_attacker_blows_up_and_publishes_without_it(
    http: httpx.Client,
) -> None:
    # Prepare: robust aggregation off, so the plain mean follows a Δ 10^4 times too long,
    # and no scoring (which would leave it out before any step): the guard alone
    config = server_run_config(rounds={"quorum": 2, "target": 3, "max_rounds": 3})
    config["aggregation"] = {"method": "mean", "score_windows": 0}
    run = create_run(http, config)
    honest = [register(http, f"guarded-{i}") for i in range(2)]
    attacker = register(http, "guard-attacker")
    base = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/0")
    works = {token: train(http, token, run["id"], steps=1) for token in [*honest, attacker]}
    mine = works[attacker]
    body = blown_up(run, mine)

    # Execute
    for token in honest:
        assert upload(http, token, works[token]).status_code == 201
    assert upload(http, attacker, mine, body=body).status_code == 201  # finite: it is taken
    wait_for(lambda: version(http, run["id"]) == 1, timeout=60, what="round 1")

    # Assert: published as if the attacker had never uploaded; its work is excluded, unpaid
    published = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/1")
    expected = reference_step(run, base, [works[t] for t in honest]).params
    assert all(torch.equal(published[n], expected[n]) for n in expected)
    listed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()["contributions"]
    excluded = [c for c in listed if c["excluded"]]
    assert [c["contributor_name"] for c in excluded] == ["guard-attacker"]
    assert excluded[0]["excluded"].startswith("guard: the step with it was discarded (eval loss")
    assert excluded[0]["credit"] == 0 and not excluded[0]["aggregated"]
    (round1, *_) = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert round1["accepted"] == 2


def loss_raising_delta(http: httpx.Client, work: Work, norm: float) -> dict[str, torch.Tensor]:
    """The direction in which the loss climbs fastest at the base version (the gradient,
    on a batch of the attacker's own shard), at ``norm``: Δ = −norm·∇L/‖∇L‖, so that the
    outer step θ − Δ climbs. A normal-norm upload that no clipping can tell apart."""
    lease = work.lease
    cfg = parse_config(lease["config"])
    model = GPT(cfg.model.gpt_config())
    load_parameters(model, fetch_params(http, lease["checkpoint"]["url"]))
    raw = http.get(lease["shard"]["url"]).content
    shard = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(
        -1, lease["shard"]["chunk_len"]
    )
    gen = torch.Generator().manual_seed(lease["seed"])
    x, y = random_batch(shard, batch_size=8, block_size=cfg.model.block_size, generator=gen)
    model(x, y).backward()
    grad = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    size = math.sqrt(sum(float(g.pow(2).sum()) for g in grad.values()))
    return {n: -g * (norm / size) for n, g in grad.items()}


def test_a_normal_norm_upload_that_raises_the_loss_is_never_published(http: httpx.Client) -> None:
    # Prepare: the default clipped mean; the guard at ratio 1 (a round of one inner step
    # lowers the judging loss by under 1% on this model, and the attack raises it by about
    # as much: any rise is refused)
    config = server_run_config(rounds={"quorum": 2, "target": 3, "max_rounds": 3})
    config["aggregation"] = {"max_loss_ratio": 1.0}
    run = create_run(http, config)
    honest = [register(http, f"normal-{i}") for i in range(2)]
    attacker = register(http, "normal-attacker")
    base = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/0")
    works = {token: train(http, token, run["id"], steps=1) for token in [*honest, attacker]}
    mine = works[attacker]
    honest_norm = math.sqrt(sum(float(t.pow(2).sum()) for t in mine.delta.values()))
    cfg = parse_config(run["config"])
    encoded, _, _ = encode_delta(
        loss_raising_delta(http, mine, honest_norm),
        cfg.compression,
    )
    body = Work(mine.lease, mine.meta, encoded).body()

    # Execute
    for token in honest:
        assert upload(http, token, works[token]).status_code == 201
    assert upload(http, attacker, mine, body=body).status_code == 201  # nothing to refuse
    wait_for(lambda: version(http, run["id"]) == 1, timeout=60, what="round 1")

    # Assert: its norm is an honest one's; the round closed without it, saying why, before
    # any step was judged: the cheap checks leave it out when the two honest uploads share a
    # clear direction (it points against it), and the scoring by the loss when, on the
    # run's drawn seed, one inner step each leaves them too far apart for the cosine to
    # judge a minority (it raised the loss on both samples). Either way it is never published.
    listed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()["contributions"]
    by_name = {c["contributor_name"]: c for c in listed}
    norms = [by_name[f"normal-{i}"]["norm"] for i in range(2)]
    assert by_name["normal-attacker"]["norm"] <= 1.02 * max(norms)
    excluded = [c for c in listed if c["excluded"]]
    assert [c["contributor_name"] for c in excluded] == ["normal-attacker"]
    reason = excluded[0]["excluded"]
    assert reason.startswith(("opposed: it points against the others", "no_gain: ")), reason
    assert excluded[0]["credit"] == 0 and not excluded[0]["aggregated"]
    published = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/1")
    expected = reference_step(run, base, [works[t] for t in honest]).params
    assert all(torch.equal(published[n], expected[n]) for n in expected)
    (round1, *_) = http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
    assert round1["accepted"] == 2


def test_a_round_whose_guard_blames_its_only_upload_reopens_and_then_closes_on_honest_work(
    http: httpx.Client,
) -> None:
    # Prepare: the plain mean; a round that closes on its first upload (target 1), and that
    # upload an attacker's Δ 10^4 times too long: no step can be made without it
    config = server_run_config(rounds={"quorum": 1, "target": 1, "max_rounds": 2})
    config["aggregation"] = {"method": "mean", "score_windows": 0}  # the guard alone
    run = create_run(http, config)
    honest, attacker = register(http, "reopen-honest"), register(http, "reopen-attacker")
    base = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/0")
    works = {token: train(http, token, run["id"], steps=1) for token in (honest, attacker)}
    mine = works[attacker]
    body = blown_up(run, mine)

    def round1() -> dict[str, Any]:
        return dict(http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"][0])

    # Execute: the attacker's upload closes the round; the guard discards the step
    assert upload(http, attacker, mine, body=body).status_code == 201
    reopened = wait_for(
        lambda: (r := round1())["close_code"] == "guard_below_quorum" and r,
        timeout=60,
        what="round 1 to be reopened",
    )

    # Assert: reopened once, saying why, never retried; the attacker out for good, unpaid
    assert reopened["state"] == "open" and reopened["error"] is None, reopened
    assert "left out for good" in reopened["close_reason"]
    assert "below quorum 1: reopened to wait for more" in reopened["close_reason"]
    assert version(http, run["id"]) == 0 and reopened["accepted"] == 0

    # Execute: honest work arrives; the round closes on it alone
    assert upload(http, honest, works[honest]).status_code == 201
    wait_for(lambda: version(http, run["id"]) == 1, timeout=60, what="round 1 to close")

    published = fetch_params(http, f"{API}/runs/{run['id']}/checkpoints/1")
    expected = reference_step(run, base, [works[honest]]).params
    assert all(torch.equal(published[n], expected[n]) for n in expected) and finite(published)
    listed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()["contributions"]
    by_name = {c["contributor_name"]: c for c in listed}
    blamed = by_name["reopen-attacker"]
    assert blamed["excluded"].startswith("guard: the step with it was discarded (eval loss")
    assert blamed["credit"] == 0 and not blamed["aggregated"]
    assert by_name["reopen-honest"]["aggregated"] and by_name["reopen-honest"]["credit"] > 0
    closed = round1()
    assert closed["state"] == "closed" and closed["error"] is None and closed["accepted"] == 1
