"""The close's cheap checks (``diloco.outer.checks``), on updates built here: what each
check leaves out, what it must never leave out, and the sampling they read."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from diloco.outer.checks import (
    RecentChange,
    RoundFigures,
    Sampler,
    Sampling,
    check_uploads,
)
from diloco.wire.lowbit import SparseCodec

N = 50_000  # parameters
SHAPES = {"a": (200, 100), "b": (30_000,)}


def flat(seed: int, signal: torch.Tensor | None = None, noise: float = 1.0) -> torch.Tensor:
    x = torch.randn(N, generator=torch.Generator().manual_seed(seed)) * noise
    return x if signal is None else signal + x


def figures(updates: dict[str, torch.Tensor], recent: list[RecentChange] = ()) -> RoundFigures:
    """What the close's pass measures of these updates (the plain mean, one seed)."""
    ids = list(updates)
    c = 1.0 / len(ids)
    g = sum(c * u for u in updates.values())
    assert isinstance(g, torch.Tensor)
    sampler = Sampler(
        SHAPES, [Sampling.for_round(N, 7), *(Sampling.for_round(N, r.seed) for r in recent)]
    )
    for i, u in updates.items():
        at = 0
        for name, shape in SHAPES.items():
            n = math.prod(shape)
            for start in range(0, n, 4096):  # chunk by chunk, as the pass does
                part = u[at + start : at + min(n, start + 4096)]
                sampler.upload(i, name, start, part)
            at += n
    norms = {i: float(u.norm()) for i, u in updates.items()}
    return RoundFigures(
        ids=ids,
        norms=norms,
        coefficients=dict.fromkeys(ids, c),
        dots={i: float(u.double() @ g.double()) for i, u in updates.items()},
        g_sq=float(g.double() @ g.double()),
        samples=sampler.uploads(),
        recent=list(recent),
        reference=sorted(norms.values())[len(norms) // 2],
    )


def honest(k: int) -> dict[str, torch.Tensor]:
    """Updates that share a direction (the signal) and differ in their own noise."""
    signal = flat(0)
    return {f"h{i}": flat(100 + i, signal, noise=1.5) for i in range(k)}


def codes(
    updates: dict[str, torch.Tensor], recent: list[RecentChange] = ()
) -> dict[str, str | None]:
    return {i: c.code for i, c in check_uploads(figures(updates, recent)).items()}


def test_honest_updates_pass_every_check() -> None:
    assert set(codes(honest(6)).values()) == {None}


@pytest.mark.parametrize(
    ("attack", "code"),
    [
        (lambda ups: torch.zeros(N), "zero_update"),
        (lambda ups: ups["h0"] * 1e-6, "zero_update"),
        (lambda ups: ups["h1"] * 0.9, "copy"),
        (lambda ups: -ups["h2"], "copy"),  # another's Δ, negated, is a copy too
        (lambda ups: flat(999) * float(ups["h0"].norm()) / math.sqrt(N), "unaligned"),
        (lambda ups: -sum(ups.values()) / 4, "opposed"),
    ],
)
def test_each_freeloader_is_left_out_with_its_code_and_no_honest_one_is(attack, code) -> None:
    updates = honest(4)
    updates["x"] = attack(updates)
    got = codes(updates)
    assert got.pop("x") == code
    assert set(got.values()) == {None}, got


def test_the_earlier_upload_is_the_original_and_the_later_one_the_copy() -> None:
    updates = honest(3)
    updates = {"copy": updates["h1"] * 1.1, **updates}  # accepted first: h1 is the copy
    got = codes(updates)
    assert got["h1"] == "copy" and got["copy"] is None


def test_a_copy_of_a_recent_published_change_is_left_out() -> None:
    updates = honest(3)
    change = flat(5) * 0.01
    seed = 1234
    sampled = torch.cat(
        [Sampling.for_round(N, seed).take(change, 0)]
    )  # the change as its round sampled it
    updates["x"] = -change * 40  # what a freeloader downloads, sent back as its own work
    check = check_uploads(figures(updates, [RecentChange(3, seed, sampled)]))["x"]
    assert check.code == "copy" and check.copy_of == "the change published as version 3"
    assert check.copy_cosine == pytest.approx(1.0)


def test_direction_is_not_judged_with_two_uploads_or_without_a_common_direction() -> None:
    updates = honest(1)
    updates["noise"] = flat(77)
    assert set(codes(updates).values()) == {None}  # who is the odd one out? not said
    independent = {f"r{i}": flat(i) for i in range(5)}  # no common direction at all
    assert set(codes(independent).values()) == {None}


def test_an_update_that_dominates_the_sum_is_still_judged_by_the_others_median() -> None:
    updates = honest(3)
    updates["huge"] = flat(3) * 1e7  # noise, unclipped: g is all but this one
    check = check_uploads(figures(updates))["huge"]
    assert check.loo_cosine is None  # the difference would be rounding error: not given
    assert check.code == "unaligned" and abs(check.median_cosine) < 0.03


def test_in_a_sparse_round_an_upload_sharing_few_coordinates_is_not_judged() -> None:
    """Top-k uploads: the others' median holds few values, and an honest upload may share
    only a few dozen sampled coordinates with it, too few to show any direction; a dense
    round still judges such a mostly-zero upload, and noise in the sparse round is still
    left out."""

    def top(x: torch.Tensor) -> torch.Tensor:  # what the sparse codec sends: 1024 of 4096
        codec = SparseCodec(topk=1024)
        return codec.decode(codec.encode(x))

    signal = flat(0)
    updates = {f"h{i}": top(flat(100 + i, signal, noise=1.5)) for i in range(5)}
    few = torch.rand(N, generator=torch.Generator().manual_seed(5)) < 0.01
    updates["few"] = flat(200, signal, noise=1.5) * few  # honest, 1% of the values
    noise = top(flat(999))
    updates["noise"] = noise * float(updates["h0"].norm() / noise.norm())
    f = figures(updates)
    sparse = check_uploads(replace(f, sparse=True))
    assert sparse["few"].code is None and sparse["few"].median_cosine > 0.3
    assert sparse["noise"].code == "unaligned"
    assert {sparse[f"h{i}"].code for i in range(5)} == {None}
    dense = check_uploads(f)  # in a dense round a mostly-zero upload is judged
    assert dense["few"].code == "unaligned" and dense["noise"].code == "unaligned"


def test_the_sample_is_every_strideth_value_from_the_phase_whatever_the_chunking() -> None:
    x = torch.arange(N, dtype=torch.float32)
    sampling = Sampling.for_round(N, 12345)
    assert sampling.stride == max(1, N // (1 << 14)) and 0 <= sampling.phase < sampling.stride
    sampler = Sampler(SHAPES, [sampling])
    sampler.upload("u", "b", 10_000, x[20_000 + 10_000 :])  # out of order, two pieces
    sampler.upload("u", "a", 0, x[:20_000])
    sampler.upload("u", "b", 0, x[20_000:30_000])
    (got,) = sampler.uploads()["u"]
    want = x[sampling.phase :: sampling.stride]
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 31])
def test_every_leave_one_out_median_is_torchs_median_of_the_others(n):
    # what the direction check compares each upload with, taken for all at once: the same
    # values as torch.median over the others, ties included
    from diloco.outer.checks import _others_medians

    gen = torch.Generator().manual_seed(n)
    own = torch.randn(n, 257, generator=gen, dtype=torch.float64)
    own[:, :40] = torch.randint(-2, 3, (n, 40), generator=gen).double()  # many ties
    got = _others_medians(own)
    for k in range(n):
        others = torch.cat([own[:k], own[k + 1 :]])
        want = others.median(dim=0).values if len(others) > 2 else others.mean(dim=0)
        assert torch.equal(got[k], want), k


def test_the_copy_check_finds_each_uploads_nearest_earlier_upload_by_the_matrix():
    from diloco.outer.checks import _cosine, _earlier_copies

    gen = torch.Generator().manual_seed(3)
    samples = [torch.randn(512, generator=gen) for _ in range(6)]
    samples[4] = -0.9 * samples[1]  # a scaled, negated copy of an earlier one
    samples[5] = torch.zeros(512)  # no direction: no cosine
    ids = [f"u{k}" for k in range(6)]
    f = RoundFigures(
        ids=ids, norms=dict.fromkeys(ids, 1.0), coefficients=dict.fromkeys(ids, 0.2),
        dots=dict.fromkeys(ids, 0.0), g_sq=1.0,
        samples={i: [s] for i, s in zip(ids, samples, strict=True)}, recent=[], reference=1.0,
    )  # fmt: skip
    got = _earlier_copies(f)
    for k, i in enumerate(ids[1:5], start=1):
        cos = {j: abs(_cosine(samples[k], samples[m])) for m, j in enumerate(ids[:k])}
        best = max(cos, key=lambda j: cos[j])
        assert got[i][1] == best and got[i][0] == pytest.approx(cos[best], abs=1e-12), i
    assert got["u4"] == (pytest.approx(1.0), "u1")
    assert got["u5"] == (None, None)
