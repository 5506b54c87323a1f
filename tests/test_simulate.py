"""The simulator: determinism, and DiLoCo reducing to plain AdamW in its degenerate case."""

import json

import pytest
import torch
from torch.testing import assert_close

from diloco.data import load_tokens, random_batch, split_tokens
from diloco.model import GPT
from diloco.simulate import SimOptions, simulate, stream_generator
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


def test_another_seed_gives_other_results(corpus):
    cfg = tiny_config(corpus)

    a = simulate(cfg, SimOptions(workers=2, seed=1))
    b = simulate(cfg, SimOptions(workers=2, seed=2))

    assert a.final_eval_loss != b.final_eval_loss


def test_diloco_with_one_worker_one_step_and_plain_outer_sgd_equals_adamw_step_for_step(corpus):
    # K=1, H=1, outer lr 1, no momentum, no upload compression: θ ← θ − (θ − θ1) = θ1 every
    # round, up to the int8 delta that publishes each version (the server's close): θ
    # lags the exact step by its residual, under half a quantisation step a value (error
    # feedback carries it into the next version rather than letting it grow)
    rounds = 6
    cfg = tiny_config(
        corpus,
        inner={"steps": 1, "warmup_steps": 2, "schedule": "cosine"},
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


def test_dropped_contributions_do_not_reach_the_outer_step(corpus):
    cfg = tiny_config(corpus, rounds={"max_rounds": 8})

    result = simulate(cfg, SimOptions(workers=3, mode="diloco", drop_prob=0.5, seed=1))

    accepted = [r.accepted for r in result.rounds]
    assert min(accepted) < 3 and sum(accepted) < 24
    assert all((r.update_norm is None) == (r.accepted == 0) for r in result.rounds)
