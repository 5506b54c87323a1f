"""Pseudo-gradient sign, aggregation and the Nesterov outer step, against hand computation."""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from diloco.outer.optimizer import AggregationError, OuterOptimizer, pseudo_gradient


def test_pseudo_gradient_is_old_minus_new():
    old = {"w": torch.tensor([1.0, 2.0, 3.0])}
    new = {"w": torch.tensor([0.5, 2.5, 3.0])}

    delta = pseudo_gradient(old, new)

    assert_close(delta["w"], torch.tensor([0.5, -0.5, 0.0]))


def test_outer_sgd_step_with_lr_one_and_no_momentum_lands_on_the_worker():
    # θ − 1·(θ − θi) = θi: the plain descent direction of Δ moves towards the workers
    theta = {"w": torch.tensor([1.0, 2.0])}
    worker = {"w": torch.tensor([0.0, 3.0])}
    outer = OuterOptimizer(theta, lr=1.0, momentum=0.0, nesterov=False)

    outer.step(pseudo_gradient(theta, worker))

    assert_close(outer.params["w"], worker["w"])


def test_outer_step_matches_nesterov_computed_by_hand():
    # torch's Nesterov: b ← μ·b + g (b = g on the first step); θ ← θ − lr·(g + μ·b)
    lr, mu = 0.7, 0.9
    theta0 = torch.tensor([1.0, -2.0, 0.5])
    g1 = torch.tensor([0.1, -0.2, 0.3])
    g2 = torch.tensor([-0.05, 0.4, 0.0])
    outer = OuterOptimizer({"w": theta0}, lr=lr, momentum=mu, nesterov=True)

    norm1 = outer.step({"w": g1})
    outer.step({"w": g2})

    b1 = g1
    theta1 = theta0 - lr * (g1 + mu * b1)
    b2 = mu * b1 + g2
    theta2 = theta1 - lr * (g2 + mu * b2)
    assert_close(outer.params["w"], theta2)
    assert norm1 == pytest.approx(float((theta1 - theta0).norm()), rel=1e-6)


def test_outer_state_round_trips_and_continues_identically():
    theta = {"w": torch.randn(10), "b": torch.randn(3)}
    grads = [{"w": torch.randn(10), "b": torch.randn(3)} for _ in range(3)]
    a = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    a.step(grads[0])
    b = OuterOptimizer(a.params, lr=0.7, momentum=0.9, nesterov=True)
    b.load_state_dict(a.state_dict())

    for g in grads[1:]:
        a.step(g)
        b.step(g)

    for name in theta:
        assert torch.equal(a.params[name], b.params[name])


def test_outer_state_for_other_names_is_refused():
    a = OuterOptimizer({"w": torch.zeros(2)}, lr=1.0, momentum=0.9, nesterov=True)
    b = OuterOptimizer({"v": torch.zeros(2)}, lr=1.0, momentum=0.9, nesterov=True)

    with pytest.raises(AggregationError, match="other parameter names"):
        b.load_state_dict(a.state_dict())


def test_the_outer_lr_schedule_of_a_runs_first_rounds():
    from diloco.config import OuterSection

    plain = OuterSection(first_round="nesterov")
    warm = OuterSection(first_round="nesterov", warmup_rounds=4)
    avg = OuterSection()  # the default start: round 1 is the plain average
    sgd = OuterSection(first_round="average", nesterov=False)

    assert [plain.lr_at(t, 100) for t in (1, 2, 50)] == [0.7, 0.7, 0.7]
    assert [round(warm.lr_at(t, 100), 6) for t in (1, 2, 4, 5)] == [0.175, 0.35, 0.7, 0.7]
    assert avg.lr_at(1, 100) == pytest.approx(1 / 1.9) and avg.lr_at(2, 100) == 0.7
    assert sgd.lr_at(1, 100) == 1.0
    with pytest.raises(ValueError, match="numbered from 1"):
        plain.lr_at(0, 100)


def test_a_rising_outer_lr_goes_from_lr_to_lr_x_rise_along_a_half_cosine():
    from diloco.config import OuterSection

    rise = OuterSection(lr_rise=2.0)  # round 1 stays the plain average
    lrs = [rise.lr_at(t, 41) for t in range(1, 46)]

    assert lrs[0] == pytest.approx(1 / 1.9)
    assert lrs[1] == pytest.approx(0.7 * (1 + (1 - math.cos(math.pi / 40)) / 2))
    assert lrs[20] == pytest.approx(0.7 * 1.5)  # halfway: round 21 of 41
    assert lrs[40] == pytest.approx(1.4) and lrs[44] == pytest.approx(1.4)  # past the end
    assert all(a < b for a, b in itertools.pairwise(lrs[1:41]))
    warm = OuterSection(lr_rise=3.0, warmup_rounds=4, first_round="nesterov")
    assert warm.lr_at(2, 3) == pytest.approx(0.7 * 2.0 * 2 / 4)  # the warmup scales the rise
    with pytest.raises(ValueError):
        OuterSection(lr_rise=0.5)  # a decay: measured far worse (docs/tuning-notes.md)


def test_an_average_first_round_moves_the_model_by_exactly_the_averaged_update():
    from diloco.config import OuterSection

    torch.manual_seed(0)
    theta = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    delta = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    cfg = OuterSection(first_round="average")
    outer = OuterOptimizer(theta, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)

    outer.step(delta, lr=cfg.lr_at(1, 100))
    first = {n: p.clone() for n, p in outer.params.items()}
    outer.step(delta, lr=cfg.lr_at(2, 100))

    for n in theta:  # round 1: θ₀ − Δ (up to float rounding); round 2: Nesterov at lr 0.7
        assert torch.allclose(first[n], theta[n] - delta[n], atol=1e-6)
        buf = 0.9 * delta[n] + delta[n]  # the momentum seeded by round 1, then round 2's Δ
        expected = first[n] - 0.7 * (delta[n] + 0.9 * buf)
        assert torch.allclose(outer.params[n], expected, atol=1e-5)
