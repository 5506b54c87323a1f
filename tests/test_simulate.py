"""The simulator: determinism, and DiLoCo reducing to plain AdamW in its degenerate case."""

import json
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from diloco.data.text import load_tokens, random_batch, split_tokens
from diloco.model.gpt import GPT
from diloco.simulate.dealing import stream_generator
from diloco.simulate.run import SimOptions, simulate
from diloco.train import evaluate, make_adamw, snapshot
from tests.conftest import tiny_config


def as_json_without_timing(result):
    out = result.to_json()
    del out["wall_s"]
    return json.dumps(out, sort_keys=True)


def test_same_seed_gives_identical_results(corpus):
    cfg = tiny_config(corpus)
    opts = SimOptions(workers=2, mode="diloco", seed=3, drop_prob=0.3)

    first, second = simulate(cfg, opts), simulate(cfg, opts)

    assert as_json_without_timing(first) == as_json_without_timing(second)
    for name, tensor in first.final_params.items():
        assert torch.equal(tensor, second.final_params[name])


def test_another_seed_gives_another_initial_model_and_other_batches(corpus):
    cfg = tiny_config(corpus)
    opts = SimOptions(workers=2, seed=1)

    a, again, b = simulate(cfg, opts), simulate(cfg, opts), simulate(cfg, replace(opts, seed=2))

    # the same seed repeats bit for bit, so what differs below is the seed's doing
    assert as_json_without_timing(a) == as_json_without_timing(again)
    assert a.seed == 1 and b.seed == 2
    assert a.initial_eval_loss != b.initial_eval_loss  # the initial model
    assert all(ra.train_loss != rb.train_loss for ra, rb in zip(a.rounds, b.rounds, strict=True))
    assert all(not torch.equal(t, b.final_params[name]) for name, t in a.final_params.items())
    # the batches too: each worker's stream is drawn from the seed
    first = [torch.randint(1 << 30, (8,), generator=stream_generator(s, 0)) for s in (1, 2)]
    assert not torch.equal(*first)


def test_diloco_with_one_worker_one_step_and_plain_outer_sgd_equals_adamw_step_for_step(corpus):
    # K=1, H=1, outer lr 1, no momentum, no upload compression: θ ← θ − (θ − θ1) = θ1 every
    # round, up to the int8 delta that publishes each version (the server's close): θ
    # lags the exact step by its residual, under half a quantisation step a value (error
    # feedback carries it into the next version rather than letting it grow). AdamW's first
    # moment is kept across rounds, as a step-by-step AdamW keeps it
    rounds = 6
    cfg = tiny_config(
        corpus,
        inner={"steps": 1, "warmup_steps": 2, "schedule": "cosine", "reset_momentum": False},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        rounds={"max_rounds": rounds},
        compression={"kind": "none"},
    )

    result = simulate(cfg, SimOptions(workers=1, mode="diloco", seed=5, eval_windows=None))

    # the reference: the same initial model trained by AdamW directly on the same batches
    torch.manual_seed(5)
    model = GPT(cfg.model.gpt_config())
    data = split_tokens(
        load_tokens(cfg.data.path),
        val_fraction=cfg.data.val_fraction,
        n_shards=1,
        block_size=cfg.model.block_size,
        chunk_size=cfg.data.chunk_size,
    )
    gen = stream_generator(5, 0)
    opt = make_adamw(model, cfg.inner)
    for step in range(rounds):
        lr = cfg.inner.lr * (step + 1) / 2 if step < 2 else None
        if lr is None:  # cosine from lr to 0.1·lr over the remaining steps
            progress = (step - 2) / (rounds - 2)
            lr = cfg.inner.lr * (0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * progress))))
            lr = float(lr)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = random_batch(
            data.shards[0],
            batch_size=cfg.inner.batch_size,
            block_size=cfg.model.block_size,
            generator=gen,
        )
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad()
        expected_eval = evaluate(model, data.val, block_size=cfg.model.block_size)
        assert result.rounds[step].eval_loss == pytest.approx(expected_eval, rel=1e-5, abs=1e-6)

    assert_close(result.final_params, snapshot(model), rtol=0, atol=1e-3)


def test_result_reports_rounds_tokens_and_bytes(corpus):
    cfg = tiny_config(corpus)
    n_params = GPT(cfg.model.gpt_config()).num_parameters()

    diloco = simulate(cfg, SimOptions(workers=2, mode="diloco"))
    ddp = simulate(cfg, SimOptions(workers=2, mode="ddp"))
    single = simulate(cfg, SimOptions(workers=2, mode="single"))

    tokens_per_step = cfg.inner.batch_size * cfg.model.block_size
    assert [r.round for r in diloco.rounds] == [1, 2, 3]
    assert [r.tokens for r in diloco.rounds] == [2 * 2 * tokens_per_step * r for r in (1, 2, 3)]
    assert [r.tokens for r in ddp.rounds] == [r.tokens for r in diloco.rounds]
    assert [r.tokens for r in single.rounds] == [2 * tokens_per_step * r for r in (1, 2, 3)]
    # int8 upload: ~1 byte per parameter per round (+ scales and a small header)
    assert 3 * n_params < diloco.bytes_up_per_worker < 3 * n_params * 1.1 + 3 * 4096
    # download: the fp32 checkpoint every round
    assert 3 * 4 * n_params < diloco.bytes_down_per_worker < 3 * (4 * n_params + 4096)
    # ring all-reduce with K=2: 2(K-1)/K = 1 gradient's worth per step, 6 steps
    assert ddp.bytes_up_per_worker == ddp.bytes_down_per_worker == 6 * 4 * n_params
    assert single.bytes_up_per_worker == 0
    assert all(r.accepted == 2 for r in diloco.rounds)


def test_dropped_contributions_are_not_counted_and_a_round_with_none_takes_no_step(corpus):
    cfg = tiny_config(corpus, rounds={"max_rounds": 8})

    result = simulate(cfg, SimOptions(workers=3, mode="diloco", drop_prob=0.5, seed=1))

    accepted = [r.accepted for r in result.rounds]
    assert min(accepted) < 3 and sum(accepted) < 24
    assert all((r.update_norm is None) == (r.accepted == 0) for r in result.rounds)


def trained_by_hand(cfg, *, seed: int, worker: int, workers: int) -> dict[str, torch.Tensor]:
    """One worker's model after the first round's single AdamW step, as the simulator
    trains it: the seed's initial model, shard ``worker`` of ``workers``, its own stream."""
    torch.manual_seed(seed)
    model = GPT(cfg.model.gpt_config())
    data = split_tokens(
        load_tokens(cfg.data.path),
        val_fraction=cfg.data.val_fraction,
        n_shards=workers,
        block_size=cfg.model.block_size,
        chunk_size=cfg.data.chunk_size,
    )
    opt = make_adamw(model, cfg.inner)
    for group in opt.param_groups:
        group["lr"] = cfg.inner.lr / cfg.inner.warmup_steps  # the warmup's first step
    x, y = random_batch(
        data.shards[worker],
        batch_size=cfg.inner.batch_size,
        block_size=cfg.model.block_size,
        generator=stream_generator(seed, worker),
    )
    model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
    opt.step()
    return snapshot(model)


def test_a_dropped_contribution_is_missing_from_the_outer_step_and_the_others_are_in_it(corpus):
    # K=2, H=1, one round, the plain mean, outer lr 1 without momentum, fp32: the step lands
    # on the mean of the trained models that reached it
    cfg = tiny_config(
        corpus,
        inner={"steps": 1, "warmup_steps": 2},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        rounds={"max_rounds": 1},
        compression={"kind": "none"},
    )
    plain_mean = cfg.aggregation.model_copy(update={"method": "mean"})
    cfg = cfg.model_copy(update={"aggregation": plain_mean})
    seed = 4  # its drop stream loses exactly one of the two uploads in round 1 at p = 0.5
    worker = [trained_by_hand(cfg, seed=seed, worker=i, workers=2) for i in (0, 1)]

    both = simulate(cfg, SimOptions(workers=2, seed=seed))
    one = simulate(cfg, SimOptions(workers=2, seed=seed, drop_prob=0.5))

    assert [r.accepted for r in both.rounds] == [2] and [r.accepted for r in one.rounds] == [1]
    mean = {name: (worker[0][name] + worker[1][name]) / 2 for name in worker[0]}
    assert_close(both.final_params, mean)
    landed_on = [i for i in (0, 1) if close_to(one.final_params, worker[i])]
    assert len(landed_on) == 1  # the one that arrived, and nothing of the dropped one
    assert not close_to(one.final_params, mean)


def close_to(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # the close publishes θ through the int8 delta (its rounding, ~6e-6 here, is carried in
    # the residual); the two workers differ by ~3e-3, so the bound tells them apart
    return all(torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-4) for name in b)
