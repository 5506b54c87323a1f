"""``simulate --mode protocol``: volunteers against the round protocol on a simulated clock.

Every scenario below is timed by hand: volunteer i takes ``step_s / speed_i`` simulated
seconds per inner step and the tiny config has H = 2, so at ``step_s=5`` a speed-1
volunteer uploads 10 s after it joins and a speed-0.25 one 40 s after. Leases lapse 30 s
after the last heartbeat, the sweeper ticks every second and an accepted upload wakes it.
Close reasons are compared with the sentences ``decide_close`` writes.
"""

import json

import pytest
import torch

from diloco.model.architectures import build_model
from diloco.protocol.messages import ErrorCode
from diloco.protocol.reputation import counted_weight, standing
from diloco.simulate.protocol_mode import Links, Outage, ProtocolOptions
from diloco.simulate.run import SimOptions, simulate
from diloco.train import InnerTrainer
from tests.conftest import tiny_config


def run_protocol(
    corpus,
    *,
    workers,
    quorum,
    target=None,
    timeout_s=600.0,
    rounds=1,
    seed=0,
    max_staleness=1,
    **proto,
):
    cfg = tiny_config(
        corpus,
        rounds={
            "max_rounds": rounds,
            "quorum": quorum,
            "target": target,
            "timeout_s": timeout_s,
            "max_staleness": max_staleness,
        },
    )
    opts = SimOptions(workers=workers, mode="protocol", seed=seed, eval_windows=8)
    return simulate(cfg, opts, protocol=ProtocolOptions(step_s=5.0, **proto))


def as_json_without_timing(result):
    out = result.to_json()
    del out["wall_s"]
    return json.dumps(out, sort_keys=True)


# ---------------------------------------------------------------- quorum and target


def test_round_closes_at_target_without_waiting_for_the_slow_lease(corpus):
    result = run_protocol(corpus, workers=3, quorum=1, target=2, speeds=(1, 1, 0.25))

    first = result.rounds[0]
    assert (first.close_code, first.closed_at_s, first.accepted, first.leases) == (
        "target",
        10.0,
        2,
        3,
    )
    assert first.close_reason == "target reached: 2 of target 2 accepted contributions"
    # the slow volunteer was 10 s into its 40 s when the run completed
    totals = result.protocol
    assert (totals.compute_s, totals.useful_s) == (30.0, 20.0)
    assert totals.wasted_s["in_flight"] == 10.0
    assert totals.goodput == pytest.approx(2 / 3)


def test_round_at_quorum_waits_for_the_live_lease_then_closes(corpus):
    # quorum 1 is met at 10 s, but the second volunteer's lease is live until it uploads at 20 s
    result = run_protocol(corpus, workers=2, quorum=1, speeds=(1, 0.5))

    first = result.rounds[0]
    assert (first.close_code, first.closed_at_s, first.accepted) == (
        "quorum_no_live_leases",
        20.0,
        2,
    )
    assert first.close_reason == "quorum reached (2 of 1) and no live lease outstanding"
    assert result.protocol.goodput == 1.0


# ---------------------------------------------------------------- deadlines


def test_slow_volunteer_misses_the_deadline_and_its_refused_upload_is_wasted(corpus, monkeypatch):
    # Prepare: count the inner loops actually run
    runs = []
    original = InnerTrainer.run
    monkeypatch.setattr(
        InnerTrainer, "run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k)
    )

    # Execute: quorum 2 is met at 10 s by the fast pair; the slow one (40 s) is still live,
    # so round 1 closes at its 30 s deadline; the slow upload at 40 s finds it closed, and
    # this run takes no late work
    result = run_protocol(
        corpus,
        workers=3,
        quorum=2,
        timeout_s=30.0,
        rounds=2,
        speeds=(1, 1, 0.25),
        max_staleness=0,
    )

    # Assert
    first, second = result.rounds
    assert (first.close_code, first.closed_at_s, first.accepted) == ("deadline_quorum", 30.0, 2)
    assert first.close_reason == "deadline passed with quorum: 2 accepted, quorum 2"
    # round 2 opens at 30 s; the fast pair joins at 32 s (their 2 s retry), uploads at 42 s,
    # and the slow volunteer, rejoining at 40 s, is again too late for the 60 s deadline
    assert (second.opened_at_s, second.close_code, second.closed_at_s) == (
        30.0,
        "deadline_quorum",
        60.0,
    )
    totals = result.protocol
    assert totals.refused == {ErrorCode.ROUND_CLOSED: 1}
    assert totals.wasted_s == {"refused": 40.0, "abandoned": 0.0, "dropped": 0.0, "in_flight": 20.0}
    assert [v.refused for v in totals.volunteers] == [0, 0, 1]
    # only admitted uploads were trained: refused and unfinished work cost no CPU
    assert len(runs) == sum(v.accepted for v in totals.volunteers) == 4


def test_a_late_upload_is_merged_into_the_open_round_with_half_the_weight(corpus):
    # Prepare / Execute: as above, but the run takes work one version late (the default).
    # Round 1 closes at 30 s; the slow volunteer's heartbeat at 40 s is answered "round
    # closed, current round 2", within max_staleness 1, so it finishes and uploads at 40 s:
    # merged into round 2 (staleness 1). It then joins round 2, whose live lease keeps the
    # round open to its 60 s deadline; the fast pair's uploads at 42 s make quorum
    result = run_protocol(
        corpus, workers=3, quorum=2, timeout_s=30.0, rounds=2, speeds=(1, 1, 0.25)
    )

    # Assert: round 2's step took its two own contributions and the late one; nothing was
    # refused or abandoned; the late work earned half a fresh contribution's credit
    # (weight ⌈256 / 2⌉ = 128 tokens: H 2 x batch 4 x block 32 = 256), times standing
    first, second = result.rounds
    assert (first.close_code, first.closed_at_s, first.accepted) == ("deadline_quorum", 30.0, 2)
    assert (second.close_code, second.closed_at_s, second.accepted) == (
        "deadline_quorum",
        60.0,
        3,
    )
    totals = result.protocol
    assert totals.refused == {} and totals.abandoned == 0
    fast, _, slow = totals.volunteers
    assert (slow.accepted, slow.late, fast.late) == (1, 1, 0)
    assert fast.credit_flops > 0
    # 2 rounds at a new account's standing, then one verified share more; the slow one's
    # late work at half the weight, at a new account's standing (diloco.protocol.reputation)
    fast_tokens = counted_weight(256, 0, standing(0, 0)) + counted_weight(256, 0, standing(1, 0))
    slow_tokens = counted_weight(256, 1, standing(0, 0))
    assert slow.credit_flops == pytest.approx(fast.credit_flops * slow_tokens / fast_tokens)
    assert totals.wasted_s["refused"] == 0.0


def test_below_quorum_at_the_deadline_the_round_is_extended_and_says_why(corpus):
    # one upload at 10 s, quorum 2: at the 30 s deadline the round is extended by 30 s;
    # the slow volunteer's upload at 40 s then closes it
    result = run_protocol(corpus, workers=2, quorum=2, timeout_s=30.0, speeds=(1, 0.25))

    first = result.rounds[0]
    assert first.extensions == 1 and result.protocol.extensions == 1
    assert first.extension_reasons == [
        "deadline passed below quorum: 1 of 2 accepted; deadline extended by 30 s (extension 1)"
    ]
    assert (first.close_code, first.closed_at_s, first.accepted) == (
        "quorum_no_live_leases",
        40.0,
        2,
    )


def test_heartbeat_after_the_close_stops_the_straggler_at_the_end_of_its_step(corpus):
    # H = 4 here; the slow volunteer (20 s a step) heartbeats every 25 s. Round 1 closes at
    # its 30 s deadline on the fast upload; the heartbeat at 50 s is refused, so the slow
    # one stops when its third step ends, at 60 s, and drops the work
    # (this run takes no late work: max_staleness 0)
    cfg = tiny_config(
        corpus,
        inner={"steps": 4},
        rounds={
            "max_rounds": 3,
            "timeout_s": 30.0,
            "max_staleness": 0,
            "heartbeat_interval_s": 25.0,  # the run config's, as on a hub
            "lease_ttl_s": 75.0,
        },
    )
    proto = ProtocolOptions(speeds=(1, 0.25), step_s=5.0)

    result = simulate(cfg, SimOptions(workers=2, mode="protocol", eval_windows=8), protocol=proto)

    totals = result.protocol
    assert (totals.abandoned, totals.wasted_s["abandoned"]) == (1, 60.0)
    assert (result.rounds[0].close_code, result.rounds[0].closed_at_s) == ("deadline_quorum", 30.0)
    assert totals.refused == {}


# ---------------------------------------------------------------- dropouts


def test_a_dropped_volunteers_lease_lapses_and_the_round_stops_waiting_for_it(corpus):
    # v2 stops at 5 s, so it never heartbeats: its lease (granted at 0 s) lapses at 30 s
    result = run_protocol(corpus, workers=3, quorum=2, outages=(Outage(2, at_s=5.0),))

    first = result.rounds[0]
    assert (first.close_code, first.closed_at_s, first.accepted) == (
        "quorum_no_live_leases",
        30.0,
        2,
    )
    assert first.close_reason == "quorum reached (2 of 2) and no live lease outstanding"
    assert result.protocol.dropouts == 1 and result.protocol.wasted_s["dropped"] == 5.0


def test_a_volunteer_that_comes_back_gets_its_lease_renewed_and_contributes(corpus):
    # back at 15 s, v2 gets its own lease on round 1 again and uploads at 25 s
    result = run_protocol(corpus, workers=3, quorum=2, outages=(Outage(2, at_s=5.0, back_s=15.0),))

    first = result.rounds[0]
    assert (first.closed_at_s, first.accepted, first.leases) == (25.0, 3, 3)
    assert [v.accepted for v in result.protocol.volunteers] == [1, 1, 1]


def test_round_that_can_no_longer_reach_quorum_stops_the_simulation(corpus):
    # two volunteers can never make quorum 3: the sweeper's first tick (1 s) says so
    result = run_protocol(corpus, workers=2, quorum=3)

    assert result.rounds == [] and result.protocol.sim_time_s == 1.0
    assert result.protocol.stopped_because == (
        "stalled: round 1 has 0 of quorum 3 accepted and only 2 volunteer(s) left "
        "who could still contribute"
    )


def test_clock_stops_at_the_time_limit_and_counts_unfinished_work_as_in_flight(corpus):
    # quorum 2: the fast upload at 10 s waits for the slow one (40 s), past the 15 s limit
    result = run_protocol(corpus, workers=2, quorum=2, speeds=(1, 0.25), max_sim_s=15.0)

    totals = result.protocol
    assert result.rounds == []
    assert (totals.stopped_because, totals.sim_time_s) == ("time limit of 15 s", 15.0)
    assert (totals.compute_s, totals.wasted_s["in_flight"], totals.goodput) == (25.0, 25.0, 0.0)


# ---------------------------------------------------------------- determinism, equivalence


def test_same_options_and_seed_give_identical_results_with_random_dropouts(corpus):
    scenario = {
        "workers": 4,
        "quorum": 2,
        "timeout_s": 30.0,
        "rounds": 3,
        "seed": 3,
        "speeds": (1, 1, 0.5, 0.25),
        "drop_per_min": 0.5,
        "return_per_min": 0.5,
    }

    first, second = run_protocol(corpus, **scenario), run_protocol(corpus, **scenario)
    other_seed = run_protocol(corpus, **{**scenario, "seed": 4})

    assert first.protocol.dropouts > 0  # the dropouts really happened
    totals = first.protocol  # every volunteer-second is accounted for once
    assert totals.useful_s + sum(totals.wasted_s.values()) == pytest.approx(totals.compute_s)
    assert as_json_without_timing(first) == as_json_without_timing(second)
    for name, tensor in first.final_params.items():
        assert torch.equal(tensor, second.final_params[name])
    assert as_json_without_timing(first) != as_json_without_timing(other_seed)


def test_without_pressure_protocol_mode_equals_diloco_mode_with_lease_batches(corpus):
    """With equal speeds, no dropouts, quorum = target = K and a far deadline, every round
    of protocol mode is a synchronous DiLoCo round: the K volunteers join in order (so
    volunteer i holds the round's i-th lease), train from the same θ with AdamW state kept
    across rounds, and their uploads are aggregated in that order. DiLoCo mode draws worker
    i's batches from its own stream by default; with ``batches="lease"`` it draws them from
    the i-th lease's shard and seed, as a volunteer does. Then the two modes must give the
    same parameters bit for bit, and with the default streams they must not (the lease
    seeds are what makes them agree, not a shared shortcut)."""
    # Prepare
    cfg = tiny_config(corpus, rounds={"max_rounds": 3, "quorum": 3, "target": 3})

    # Execute
    protocol = simulate(cfg, SimOptions(workers=3, mode="protocol", seed=2))
    leases = simulate(cfg, SimOptions(workers=3, mode="diloco", seed=2, batches="lease"))
    streams = simulate(cfg, SimOptions(workers=3, mode="diloco", seed=2))

    # Assert
    assert [r.close_code for r in protocol.rounds] == ["target"] * 3
    for name, tensor in protocol.final_params.items():
        assert torch.equal(tensor, leases.final_params[name]), name
    assert [r.eval_loss for r in protocol.rounds] == [r.eval_loss for r in leases.rounds]
    assert [r.tokens for r in protocol.rounds] == [r.tokens for r in leases.rounds]
    assert protocol.bytes_up_per_worker == leases.bytes_up_per_worker
    assert not all(
        torch.equal(t, streams.final_params[n]) for n, t in protocol.final_params.items()
    )


# ---------------------------------------------------------------- links


def test_with_links_the_round_waits_for_each_download_and_upload(corpus):
    # 2 steps of 5 s each; every first join downloads θ, every upload travels
    links = Links(up_mbps=2.0, down_mbps=8.0, latency_s=0.25)
    result = run_protocol(corpus, workers=2, quorum=2, rounds=2, links=links)
    instant = run_protocol(corpus, workers=2, quorum=2, rounds=2)

    checkpoint = result.bytes_down_per_worker // 2  # two downloads each: one per round
    upload = result.bytes_up_per_worker // 2
    down_s = 0.25 + checkpoint * 8 / 8e6
    up_s = 0.25 + upload * 8 / 2e6
    first, second = result.rounds
    assert instant.rounds[0].closed_at_s == 10.0
    assert first.closed_at_s == pytest.approx(down_s + 10.0 + up_s)
    # round 2: the same wait to join again after the close, then a download, H steps, an upload
    rejoin_and_train = instant.rounds[1].closed_at_s - instant.rounds[0].closed_at_s
    assert second.closed_at_s - first.closed_at_s == pytest.approx(rejoin_and_train + down_s + up_s)
    totals = result.protocol
    assert totals.transfer_s == pytest.approx(2 * 2 * (down_s + up_s))
    assert [v.transfer_s for v in totals.volunteers] == pytest.approx([2 * (down_s + up_s)] * 2)
    # transfers are not training: the same compute, all of it useful
    assert (totals.compute_s, totals.goodput) == (instant.protocol.compute_s, 1.0)
    assert instant.protocol.transfer_s == 0.0


def test_links_sized_for_a_larger_model_scale_every_transfer(corpus):
    n_params = sum(p.numel() for p in build_model(tiny_config(corpus).model).parameters())
    real = Links(up_mbps=1.0, down_mbps=4.0)
    as_10x = Links(up_mbps=10.0, down_mbps=40.0, as_params=10.0 * n_params)

    a = run_protocol(corpus, workers=2, quorum=2, links=real)
    b = run_protocol(corpus, workers=2, quorum=2, links=as_10x)

    assert a.protocol.transfer_s > 0.5
    assert b.rounds[0].closed_at_s == pytest.approx(a.rounds[0].closed_at_s)
    assert b.protocol.transfer_s == pytest.approx(a.protocol.transfer_s)


def test_volunteers_that_drop_out_while_downloading_have_trained_nothing_yet(corpus):
    # downloads longer than the 10 s of training, and frequent dropouts: many land in one
    links = Links(up_mbps=100.0, down_mbps=0.02, latency_s=0.5)
    result = run_protocol(
        corpus, workers=3, quorum=1, rounds=6, links=links, drop_per_min=0.9,
        return_per_min=0.9, seed=3,
    )  # fmt: skip
    totals = result.protocol
    assert totals.dropouts >= 3
    assert all(v.compute_s >= 0.0 for v in totals.volunteers)
    assert all(seconds >= 0.0 for seconds in totals.wasted_s.values()), totals.wasted_s
    assert 0.0 <= totals.goodput <= 1.0


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("options", "workers", "message"),
    [
        ({"speeds": (1.0, -1.0)}, 2, "speeds: must all be positive numbers"),
        ({"speeds": (1.0, 1.0)}, 3, "speeds: 2 given for 3 volunteers"),
        ({"drop_per_min": 1.0}, 2, "drop_per_min: must be a probability in [0, 1)"),
        ({"outages": (Outage(5, 1.0),)}, 2, "outages: no volunteer 5 among 2"),
    ],
)
def test_bad_protocol_options_are_refused_with_the_field_named(corpus, options, workers, message):
    cfg = tiny_config(corpus)

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        simulate(
            cfg,
            SimOptions(workers=workers, mode="protocol"),
            protocol=ProtocolOptions(**options),
        )
