"""Pseudo-gradients, their token-weighted aggregation, and the Nesterov outer step.

- Δi = θ_old − θ_i: old minus new, so that Δ points *up* the loss like a gradient and
  the outer SGD step θ ← θ − lr·Δ moves towards the workers.
- Aggregation is streaming: one contribution at a time is added into an fp32
  accumulator, so memory is O(model), whatever the number of contributions.
- The outer optimizer is a real ``torch.optim.SGD(nesterov=True)`` with Δ installed
  as ``.grad``; its ``state_dict()`` (the momentum) is part of the run's durable state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
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


class Aggregator:
    """Token-weighted mean of pseudo-gradients, accumulated one contribution at a time."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], device: str = "cpu") -> None:
        self._sum = {
            n: torch.zeros(s, dtype=torch.float32, device=device) for n, s in shapes.items()
        }
        self.total_weight = 0.0
        self.count = 0
        self._broken = False

    @torch.no_grad()
    def add(self, delta: Params | Iterable[tuple[str, torch.Tensor]], weight: float) -> None:
        """Add ``weight · Δ``; ``delta`` may be a mapping or a stream of (name, tensor)."""
        if self._broken:
            raise AggregationError("an earlier contribution failed midway; start a new Aggregator")
        if not weight > 0:
            raise AggregationError(f"weight must be positive, got {weight}")
        items = delta.items() if isinstance(delta, Mapping) else delta
        seen: set[str] = set()
        self._broken = True  # until every tensor of this contribution is in
        for name, tensor in items:
            if name not in self._sum:
                raise AggregationError(f"unknown tensor {name!r}")
            if name in seen:
                raise AggregationError(f"tensor {name!r} given twice")
            acc = self._sum[name]
            if tuple(tensor.shape) != tuple(acc.shape):
                raise AggregationError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(acc.shape)}"
                )
            acc.add_(tensor.to(acc.device, torch.float32), alpha=weight)
            seen.add(name)
        if missing := self._sum.keys() - seen:
            raise AggregationError(f"contribution lacks tensors {sorted(missing)}")
        self._broken = False
        self.total_weight += weight
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """Δ = Σ wi·Δi / Σ wi."""
        if self.count == 0:
            raise AggregationError("no contributions to aggregate")
        return {n: s / self.total_weight for n, s in self._sum.items()}


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

    def clone(self) -> OuterOptimizer:
        """An independent copy, parameters and momentum: a step tried on it can be thrown
        away (``diloco.guard``) without touching this one."""
        group = self.sgd.param_groups[0]
        twin = OuterOptimizer(
            self.params, lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"]
        )
        twin.load_state_dict(self.state_dict())
        return twin

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: the SGD state (momentum buffers)."""
        return {"names": list(self.params), "sgd": self.sgd.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["names"]) != list(self.params):
            raise AggregationError("outer optimizer state was saved for other parameter names")
        # deep copy: torch keeps the given buffers by reference when dtype and device match
        self.sgd.load_state_dict(copy.deepcopy(state["sgd"]))
