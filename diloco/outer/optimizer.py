"""Pseudo-gradients, and an in-memory Nesterov outer optimizer.

- Δi = θ_old − θ_i: old minus new, so that Δ points *up* the loss like a gradient and
  the outer SGD step θ ← θ − lr·Δ moves towards the workers.
- ``OuterOptimizer``: a real ``torch.optim.SGD(nesterov=True)`` with Δ installed as
  ``.grad``, whose ``state_dict()`` is what ``diloco.checkpoint.save_checkpoint`` stores.
  Neither the server nor ``diloco simulate`` steps with it: both run ``diloco.outer.close``
  (the chunked pass, with the int8 delta's error feedback); the tests hold that pass to
  ``torch.optim.SGD`` (tests/test_one_close.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

Params = Mapping[str, torch.Tensor]


@torch.no_grad()
def pseudo_gradient(old: Params, new: Params) -> dict[str, torch.Tensor]:
    """Δ = θ_old − θ_new, in fp32, per tensor."""
    if old.keys() != new.keys():
        raise KeyError(f"parameter names differ: {sorted(old.keys() ^ new.keys())}")
    return {n: old[n].float() - new[n].detach().float() for n in old}


class AggregationError(ValueError):
    """A contribution that does not fit the model, or aggregating nothing."""


class OuterOptimizer:
    """The global parameters and their Nesterov SGD, stepped once per round."""

    def __init__(self, params: Params, *, lr: float, momentum: float, nesterov: bool) -> None:
        self.params = {n: p.detach().float().clone() for n, p in params.items()}
        fused = all(p.device.type == "cpu" for p in self.params.values())
        self.sgd = torch.optim.SGD(
            list(self.params.values()),
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            fused=fused or None,
        )

    @torch.no_grad()
    def step(self, delta: Params, *, lr: float | None = None) -> float:
        """Apply the outer step with ``delta`` as the gradient, at ``lr`` when given (the
        round's, ``OuterSection.lr_at``; it stays for later steps); return ‖θ_new − θ_old‖₂."""
        if lr is not None:
            for group in self.sgd.param_groups:
                group["lr"] = lr
        if delta.keys() != self.params.keys():
            raise AggregationError(
                f"delta names differ: {sorted(delta.keys() ^ self.params.keys())}"
            )
        before = {n: p.clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.grad = delta[n].to(p.device, torch.float32)
        self.sgd.step()
        sq = 0.0
        for n, p in self.params.items():
            p.grad = None
            sq += float((p - before[n]).pow(2).sum())
        return sq**0.5

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: the SGD state (momentum buffers)."""
        return {"names": list(self.params), "sgd": self.sgd.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["names"]) != list(self.params):
            raise AggregationError("outer optimizer state was saved for other parameter names")
        # deep copy: torch keeps the given buffers by reference when dtype and device match
        self.sgd.load_state_dict(copy.deepcopy(state["sgd"]))
