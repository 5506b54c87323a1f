"""Scoring an upload by its effect on the loss (``diloco.outer.scoring``), on a tiny model:
honest work passes, work that lowers the loss nowhere is failed, and which uploads a
close scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.checkpoint import write_params
from diloco.config import parse_config
from diloco.data.text import random_batch
from diloco.model.architectures import build_model
from diloco.outer.scoring import (
    SCORE_ALL,
    Score,
    Scorer,
    Windows,
    chosen,
    lease_picks,
    lease_windows,
)
from diloco.train import parameters_of
from diloco.wire.contribution import ContributionMeta, encode_contribution
from diloco.wire.exchange import encode_delta
from tests.support.corpora import TINYSHAKESPEARE

CFG = parse_config(
    {
        "name": "scoring",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"path": "unused.txt"},
        "inner": {"steps": 30, "batch_size": 8, "lr": 3e-3},
    }
)


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A base model (trained a little: at initialisation almost any change lowers the
    loss), its file, some text, and the windows to score on."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("scoring")
    model = build_model(CFG.model)
    text = torch.frombuffer(bytearray(TINYSHAKESPEARE.read_bytes()[:200_000]), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        model(*random_batch(text[:100_000], batch_size=8, block_size=32, generator=gen)).backward()
        opt.step()
    base = {n: t.detach().clone() for n, t in parameters_of(model).items()}
    write_params(folder / "base.safetensors", base, version=0)
    own = [random_batch(text, batch_size=8, block_size=32, generator=gen) for _ in range(30)]
    other = Windows.validation(text[150_000:].long(), 8, 32)
    return {"folder": folder, "model": model, "base": base, "own": own, "other": other}


def body(folder: Path, name: str, delta: dict[str, torch.Tensor]) -> Path:
    encoded, codec, _ = encode_delta(delta, CFG.compression)
    meta = ContributionMeta("run", 1, 0, 1000, 30, 3.0, codec)
    path = folder / f"{name}.upload"
    path.write_bytes(b"".join(encode_contribution(meta, encoded)))
    return path


def scored_windows(setting: dict) -> Windows:
    """The windows of the own batches a close scores on (a round's secret: 0)."""
    return lease_windows(iter(setting["own"]).__next__, CFG, steps=30, secret=0, lease=1)


def trained_delta(setting: dict, batches: list | None = None) -> dict[str, torch.Tensor]:
    """Δ = θ_base − θ after 30 AdamW steps on the own batches (what a volunteer sends), or
    on ``batches`` (other data than its lease's)."""
    model, base = setting["model"], setting["base"]
    with torch.no_grad():
        for n, p in parameters_of(model).items():
            p.copy_(base[n])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for x, y in batches or setting["own"]:
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: base[n] - p.detach() for n, p in parameters_of(model).items()}


def test_honest_work_lowers_the_loss_and_passes(setting: dict) -> None:
    scorer = Scorer(CFG, setting["folder"] / "base.safetensors", setting["other"])
    own = scored_windows(setting)
    score = scorer.score(body(setting["folder"], "honest", trained_delta(setting)), own)
    assert score.own_gain > 0.05 and score.other_gain > 0 and not score.failed


@pytest.mark.parametrize("kind", ["noise", "sign_flip"])
def test_work_that_raises_the_loss_on_both_fails_with_its_figures(setting: dict, kind: str) -> None:
    honest = trained_delta(setting)
    if kind == "noise":
        gen = torch.Generator().manual_seed(3)
        delta = {n: torch.randn(t.shape, generator=gen) * 0.05 for n, t in honest.items()}
    else:
        delta = {n: -t for n, t in honest.items()}
    scorer = Scorer(CFG, setting["folder"] / "base.safetensors", setting["other"])
    own = scored_windows(setting)
    score = scorer.score(body(setting["folder"], kind, delta), own)
    assert score.failed and score.own_gain < -0.005 * score.own_base
    assert score.other_gain < -0.005 * score.other_base
    assert "raises the loss both" in score.reason()
    assert f"{-score.own_gain:.4g}" in score.reason()


def test_work_on_other_data_points_less_along_the_leases_own_gradient(setting: dict) -> None:
    # Prepare: the honest Δ, and Δs of the same training on three other draws of the text
    scorer = Scorer(CFG, setting["folder"] / "base.safetensors", setting["other"])
    own = scored_windows(setting)
    text = torch.frombuffer(bytearray(TINYSHAKESPEARE.read_bytes()[:200_000]), dtype=torch.uint8)
    others = []
    for seed in (5, 6, 7):
        gen = torch.Generator().manual_seed(seed)
        others.append([random_batch(text, batch_size=8, block_size=32, generator=gen)
                       for _ in range(30)])  # fmt: skip

    # Execute
    honest = scorer.score(body(setting["folder"], "honest", trained_delta(setting)), own)
    elsewhere = [
        scorer.score(body(setting["folder"], f"other{i}", trained_delta(setting, b)), own)
        for i, b in enumerate(others)
    ]

    # Assert: the honest Δ points along its own windows' gradient more than along the
    # judging windows', the other-data ones do not, and all pass the gains' check
    assert honest.own_alignment is not None and honest.own_alignment > 0.01
    for score in elsewhere:
        assert score.own_alignment is not None
        assert score.own_alignment < honest.own_alignment - 0.01, (honest, score)
        assert not score.failed


def test_a_score_stored_before_its_alignment_was_measured_reads_back_without_it() -> None:
    old = {"own_gain": 0.1, "other_gain": 0.05, "own_base": 2.5, "other_base": 2.6}
    assert Score.from_figures(old) == Score(0.1, 0.05, 2.5, 2.6, None)
    new = Score(0.1, 0.05, 2.5, 2.6, 0.03)
    assert Score.from_figures(new.figures()) == new


def test_zeros_change_nothing_and_are_left_to_the_zero_check(setting: dict) -> None:
    zeros = {n: torch.zeros_like(t) for n, t in setting["base"].items()}
    scorer = Scorer(CFG, setting["folder"] / "base.safetensors", setting["other"])
    own = scored_windows(setting)
    score = scorer.score(body(setting["folder"], "zeros", zeros), own)
    assert (score.own_gain, score.other_gain, score.failed) == (0.0, 0.0, False)


def test_a_little_worse_on_both_is_within_the_tolerance() -> None:
    # late in a run honest work can raise both losses a little (measured: -0.003, -0.024)
    assert not Score(-0.003, -0.024, 2.5, 2.5).failed
    assert Score(-0.08, -0.05, 2.5, 2.5).failed  # a stale Δ, measured


def test_a_small_round_is_scored_whole_and_a_large_one_half_drawn_by_its_seed() -> None:
    few = [f"c{i}" for i in range(SCORE_ALL)]
    assert chosen(few, seed=1) == set(few)
    many = [f"c{i}" for i in range(21)]
    a, b = chosen(many, seed=1), chosen(many, seed=2)
    assert len(a) == len(b) == 11 and a <= set(many)
    assert a == chosen(many, seed=1) and a != b  # replays, and no one knows beforehand


def test_the_windows_scored_are_one_from_each_stretch_of_the_lease_drawn_by_the_secret() -> None:
    # Prepare: 10 steps of 4 windows; 8 windows scored (CFG's score_windows)
    cfg = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"batch_size": 4})})
    assert cfg.aggregation.score_windows == 8

    # Execute
    picks = lease_picks(cfg, steps=10, secret=7, lease=3)
    flat = sorted(b * 4 + r for b, rows in picks.items() for r in rows)

    # Assert: one window in each eighth of the 40, so spread over the steps
    assert [w * 8 // 40 for w in flat] == list(range(8))
    assert max(picks) >= 8 and min(picks) <= 1
    assert picks == lease_picks(cfg, steps=10, secret=7, lease=3)  # a close replays it
    draws = {str(lease_picks(cfg, steps=10, secret=s, lease=3)) for s in range(20)}
    assert len(draws) > 15  # the volunteer, without the secret, cannot tell which
    every = lease_picks(cfg, steps=1, secret=7, lease=3)  # fewer windows than asked: all
    assert every == {0: [0, 1, 2, 3]}
    # with overlap 0.2 the last 2 of 10 steps may have been trained ahead on the previous
    # lease's data: only the first 8 batches are surely the lease's
    ahead = cfg.model_copy(update={"inner": cfg.inner.model_copy(update={"overlap": 0.2})})
    assert max(lease_picks(ahead, steps=10, secret=7, lease=3)) == 7


def test_picked_windows_come_in_stream_order_and_stop_at_the_streams_end() -> None:
    batches = [(torch.full((3, 4), i), torch.full((3, 4), -i)) for i in range(4)]
    w = Windows.picked(iter(batches).__next__, {0: [2], 2: [0, 1], 3: [5], 9: [0]})
    assert w.x[:, 0].tolist() == [0, 2, 2] and w.y[:, 0].tolist() == [0, -2, -2]
    with pytest.raises(ValueError, match="none of the windows"):
        Windows.picked(iter(batches).__next__, {7: [0]})
    val = torch.arange(100)
    v = Windows.validation(val, 3, 10)
    assert v.x[1].tolist() == list(range(10, 20)) and v.y[1].tolist() == list(range(11, 21))
