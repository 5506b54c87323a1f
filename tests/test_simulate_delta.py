"""Delta downloads in the simulator: θ published by the close's deltas (int8 by default,
the run's download codec), what workers download counted as those deltas."""

import json
import math

import pytest
import torch

from diloco.model.architectures import parameter_shapes
from diloco.model.gpt import GPT
from diloco.simulate.downloads import Ledger
from diloco.simulate.run import SimOptions, simulate
from diloco.train import snapshot
from diloco.wire.delta import apply_delta, read_delta
from tests.conftest import tiny_config


def as_json_without_timing(result):
    out = result.to_json()
    del out["wall_s"]
    return json.dumps(out, sort_keys=True)


def contraction(block_size):
    """One int8 delta leaves at most half a step per value: per block of n values
    ‖r_b‖ ≤ √n·absmax_b/254 ≤ √n/254·‖d_b‖, so ‖r_v‖ ≤ √bs/254 · ‖d_v‖ and, as
    d_v = r_{v−1} + (x_v − x_{v−1}), ‖r_v‖ ≤ √bs/254 · (‖r_{v−1}‖ + ‖x_v − x_{v−1}‖)."""
    return math.sqrt(block_size) / 254 * 1.001  # a hair for fp32 rounding


# ---------------------------------------------------------------- the simulator


@pytest.fixture
def cfg(corpus):
    return tiny_config(corpus, rounds={"max_rounds": 4})


def test_delta_downloads_are_deterministic_for_a_seed(cfg):
    opts = SimOptions(workers=2, seed=3, drop_prob=0.3, downloads="delta")

    first, second = simulate(cfg, opts), simulate(cfg, opts)

    assert as_json_without_timing(first) == as_json_without_timing(second)
    for name, tensor in first.final_params.items():
        assert torch.equal(tensor, second.final_params[name])


def test_delta_mode_reports_theta_x_and_the_bytes_downloaded(cfg):
    full = simulate(cfg, SimOptions(workers=2, seed=1))
    delta = simulate(cfg, SimOptions(workers=2, seed=1, downloads="delta"))

    report = delta.delta
    assert full.downloads == "full" and full.delta is None
    assert delta.downloads == "delta" and report is not None
    R = cfg.rounds.max_rounds
    # round 1 fetches checkpoint 0; each later round one delta (every step was published)
    assert all(r.update_norm is not None for r in delta.rounds)
    assert full.bytes_down_per_worker == R * report.checkpoint_bytes
    assert delta.bytes_down_per_worker == report.checkpoint_bytes + (R - 1) * report.delta_bytes
    assert report.delta_bytes < report.checkpoint_bytes / 3
    # θ and x = θ + r end close, not equal
    assert report.final_eval_loss_outer is not None
    assert report.final_eval_loss_outer != delta.final_eval_loss
    assert abs(report.final_eval_loss_outer - delta.final_eval_loss) < 0.01
    # workers start from the published θ whatever they download: only the bytes differ
    assert [r.eval_loss for r in delta.rounds] == [r.eval_loss for r in full.rounds]


def test_delta_mode_residual_is_bounded_by_each_rounds_quantisation_error(cfg):
    result = simulate(cfg, SimOptions(workers=2, seed=4, downloads="delta"))

    assert result.delta is not None
    residual = 0.0
    for record, now in zip(result.rounds, result.delta.residual_norms, strict=True):
        assert record.update_norm is not None
        assert 0 < now <= contraction(cfg.compression.block_size) * (residual + record.update_norm)
        residual = now


@pytest.mark.parametrize(("download", "per_param"), [("int8", 1.1), ("int2", 0.3), ("sparse", 0.3)])
def test_delta_mode_final_theta_is_theta0_plus_every_rounds_delta_file(
    corpus, tmp_path, download, per_param
):
    # Prepare: θ_0 is the seed's initial model, as simulate builds it; the run's deltas
    # in its download codec (sparse: 256 of each 4096 values)
    compression = {"download": download, "download_topk": 256}
    cfg = tiny_config(corpus, rounds={"max_rounds": 4}, compression=compression)
    torch.manual_seed(2)
    theta = snapshot(GPT(cfg.model.gpt_config()))
    shapes = parameter_shapes(cfg.model)

    # Execute
    result = simulate(cfg, SimOptions(workers=2, seed=2, downloads="delta", delta_dir=tmp_path))

    # Assert: the deltas, read back and applied in order, rebuild θ_R bit for bit
    paths = sorted(tmp_path.glob("delta-*.safetensors"))
    assert len(paths) == cfg.rounds.max_rounds
    for v, path in enumerate(paths, start=1):
        delta = read_delta(path, shapes)
        assert (delta.version, delta.base_version) == (v, v - 1)
        assert delta.codec.kind == download
        apply_delta(theta, delta)
    for name, tensor in result.final_params.items():
        assert torch.equal(theta[name], tensor)
    # what a returning worker downloads a round: the last delta file; its tensors, without
    # the header (large beside a model this small), weigh what the codec promises
    assert result.delta is not None and result.delta.delta_bytes == paths[-1].stat().st_size
    numel = sum(t.numel() for t in theta.values())
    assert sum(e.nbytes for e in delta.tensors.values()) <= per_param * numel


def test_delta_downloads_apply_to_diloco_and_protocol_modes_only(cfg):
    with pytest.raises(ValueError, match="applies to diloco and protocol modes"):
        simulate(cfg, SimOptions(workers=2, mode="ddp", downloads="delta"))


def test_ledger_charges_the_missing_deltas_or_the_checkpoint_when_they_cost_more():
    # Prepare: versions 1..4 published, each delta 30 bytes, the checkpoint 100
    ledger = Ledger({1: 30, 2: 30, 3: 30, 4: 30}, checkpoint_bytes=100)

    # Execute / Assert
    ledger.fetch("new", 0)  # nothing held: the checkpoint
    assert ledger.bytes == 100
    ledger.fetch("new", 0)  # held already: nothing
    assert ledger.bytes == 100
    ledger.fetch("new", 3)  # three deltas, 90 < 100
    assert ledger.bytes == 190
    ledger.fetch("back", 0)
    ledger.fetch("back", 4)  # four deltas would be 120 > 100: the checkpoint
    assert ledger.bytes == 390


def test_protocol_mode_with_delta_downloads_is_deterministic_and_counts_deltas(cfg, tmp_path):
    # Prepare: two volunteers at speed 1, every round both contribute
    from diloco.simulate.protocol_mode import ProtocolOptions

    opts = SimOptions(workers=2, mode="protocol", seed=5, downloads="delta", delta_dir=tmp_path)
    torch.manual_seed(5)
    theta = snapshot(GPT(cfg.model.gpt_config()))

    # Execute
    first = simulate(cfg, opts, protocol=ProtocolOptions())
    second = simulate(cfg, opts, protocol=ProtocolOptions())
    full = simulate(cfg, SimOptions(workers=2, mode="protocol", seed=5))

    # Assert: the same run twice; checkpoint 0 then one delta a round per volunteer
    assert as_json_without_timing(first) == as_json_without_timing(second)
    report = first.delta
    assert report is not None and full.delta is None
    R = cfg.rounds.max_rounds
    assert full.bytes_down_per_worker == R * report.checkpoint_bytes
    assert first.bytes_down_per_worker == report.checkpoint_bytes + (R - 1) * report.delta_bytes
    # and θ is θ_0 with every version's delta file applied in order
    shapes = parameter_shapes(cfg.model)
    for path in sorted(tmp_path.glob("delta-*.safetensors")):
        apply_delta(theta, read_delta(path, shapes))
    for name, tensor in first.final_params.items():
        assert torch.equal(theta[name], tensor)
