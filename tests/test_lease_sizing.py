"""H sized to each volunteer's speed, without a server: the pure sizing rule
(``diloco.protocol.sizing``), the config's bounds, the client's deadline decisions
(``client.pacing``), the trainer's partial result, and the simulator's hub sizing leases
with the same rule. Expected values are worked out by hand in each test."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import torch

from client.pacing import RESERVE_S, RoundPace, deadline_stop, reserve_s, start_refusal
from client.training import LocalTrainer
from diloco.config import ConfigError, parse_config
from diloco.faults import FaultInjector
from diloco.protocol.messages import JoinIn, Lease
from diloco.protocol.sizing import StepBounds, observed_rate, size_lease
from diloco.simulate.protocol_mode import ProtocolOptions
from diloco.simulate.run import SimOptions, simulate
from tests.conftest import tiny_config

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
BOUNDS = StepBounds(nominal=50, min=12, max=80)


def due_in(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


# ---------------------------------------------------------------- the sizing rule


def test_a_reported_speed_sizes_h_to_the_time_left_before_the_deadline():
    # (610 s − 10 s margin) × 0.8 = 480 s usable; 100 tokens/s × 480 s / 1000 = 48 steps
    sized = size_lease(NOW, due_in(610), BOUNDS, tokens_per_step=1000, reported=100.0)

    assert (sized.steps, sized.source) == (48, "reported")
    assert sized.reason == (
        "reported 100 tokens/s x 480 usable s fits 48 steps of 1000 tokens: H=48"
    )


def test_a_slow_volunteer_gets_min_steps_and_a_fast_one_max_steps():
    # 10 tokens/s fits 4 steps (below 12); 10,000 tokens/s fits 4,800 (above 80)
    slow = size_lease(NOW, due_in(610), BOUNDS, tokens_per_step=1000, reported=10.0)
    fast = size_lease(NOW, due_in(610), BOUNDS, tokens_per_step=1000, reported=10_000.0)

    assert (slow.steps, fast.steps) == (12, 80)
    assert slow.reason.endswith("fits 4 steps of 1000 tokens: H=12 (the lower bound)")
    assert fast.reason.endswith("H=80 (the upper bound)")


def test_unknown_speed_gets_the_nominal_h_whatever_the_deadline():
    sized = size_lease(NOW, due_in(5), BOUNDS, tokens_per_step=1000)

    assert (sized.steps, sized.source) == (50, "unknown")
    assert sized.reason == "speed unknown: the nominal H=50"


def test_the_report_wins_over_the_servers_record_and_the_record_serves_without_one():
    reported = size_lease(
        NOW, due_in(610), BOUNDS, tokens_per_step=1000, reported=50.0, observed=150.0
    )
    observed = size_lease(NOW, due_in(610), BOUNDS, tokens_per_step=1000, observed=150.0)

    assert (reported.steps, reported.source) == (24, "reported")  # 50 × 480 / 1000
    assert (observed.steps, observed.source) == (72, "observed")  # 150 × 480 / 1000


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf"), 2e9])
def test_a_report_that_is_no_speed_is_ignored(bad):
    sized = size_lease(NOW, due_in(610), BOUNDS, tokens_per_step=1000, reported=bad)

    assert (sized.steps, sized.source) == (50, "unknown")


def test_a_deadline_already_past_or_within_the_margin_gives_min_steps():
    for left in (-30.0, 0.0, 9.0):
        sized = size_lease(NOW, due_in(left), BOUNDS, tokens_per_step=1000, reported=1e6)
        assert sized.steps == 12


def test_sizing_refuses_naive_times_and_an_empty_step():
    with pytest.raises(ValueError, match=r"^now: must be timezone-aware"):
        size_lease(NOW.replace(tzinfo=None), due_in(60), BOUNDS, tokens_per_step=1)
    with pytest.raises(ValueError, match=r"^tokens_per_step"):
        size_lease(NOW, due_in(60), BOUNDS, tokens_per_step=0)


def test_observed_rate_is_tokens_over_seconds_of_the_usable_samples():
    assert observed_rate([(1000, 10.0), (3000, 10.0)]) == 200.0
    assert observed_rate([(1000, 10.0), (500, 0.0), (0, 4.0)]) == 100.0  # junk rows skipped
    assert observed_rate([]) is None
    assert observed_rate([(0, 3.0)]) is None


# ---------------------------------------------------------------- the config's bounds


def test_min_and_max_steps_default_to_a_quarter_and_the_nominal_h(corpus):
    inner = tiny_config(corpus, inner={"steps": 50}).inner
    assert (inner.lease_min_steps, inner.lease_max_steps) == (12, 50)
    assert tiny_config(corpus, inner={"steps": 3}).inner.lease_min_steps == 1
    assert StepBounds.of(inner) == StepBounds(nominal=50, min=12, max=50)


def test_a_dataset_runs_upper_bound_is_the_nominal_h(corpus):
    inner = tiny_config(corpus, inner={"steps": 50, "max_steps": 200}).inner

    assert StepBounds.of(inner) == StepBounds(nominal=50, min=12, max=200)
    assert StepBounds.of(inner, max_steps=inner.steps) == StepBounds(nominal=50, min=12, max=50)


def test_config_refuses_bounds_that_do_not_hold_the_nominal_h(corpus):
    base = tiny_config(corpus).model_dump(mode="json")

    def with_inner(**values: object) -> None:
        parse_config(base | {"inner": base["inner"] | values})

    with pytest.raises(ConfigError, match=r"^inner\.min_steps: min_steps \(3\) must be at most"):
        with_inner(steps=2, min_steps=3)
    with pytest.raises(ConfigError, match=r"^inner\.max_steps: max_steps \(1\) must be at least"):
        with_inner(steps=2, max_steps=1)
    with pytest.raises(ConfigError, match=r"^inner\.min_steps: "):
        with_inner(min_steps=0)
    with_inner(steps=4, min_steps=4, max_steps=4)  # all equal: every lease gets 4


def test_a_leases_token_cap_follows_its_h(corpus):
    cfg = tiny_config(corpus, inner={"steps": 10})  # batch 4 x block 32 = 128 tokens a step
    assert (cfg.tokens_per_step, cfg.lease_tokens) == (128, 1280)
    assert (cfg.lease_tokens_for(3), cfg.lease_tokens_for(None)) == (384, 1280)


def test_the_join_body_bounds_the_reported_speed():
    assert JoinIn.model_validate({}).tokens_per_s is None
    assert JoinIn.model_validate({"tokens_per_s": 1234.5}).tokens_per_s == 1234.5
    for bad in (0, -1, 2e9, "fast"):
        with pytest.raises(ValueError, match="tokens_per_s"):
            JoinIn.model_validate({"tokens_per_s": bad})


# ---------------------------------------------------------------- the client's decisions


def test_the_client_does_not_start_what_even_min_steps_cannot_finish():
    # 10 steps x 2 s + 5 s reserve = 25 s: 30 s left is enough, 24 s is not
    assert start_refusal(min_steps=10, step_s=2.0, left_s=30.0, reserve=5.0) is None
    assert start_refusal(min_steps=10, step_s=2.0, left_s=24.0, reserve=5.0) == (
        "the deadline is in 24 s: 10 steps at 2.00 s each and the upload (5 s) would not make it"
    )
    # an unknown speed starts unless the deadline is within the reserve
    assert start_refusal(min_steps=10, step_s=None, left_s=6.0, reserve=5.0) is None
    assert start_refusal(min_steps=10, step_s=None, left_s=4.0, reserve=5.0) == (
        "the deadline is in 4 s, within the 5 s kept for the upload"
    )


def test_the_client_stops_when_one_more_step_would_eat_the_upload_reserve():
    # 9 s left, a step of 3 s: 6 s would remain, more than the 5 s reserve: go on
    assert deadline_stop(done=4, steps=50, step_s=3.0, left_s=9.0, reserve=5.0) is None
    # 7.5 s left: 4.5 s would remain: stop now with 4 steps
    assert deadline_stop(done=4, steps=50, step_s=3.0, left_s=7.5, reserve=5.0) == (
        "stopped after 4 of 50 steps for the deadline: it is in 8 s, a step takes 3.00 s "
        "and 5 s are kept for the upload"
    )
    # never with nothing to upload, never after the last step
    assert deadline_stop(done=0, steps=50, step_s=3.0, left_s=1.0, reserve=5.0) is None
    assert deadline_stop(done=50, steps=50, step_s=3.0, left_s=1.0, reserve=5.0) is None


def test_the_reserve_grows_with_a_measured_upload():
    assert reserve_s(None) == RESERVE_S
    assert reserve_s(1.0) == RESERVE_S  # twice 1 s is less than the floor
    assert reserve_s(4.0) == 8.0


def lease_for(inner_steps: int, deadline_in_s: float | None = 60.0) -> Lease:
    return Lease.model_validate(
        {
            "lease_id": "lease_x", "run_id": "run_x", "round": 1, "base_version": 0,
            "checkpoint": {"url": "/c", "sha256": "0", "nbytes": 1, "version": 0},
            "shard": {"url": "/s", "sha256": "0", "nbytes": 1, "index": 0, "chunk_len": 1},
            "config": {}, "inner_steps": inner_steps, "start_step": 0, "seed": 1,
            "deadline": "2026-01-01T12:01:00Z", "lease_expires_at": "2026-01-01T12:00:30Z",
            "heartbeat_interval_s": 10.0, "max_upload_bytes": 1, "deadline_in_s": deadline_in_s,
        }
    )  # fmt: skip


def test_a_volunteer_that_slows_down_is_stopped_by_its_round_pace():
    # Prepare: 60 s to the deadline; steps of 1 s, then of 10 s from the fourth on
    t = [100.0]
    pace = RoundPace(lease_for(50), reserve=5.0, clock=lambda: t[0])
    pace.start()

    # Execute: three quick steps, then slow ones
    decisions = []
    for done, step in enumerate([1, 1, 1, 10, 10, 10, 10, 10, 10], start=1):
        t[0] += step
        decisions.append(pace.after_step(done))
        if decisions[-1]:
            break

    # Assert: after 7 steps (43 s) 17 s are left and the next step is estimated at
    # max(10, mean(1, 10, 10, 10, 10)) = 10 s, leaving 7 s: go on. After 8 (53 s), 7 s are
    # left, a step would leave 3 s, less than the 5 s reserve: stop with 8 steps
    assert decisions[:7] == [None] * 7
    assert decisions[7] == pace.reason
    assert pace.reason == (
        "stopped after 8 of 50 steps for the deadline: it is in 7 s, a step takes 10.00 s "
        "and 5 s are kept for the upload"
    )


def test_the_pace_counts_from_the_servers_seconds_left_not_the_wall_clock():
    t = [0.0]
    pace = RoundPace(lease_for(50, deadline_in_s=30.0), reserve=5.0, clock=lambda: t[0])
    assert pace.left_s() == 30.0  # although the lease's deadline is long past by the wall clock


def test_local_trainer_stopped_by_the_deadline_returns_the_steps_it_took(corpus):
    # Prepare: a real tiny model and a lease of 6 steps; `until` stops after the third
    cfg = tiny_config(corpus, inner={"steps": 6})
    trainer = LocalTrainer(torch.device("cpu"))
    trainer.prepare(cfg.model_dump(mode="json"))
    assert trainer.trainer is not None
    params = {n: p.detach().clone() for n, p in trainer.trainer.model.named_parameters()}
    shard = torch.randint(0, 256, (4, 256), dtype=torch.uint8)
    lease = lease_for(6)
    asked: list[int] = []

    def until(done: int) -> str | None:
        asked.append(done)
        return "deadline" if done == 3 else None

    # Execute
    result = trainer.train(lease, params, shard, on_step=lambda *a: None, stop=lambda: False,
                           until=until)  # fmt: skip

    # Assert: three steps' tokens and losses, and the model moved
    assert (result.steps, result.tokens, len(result.losses)) == (3, 3 * 4 * 32, 3)
    assert asked == [1, 2, 3]
    assert trainer.steps_taken == 3
    body = trainer.contribution(lease, params, result)
    assert (body.meta.inner_steps, body.meta.tokens) == (3, 384)


def test_a_stall_fault_takes_its_own_duration():
    injector = FaultInjector.parse("volunteer.step=stall:0.05@2*3")
    assert injector._rules["volunteer.step"].seconds == 0.05
    with pytest.raises(ValueError, match="only a stall takes"):
        FaultInjector.parse("volunteer.step=fail:1")


# ---------------------------------------------------------------- the simulator


def test_the_simulated_hub_sizes_a_slow_volunteers_lease_to_the_deadline(corpus):
    # Prepare: H = 8 (min 2), a 40 s round, steps of 1 s at speed 1 and 4 s at speed 0.25.
    # The slow one reports 32 tokens/s (128 tokens a step): (40 − 10) × 0.8 = 24 s usable
    # fits 6 steps; the fast one fits 24, clamped to 8
    cfg = tiny_config(
        corpus,
        inner={"steps": 8, "min_steps": 2},
        rounds={"max_rounds": 1, "quorum": 2, "timeout_s": 40.0},
    )
    opts = SimOptions(workers=2, mode="protocol", seed=0, eval_windows=4)

    # Execute: with and without sizing
    sized = simulate(
        cfg, opts, protocol=ProtocolOptions(step_s=1.0, speeds=(1.0, 0.25), size_h=True)
    )
    fixed = simulate(cfg, opts, protocol=ProtocolOptions(step_s=1.0, speeds=(1.0, 0.25)))

    # Assert: sized, the slow volunteer uploads 6 steps at 24 s and the round closes with
    # both; at H = 8 it would need 32 s, which still fits: the same two contributions later
    first = sized.rounds[0]
    assert (first.accepted, first.closed_at_s) == (2, 24.0)
    assert sized.rounds[0].tokens == (8 + 6) * 128
    assert (fixed.rounds[0].accepted, fixed.rounds[0].closed_at_s) == (2, 32.0)
    assert fixed.rounds[0].tokens == (8 + 8) * 128
    # the compute each spent is its lease's H, not the run's (goodput counts it)
    assert sized.protocol is not None and fixed.protocol is not None
    assert [v.compute_s for v in sized.protocol.volunteers] == [8.0, 24.0]
    assert [v.compute_s for v in fixed.protocol.volunteers] == [8.0, 32.0]


def test_a_fast_volunteers_lease_past_the_runs_h_is_timed_and_counted_at_its_own_h(corpus):
    # Prepare: H = 8, max_steps 20: the speed-1 volunteer fits (40 − 10) × 0.8 = 24 steps,
    # clamped to 20; the speed-0.25 one 6
    cfg = tiny_config(
        corpus,
        inner={"steps": 8, "min_steps": 2, "max_steps": 20},
        rounds={"max_rounds": 1, "quorum": 2, "timeout_s": 40.0},
    )
    opts = SimOptions(workers=2, mode="protocol", seed=0, eval_windows=4)

    # Execute
    result = simulate(
        cfg, opts, protocol=ProtocolOptions(step_s=1.0, speeds=(1.0, 0.25), size_h=True)
    )

    # Assert: 20 + 6 steps' tokens, the round closes when the slower of the two (24 s)
    # uploads, and each volunteer's compute is its own H's time
    assert result.rounds[0].tokens == (20 + 6) * 128
    assert result.rounds[0].closed_at_s == 24.0
    assert result.protocol is not None
    assert [v.compute_s for v in result.protocol.volunteers] == [20.0, 24.0]
    assert result.protocol.goodput == 1.0
