"""Overlap in the simulator (``[inner] overlap``, ``diloco simulate --overlap F``, issue 25):
a worker trains steps of its next round ahead, from its own end of the round before, then
folds the published version in (``InnerTrainer.fold``) and trains the rest; its upload is
still a Δ against the version its round names. In diloco mode the first F·H steps of every
round from the second; in protocol mode, as the client does, as many as fit between the end
of a volunteer's training and its next version's arrival, up to the cap, on its last
lease's data (``diloco.data.text.lease_stream``), not counted as new tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco.data.text import AHEAD_SEED, lease_stream
from diloco.model.gpt import GPT
from diloco.simulate.protocol_mode import ProtocolOptions
from diloco.simulate.rows import HubSettings
from diloco.simulate.run import SimOptions, simulate
from diloco.train import InnerTrainer, parameters_of, snapshot
from tests.conftest import tiny_config
from tests.support.cli import in_process

REPO = Path(__file__).resolve().parents[1]


def _without_timing(result) -> str:  # type: ignore[no-untyped-def]
    out = result.to_json()
    del out["wall_s"]
    return json.dumps(out, sort_keys=True)


def test_fold_puts_the_progress_made_from_a_guess_on_the_real_version(corpus):
    cfg = tiny_config(corpus)
    torch.manual_seed(0)
    model = GPT(cfg.model.gpt_config())
    trainer = InnerTrainer(model, cfg.inner, total_steps=10, device=torch.device("cpu"))
    guess = snapshot(trainer.model)
    base = {n: t + 0.01 * torch.randn_like(t) for n, t in guess.items()}
    moved = {n: t + 0.003 for n, t in guess.items()}  # as if steps had been taken
    trainer.start_lease(moved)

    trainer.fold(base, guess)

    for name, p in parameters_of(trainer.model).items():
        torch.testing.assert_close(p.detach(), base[name] + 0.003, rtol=0, atol=1e-6)
    # nothing taken from the guess yet: the fold is the version itself, bit for bit
    trainer.start_lease(guess)
    trainer.fold(base, guess)
    assert all(torch.equal(p, base[n]) for n, p in parameters_of(trainer.model).items())


def test_no_overlap_is_the_run_as_before_and_overlap_changes_it_but_trains(corpus):
    def run(overlap):
        cfg = tiny_config(corpus, inner={"steps": 4, "overlap": overlap}, rounds={"max_rounds": 4})
        return simulate(cfg, SimOptions(workers=2, seed=1))

    plain, half = simulate(tiny_config(corpus, inner={"steps": 4}, rounds={"max_rounds": 4}),
                           SimOptions(workers=2, seed=1)), run(0.5)  # fmt: skip

    assert _without_timing(plain) == _without_timing(run(0.0))
    assert half.overlap == 0.5 and half.to_json()["overlap"] == 0.5
    # every upload was still accepted against its round's version, and the model learns
    assert [r.accepted for r in half.rounds] == [2] * 4
    assert half.final_eval_loss < half.initial_eval_loss  # type: ignore[operator]
    assert half.final_eval_loss != plain.final_eval_loss
    # a worker reads one stream: overlap moves steps earlier, it adds no tokens
    assert [r.tokens for r in half.rounds] == [r.tokens for r in plain.rounds]


def _protocol(corpus, overlap):
    # two volunteers of speed 1, H = 4 steps of 5 s, and a close that takes 12 s
    cfg = tiny_config(
        corpus,
        inner={"steps": 4, "overlap": overlap},
        rounds={"max_rounds": 3, "quorum": 2, "timeout_s": 600},
    )
    opts = SimOptions(workers=2, mode="protocol", seed=0, eval_windows=8)
    return simulate(cfg, opts, protocol=ProtocolOptions(step_s=5.0, hub=HubSettings(close_s=12.0)))


def test_protocol_volunteers_train_ahead_while_the_round_closes(corpus):
    plain, ahead = _protocol(corpus, 0.0), _protocol(corpus, 0.5)

    timeline = [(r.opened_at_s, r.closed_at_s, r.accepted) for r in plain.rounds]
    assert timeline == [(0.0, 32.0, 2), (32.0, 64.0, 2), (64.0, 96.0, 2)]
    # round 1 ends training at 20 s and closes at 32 s: each volunteer takes 2 steps ahead
    # (the cap, 0.5 x 4) in those 12 s, so round 2 needs 10 s of training, not 20
    timeline = [(r.opened_at_s, r.closed_at_s, r.accepted) for r in ahead.rounds]
    assert timeline == [(0.0, 32.0, 2), (32.0, 54.0, 2), (54.0, 76.0, 2)]
    # the same compute, every upload accepted; the steps ahead read the last lease's data
    # again, so rounds 2 and 3 claim the tokens of the 2 steps left, 2 x 2 x 128 each
    assert ahead.protocol.compute_s == plain.protocol.compute_s == 3 * 2 * 4 * 5.0
    assert ahead.protocol.refused == {} and ahead.protocol.goodput == 1.0
    per_step = 4 * 32
    assert [r.tokens for r in ahead.rounds] == [8 * per_step, 12 * per_step, 16 * per_step]
    assert ahead.final_eval_loss < ahead.initial_eval_loss  # type: ignore[operator]
    assert ahead.final_eval_loss != plain.final_eval_loss


def test_steps_ahead_read_the_last_lease_again_in_an_order_of_their_own():
    tokens = torch.arange(8 * 4 + 1)  # a range of 8 windows of 4 tokens
    read = dict(ranged=True, batch_size=2, block_size=4)

    def order(stream, batches):  # the windows each batch holds, in the order read
        return [int(w) // 4 for _ in range(batches) for w in stream()[0][:, 0]]

    lease = lease_stream(tokens, seed=7, **read)
    once = order(lease, 4)
    with pytest.raises(StopIteration):  # a lease reads each window once
        lease()
    again = order(lease_stream(tokens, seed=7 + AHEAD_SEED, repeat=True, **read), 12)
    # pass after pass over the same 8 windows, each pass all of them, in other orders
    passes = [again[:8], again[8:16], again[16:]]
    assert all(sorted(p) == list(range(8)) for p in passes) and sorted(once) == list(range(8))
    assert len({tuple(p) for p in [once, *passes]}) == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--overlap", "1.5"], "--overlap must be in [0, 0.9]"),
        (["--overlap", "0.5", "--mode", "ddp"], "--overlap applies to --mode diloco and protocol"),
    ],
)
def test_an_overlap_that_cannot_apply_is_a_usage_error(corpus, tmp_path, extra, message):
    config = tmp_path / "run.toml"
    config.write_text(
        f'name = "t"\n[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n'
        f'[data]\npath = "{corpus}"\n'
    )
    proc = in_process("simulate", str(config), "--rounds", "1", *extra)

    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr + proc.stdout
