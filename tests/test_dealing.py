"""How the simulator deals data (diloco.simulate.dealing): on a prepared dataset, leases take
data units in the server's order (the server side: tests/test_datasets_api.py), every window
of a unit read once; protocol mode and DiLoCo mode with lease batches agree bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.config import RunConfig
from diloco.data.text import simulated_data
from diloco.data.units import UnitDealer, plan_units, unit_positions
from diloco.simulate.dealing import Dealer
from diloco.simulate.run import SimOptions, simulate
from tests.conftest import tiny_config
from tests.support.datasets import make_dataset


@pytest.fixture(scope="module")
def dataset_config(tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    folder = tmp_path_factory.mktemp("dealing") / "ds"
    make_dataset(folder, documents=120)
    cfg = tiny_config(Path("unused"), rounds={"max_rounds": 3, "quorum": 3, "target": 3})
    return cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"path": None, "dataset": str(folder)})}
    )


def test_the_dealer_hands_out_every_unit_once_per_pass_in_the_seeds_order():
    dealer = UnitDealer(6, seed=3)
    order = sorted(range(6), key=lambda u: unit_positions(6, 3)[u])

    first = [dealer.pick() for _ in range(6)]
    for unit in first[1:]:  # the first unit's lease came to nothing
        dealer.record(unit)
    again = dealer.pick()  # the untrained one first
    dealer.record(again)
    second = [dealer.pick() for _ in range(6)]

    assert first == order
    assert again == order[0]
    assert second == [*order[1:], order[0]]  # then the least handed out, by position
    assert sorted(unit_positions(6, 3)) == list(range(6)) != unit_positions(6, 3)


def test_units_share_their_edge_token_and_a_short_tail_is_not_dealt():
    assert plan_units([25, 9], unit_tokens=9) == [(0, 0), (0, 8), (0, 16), (1, 0)]
    assert plan_units([8], unit_tokens=9) == []


def test_lease_batches_on_a_dataset_read_each_window_of_a_fresh_unit_once(dataset_config):
    cfg, data = simulated_data(dataset_config, 2)
    assert data.train is not None
    dealer = Dealer(data, cfg, batches="lease", seed=5, workers=2)
    B, T, H = cfg.inner.batch_size, cfg.model.block_size, cfg.inner.steps

    dealt = [dealer.deal(r, i) for r in (1, 2) for i in (0, 1)]
    for d in dealt:
        dealer.trained(d)

    assert dealer.units is not None
    fresh = UnitDealer(len(dealer.units.tensors), 5)
    assert [d.unit for d in dealt] == [fresh.pick() for _ in range(4)]  # the server's order
    assert len({d.unit for d in dealt}) == 4  # the first pass: no unit twice
    for d in dealt:
        assert d.unit is not None
        tokens = dealer.units.tensors[d.unit]
        assert tokens.numel() == H * B * T + 1
        batches = [d.next_batch() for _ in range(H)]
        read = sorted(tuple(x[b].tolist()) for x, _ in batches for b in range(B))
        windows = sorted(tuple(tokens[w * T : w * T + T].tolist()) for w in range(H * B))
        assert read == windows  # every window of the unit, once
        with pytest.raises(StopIteration):
            d.next_batch()
    assert int(dealer.units.dealer.trained.sum()) == 4


def test_protocol_mode_equals_diloco_mode_with_lease_batches_on_a_dataset(dataset_config):
    """As tests/test_simulate_protocol.py shows for a text run: with no pressure, protocol
    mode's rounds are synchronous DiLoCo rounds; on a dataset both take units from the same
    dealing, so the parameters agree bit for bit, and not with worker streams."""
    protocol = simulate(dataset_config, SimOptions(workers=3, mode="protocol", seed=2))
    leases = simulate(dataset_config, SimOptions(workers=3, mode="diloco", seed=2, batches="lease"))
    streams = simulate(dataset_config, SimOptions(workers=3, mode="diloco", seed=2))

    for name, tensor in protocol.final_params.items():
        assert torch.equal(tensor, leases.final_params[name]), name
    assert [r.eval_loss for r in protocol.rounds] == [r.eval_loss for r in leases.rounds]
    assert not all(
        torch.equal(t, streams.final_params[n]) for n, t in protocol.final_params.items()
    )


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_the_baselines_deal_leases_too(dataset_config, mode):
    leases = simulate(dataset_config, SimOptions(workers=2, mode=mode, seed=1, batches="lease"))
    streams = simulate(dataset_config, SimOptions(workers=2, mode=mode, seed=1))

    K = 1 if mode == "single" else 2
    per_round = K * dataset_config.inner.steps * dataset_config.tokens_per_step
    assert [r.tokens for r in leases.rounds] == [per_round * (r + 1) for r in range(3)]
    assert leases.final_eval_loss != streams.final_eval_loss


def test_protocol_mode_refuses_another_dealing(dataset_config):
    with pytest.raises(ValueError, match="protocol mode deals leases as the platform does"):
        simulate(dataset_config, SimOptions(workers=2, mode="protocol", batches="lease"))
