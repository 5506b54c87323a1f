"""Overlap in the simulator (``diloco simulate --overlap F``, issue 25): a worker trains the
first F·H steps of a round from its own end of the round before, then folds the published
version in (``InnerTrainer.fold``) and trains the rest; its upload is still a Δ against
the version its round names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.model.gpt import GPT
from diloco.simulate.run import SimOptions, simulate
from diloco.train import InnerTrainer, parameters_of, snapshot
from tests.conftest import tiny_config

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
    cfg = tiny_config(corpus, inner={"steps": 4}, rounds={"max_rounds": 4})

    plain = simulate(cfg, SimOptions(workers=2, seed=1))
    zero = simulate(cfg, SimOptions(workers=2, seed=1, overlap=0.0))
    half = simulate(cfg, SimOptions(workers=2, seed=1, overlap=0.5))

    assert _without_timing(plain) == _without_timing(zero)
    assert half.overlap == 0.5 and half.to_json()["overlap"] == 0.5
    # every upload was still accepted against its round's version, and the model learns
    assert [r.accepted for r in half.rounds] == [2] * 4
    assert half.final_eval_loss < half.initial_eval_loss  # type: ignore[operator]
    assert half.final_eval_loss != plain.final_eval_loss
    # the tokens are the same: overlap moves steps earlier, it adds none
    assert [r.tokens for r in half.rounds] == [r.tokens for r in plain.rounds]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--overlap", "1.5"], "--overlap must be in [0, 1]"),
        (["--overlap", "0.5", "--mode", "ddp"], "--overlap applies to --mode diloco"),
    ],
)
def test_an_overlap_that_cannot_apply_is_a_usage_error(corpus, tmp_path, extra, message):
    config = tmp_path / "run.toml"
    config.write_text(
        f'name = "t"\n[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n'
        f'[data]\npath = "{corpus}"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "client.cli", "simulate", str(config), "--rounds", "1", *extra],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr + proc.stdout
