"""Checkpoints: round trips, bit-identical restart of the outer optimizer, atomic replace."""

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco import atomic as atomic_mod
from diloco.atomic import file_sha256
from diloco.checkpoint import (
    CheckpointError,
    checkpoint_params_only,
    load_checkpoint,
    save_checkpoint,
)
from diloco.outer.optimizer import OuterOptimizer


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # deliberately not in sorted order: the optimizer's parameter order must survive
    return {
        "wte.weight": torch.randn(8, 4, generator=g),
        "blocks.0.ln.bias": torch.randn(4, generator=g),
        "blocks.0.attn.weight": torch.randn(4, 4, generator=g),
    }


def make_grads(seed: int) -> dict[str, torch.Tensor]:
    return {n: t * 0.1 for n, t in make_params(seed).items()}


def no_temp_files(directory: Path) -> bool:
    return not any(".tmp-" in p.name for p in directory.iterdir())


def test_params_and_version_round_trip_in_order(tmp_path: Path):
    # Prepare
    params = make_params()
    path = tmp_path / "ckpt.safetensors"

    # Execute
    save_checkpoint(path, params=params, version=7, metadata={"run_id": "r1"})
    loaded = load_checkpoint(path)

    # Assert
    assert loaded.version == 7
    assert list(loaded.params) == list(params)
    assert all(torch.equal(loaded.params[n], params[n]) for n in params)
    assert loaded.metadata == {"run_id": "r1"}


def test_restart_from_checkpoint_continues_outer_steps_bit_identically(tmp_path: Path):
    # Prepare: an outer optimizer with momentum built up over two steps
    hp = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    live = OuterOptimizer(make_params(), **hp)
    live.step(make_grads(1))
    live.step(make_grads(2))
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params=live.params, version=2, outer_state=live.state_dict())

    # Execute: a fresh process rebuilds from the file alone, then both take the same steps
    loaded = load_checkpoint(path)
    assert loaded.outer_state is not None
    restarted = OuterOptimizer(loaded.params, **hp)
    restarted.load_state_dict(loaded.outer_state)
    for seed in (3, 4):
        live.step(make_grads(seed))
        restarted.step(make_grads(seed))

    # Assert
    assert all(torch.equal(restarted.params[n], live.params[n]) for n in live.params)


def test_outer_hyper_parameters_are_restored_from_the_checkpoint(tmp_path: Path):
    # Prepare
    live = OuterOptimizer(make_params(), lr=0.5, momentum=0.8, nesterov=False)
    live.step(make_grads(1))
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params=live.params, version=1, outer_state=live.state_dict())

    # Execute
    outer_state = load_checkpoint(path).outer_state

    # Assert
    assert outer_state is not None
    group = outer_state["sgd"]["param_groups"][0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.8, False)
    assert group["params"] == [0, 1, 2]
    assert outer_state["names"] == list(make_params())


def test_returned_sha256_is_the_hash_of_the_file_bytes(tmp_path: Path):
    # Prepare
    path = tmp_path / "ckpt.safetensors"

    # Execute
    digest = save_checkpoint(path, params=make_params(), version=0)

    # Assert
    assert digest == file_sha256(path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert load_checkpoint(path).sha256 == digest
    assert no_temp_files(tmp_path)


def test_failed_replace_leaves_the_old_checkpoint_intact_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Prepare
    path = tmp_path / "ckpt.safetensors"
    old_digest = save_checkpoint(path, params=make_params(0), version=1)

    def crash(*args: object) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(atomic_mod.os, "replace", crash)

    # Execute
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(path, params=make_params(1), version=2)

    # Assert
    monkeypatch.undo()
    assert load_checkpoint(path).version == 1
    assert file_sha256(path) == old_digest
    assert no_temp_files(tmp_path)


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path: Path):
    # Prepare
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params=make_params(0), version=1)

    # Execute
    digest = save_checkpoint(path, params=make_params(1), version=2)

    # Assert
    loaded = load_checkpoint(path)
    assert (loaded.version, loaded.sha256) == (2, digest)
    assert torch.equal(loaded.params["wte.weight"], make_params(1)["wte.weight"])
    assert no_temp_files(tmp_path)


def test_corrupt_file_is_a_checkpoint_error(tmp_path: Path):
    # Prepare
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(os.urandom(4096))

    # Execute / Assert
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_truncated_file_is_a_checkpoint_error(tmp_path: Path):
    # Prepare
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params=make_params(), version=3)
    path.write_bytes(path.read_bytes()[:-10])

    # Execute / Assert
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)


def test_missing_file_is_a_checkpoint_error(tmp_path: Path):
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_safetensors_file_without_our_metadata_is_a_checkpoint_error(tmp_path: Path):
    # Prepare
    path = tmp_path / "foreign.safetensors"
    save_file(make_params(), str(path), metadata={"format": "pt"})

    # Execute / Assert
    with pytest.raises(CheckpointError, match="not a DiLoCo checkpoint"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="not a DiLoCo checkpoint"):
        checkpoint_params_only(path)


def test_missing_momentum_for_a_listed_param_is_a_checkpoint_error(tmp_path: Path):
    # Prepare: a file that promises momentum but lacks one buffer
    live = OuterOptimizer(make_params(), lr=0.7, momentum=0.9, nesterov=True)
    live.step(make_grads(1))
    good = tmp_path / "good.safetensors"
    save_checkpoint(good, params=live.params, version=1, outer_state=live.state_dict())
    with safe_open(str(good), framework="pt") as f:
        meta, names = f.metadata(), list(f.keys())
        tensors = {k: f.get_tensor(k) for k in names if k != "outer.momentum.wte.weight"}
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)

    # Execute / Assert
    with pytest.raises(CheckpointError, match="lacks outer momentum"):
        load_checkpoint(bad)


def test_reserved_metadata_key_is_rejected(tmp_path: Path):
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(
            tmp_path / "c.safetensors", params=make_params(), version=0, metadata={"version": "99"}
        )
    assert not any(tmp_path.iterdir())


def test_params_only_checkpoint_loads_with_no_outer_state(tmp_path: Path):
    # Prepare
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params=make_params(), version=5)

    # Execute
    loaded = load_checkpoint(path)
    params = checkpoint_params_only(path)

    # Assert
    assert loaded.outer_state is None
    assert list(params) == list(make_params())
    assert all(torch.equal(params[n], t) for n, t in make_params().items())


def test_outer_state_before_any_step_loads_as_a_fresh_optimizer(tmp_path: Path):
    # Prepare: SGD keeps no momentum until its first step
    fresh = OuterOptimizer(make_params(), lr=0.7, momentum=0.9, nesterov=True)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params=fresh.params, version=0, outer_state=fresh.state_dict())

    # Execute
    loaded = load_checkpoint(path)
    restarted = OuterOptimizer(loaded.params, lr=0.7, momentum=0.9, nesterov=True)
    assert loaded.outer_state is not None
    restarted.load_state_dict(loaded.outer_state)
    fresh.step(make_grads(1))
    restarted.step(make_grads(1))

    # Assert
    assert loaded.outer_state["sgd"]["state"] == {}
    assert all(torch.equal(restarted.params[n], fresh.params[n]) for n in fresh.params)
