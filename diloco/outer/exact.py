"""The round's sum, exact: the same bits whatever order its uploads are added in.

A float sum depends on the order of its terms, so a round whose uploads were added as they
arrived (issue 29: the fold) would publish other bits than a close that adds them in the
order accepted, and two servers would disagree. Here the sum is taken on a fixed-point grid:

- Each upload's term is its values times ``wᵢcᵢ / unit`` (its weight, the tokens it counts
  for, times its clip factor), rounded to whole numbers; the rounding is the upload's own,
  so its term is the same in any round, try or order.
- The terms are whole numbers of magnitude at most ``2**TERM_BITS`` (``unit`` is chosen from
  a bound on every ``|wᵢcᵢΔᵢ[k]|``, ``Grid.for_bound``); float64 adds whole numbers below
  2**53 exactly, so up to ``MAX_TERMS`` of them add up to the same value in any order, and
  one can be taken out again exactly.
- ``g = Σ termsᵢ · unit / W`` (W the kept uploads' total weight), rounded once to float32.

At ``TERM_BITS = 38`` the grid is 2**-38 of the largest value any upload may hold; a
typical coordinate of an update of norm r over N parameters is about r / √N, 2**-15 of the
bound at a billion parameters: 23 bits kept, float32's precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TERM_BITS = 38
MAX_TERMS = 1 << (53 - TERM_BITS - 1)  # uploads of the bound's size a sum can take, exactly


@dataclass(frozen=True)
class Terms:
    """How a pass turns each upload into its term, and the sum into g."""

    unit: float  # the grid: a power of two
    factors: tuple[float, ...]  # wᵢcᵢ / unit, one per upload, in the pass's order
    total: float  # W: g = Σ terms · unit / W

    @classmethod
    def of(
        cls, scaled: Sequence[float], norms: Sequence[float], total: float, *, bound: float = 0.0
    ) -> Terms:
        """``scaled``: each upload's wᵢcᵢ; ``norms``: its ‖Δᵢ‖ (no value is larger); ``bound``:
        at least every wᵢcᵢ‖Δᵢ‖ a round may add (0: the largest of these uploads')."""
        if len(scaled) > MAX_TERMS:
            raise ValueError(f"{len(scaled)} uploads in one sum: at most {MAX_TERMS}")
        largest = max((s * n for s, n in zip(scaled, norms, strict=True)), default=0.0)
        unit = grid_unit(max(bound, largest))
        return cls(unit, tuple(s / unit for s in scaled), total)

    @property
    def scale(self) -> float:
        """What the sum of the terms is multiplied by to give g."""
        return self.unit / self.total if self.total > 0 else 0.0


def grid_unit(bound: float) -> float:
    """The grid for values up to ``bound``: 2**(e − TERM_BITS), bound < 2**e."""
    if not (math.isfinite(bound) and bound > 0):
        return 1.0  # nothing to add but zeros (or the inspector refused it already)
    return math.ldexp(1.0, math.frexp(bound)[1] - TERM_BITS)


def add_term(acc: torch.Tensor, x: torch.Tensor, factor: float, work: torch.Tensor) -> None:
    """acc += round(x · factor), in float64 (``work``: a float64 buffer of x's size)."""
    work.copy_(x).mul_(factor).round_()
    acc.add_(work)


def sub_term(acc: torch.Tensor, x: torch.Tensor, factor: float, work: torch.Tensor) -> None:
    """acc −= round(x · factor): the term ``add_term`` added, taken out exactly."""
    work.copy_(x).mul_(factor).round_()
    acc.sub_(work)


def value_into(
    out: torch.Tensor, acc: torch.Tensor, scale: float, work: torch.Tensor
) -> torch.Tensor:
    """g = acc · scale, rounded once to ``out``'s float32 (``work``: a float64 buffer)."""
    return out.copy_(torch.mul(acc, scale, out=work))


def weighted_sum(values: Sequence[torch.Tensor], terms: Terms) -> torch.Tensor:
    """Σ termsᵢ · scale over whole tensors of one shape: the sum a pass takes, in memory."""
    acc = torch.zeros(values[0].numel(), dtype=torch.float64)
    work = torch.empty_like(acc)
    for x, factor in zip(values, terms.factors, strict=True):
        add_term(acc, x.reshape(-1), factor, work)
    out = torch.empty(values[0].shape, dtype=torch.float32)
    value_into(out.view(-1), acc, terms.scale, work)
    return out
