"""The fused outer step (``diloco.outer.kernels``) publishes the plain torch step's bits."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
import torch

from diloco.outer import kernels
from diloco.outer.chunked import Hyper
from diloco.wire.codec import Int8Codec

CHUNKS = {  # name: (values, block size)
    "whole blocks": (4 * 4096, 4096),
    "a short last block": (3 * 64 + 17, 64),
    "shorter than one vector": (13, 64),
    "blocks of one value": (50, 1),
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    try:
        path = kernels.build(os.environ.get("CC", "cc"), tmp_path_factory.mktemp("kernels"))
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"no C compiler here ({err}): only the plain path can run")
    return kernels.load(path)


def edge_chunk(n: int, case: str) -> dict[str, torch.Tensor]:
    """θ, m, r, g of ``n`` values for the cases random values miss."""
    gen = torch.Generator().manual_seed(len(case))
    out = {k: torch.randn(n, generator=gen) for k in ("theta", "m", "r", "g")}
    if case == "zeros":
        out = {k: torch.zeros(n) for k in out}
    elif case == "negative zeros":  # d = -lr·(+0) + (-0) = -0: all-zero blocks of -0
        out = {k: torch.zeros(n) for k in out}
        out["r"].fill_(-0.0)
    elif case == "zeros of both signs":
        for t in out.values():
            t.copy_(torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, -0.0))
    elif case == "huge":  # the largest d that is still finite: near fp32's max
        out["g"].mul_(1e38).clamp_(-1.5e38, 1.5e38)
        out["m"].zero_(), out["r"].zero_()
    elif case == "tiny":  # subnormal d: scales round to 0 or to a few subnormal steps
        out = {k: t * 1e-43 for k, t in out.items()}
    return out


def both(
    lib: ctypes.CDLL,
    chunk: dict[str, torch.Tensor],
    hp: Hyper,
    codec: Int8Codec,
    *,
    momentum: bool,
    threads: int,
) -> tuple[tuple, tuple]:
    """(plain, fused): each path's Published (or None), and its θ and m after the step."""
    out = []
    for fused in (False, True):
        c = {k: t.clone() for k, t in chunk.items()}
        n = c["g"].numel()
        g, theta, m, r = c["g"], c["theta"], c["m"], c["r"]
        if fused:
            change = torch.empty(n)
            done = kernels.fused_step(
                lib, hp, codec, g, theta, m, r, change, has_momentum=momentum, threads=threads
            )
        else:
            spare = (torch.empty(n), torch.empty(n))
            done = kernels.plain_step(hp, codec, g, theta, m, r, spare, has_momentum=momentum)
        out.append((done, c["theta"], c["m"]))
    return out[0], out[1]


def assert_same_bits(plain: tuple, fused: tuple) -> None:
    (want, theta_w, m_w), (got, theta_g, m_g) = plain, fused
    assert want is not None and got is not None
    pairs = {
        "codes": (want.data, got.data),
        "scales": (want.scales, got.scales),
        "change": (want.change, got.change),
        "residual": (want.residual, got.residual),
        "theta": (theta_w, theta_g),
        "momentum": (m_w, m_g),
    }
    for name, (a, b) in pairs.items():  # bit patterns: -0 is not +0, NaN is itself
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    dot_w, dot_g = torch.dot(want.change, want.change), torch.dot(got.change, got.change)
    assert float(dot_w) == float(dot_g)  # change_sq


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("momentum,nesterov", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_fused_step_publishes_the_plain_steps_bits_on_awkward_values(
    lib, chunk, momentum, nesterov, threads
):
    n, block = CHUNKS[chunk]
    values = kernels.awkward_chunk(n, seed=n + threads)

    plain, fused = both(
        lib,
        values,
        Hyper(0.7, 0.9, nesterov),
        Int8Codec(block),
        momentum=momentum,
        threads=threads,
    )

    assert_same_bits(plain, fused)


@pytest.mark.parametrize("case", ["zeros", "negative zeros", "zeros of both signs", "huge", "tiny"])
def test_the_fused_step_publishes_the_plain_steps_bits_on_edge_cases(lib, case):
    values = edge_chunk(3 * 64 + 5, case)

    plain, fused = both(lib, values, Hyper(0.7, 0.9, True), Int8Codec(64), momentum=True, threads=2)

    assert_same_bits(plain, fused)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 100, 3 * 64 + 4])  # first block, the second thread's, last
def test_a_non_finite_sum_is_refused_by_both_paths(lib, bad, where):
    values = edge_chunk(3 * 64 + 5, "random")
    values["g"][where] = bad

    plain, fused = both(lib, values, Hyper(0.7, 0.9, True), Int8Codec(64), momentum=True, threads=2)

    assert plain[0] is None and fused[0] is None


def test_a_step_that_overflows_fp32_is_refused_by_both_paths(lib):
    values = edge_chunk(200, "random")
    values["g"][150] = 3e38  # finite, but g + μ·m is not

    plain, fused = both(
        lib, values, Hyper(0.7, 0.9, True), Int8Codec(64), momentum=False, threads=1
    )

    assert plain[0] is None and fused[0] is None


def test_a_build_that_lets_the_compiler_fuse_multiplies_and_adds_is_caught(tmp_path, monkeypatch):
    """The load-time check (and these tests' values) tell one rounding from two: the same
    source built with contraction allowed gives other bits, and is refused."""
    contracting = tuple(
        "-ffp-contract=fast" if f == "-ffp-contract=off" else f for f in kernels.FLAGS
    )
    monkeypatch.setattr(kernels, "FLAGS", contracting)
    try:
        path = kernels.build(os.environ.get("CC", "cc"), tmp_path)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"no C compiler here ({err})")
    lib = kernels.load(path)
    values = kernels.awkward_chunk(1037, seed=0)

    plain, fused = both(lib, values, Hyper(0.7, 0.9, True), Int8Codec(64), momentum=True, threads=1)

    assert not kernels.agrees(lib)
    with pytest.raises(AssertionError):
        assert_same_bits(plain, fused)


def test_without_a_compiler_the_plain_path_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DILOCO_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None
        values = edge_chunk(100, "random")
        work = [values[k].clone() for k in ("theta", "m", "r")] + [
            torch.empty(100),
            torch.empty(100),
        ]
        done = kernels.step(
            Hyper(0.7, 0.9, True), Int8Codec(64), values["g"], work, has_momentum=True
        )
        assert done is not None and done.residual.data_ptr() == work[4].data_ptr()  # plain's d
    finally:
        kernels.library.cache_clear()


def test_the_switch_turns_the_fused_step_off(lib, monkeypatch):
    monkeypatch.setenv(kernels.SWITCH, "0")
    kernels.library.cache_clear()
    try:
        assert kernels.library() is None
    finally:
        kernels.library.cache_clear()


def test_a_build_is_kept_and_found_again(tmp_path):
    compiler = os.environ.get("CC", "cc")
    try:
        first = kernels.build(compiler, tmp_path)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"no C compiler here ({err})")
    made = first.stat().st_mtime_ns

    again = kernels.build(compiler, tmp_path)

    assert again == first and again.stat().st_mtime_ns == made
    assert [p.name for p in Path(tmp_path).iterdir()] == [first.name]  # no temp left behind


def test_the_step_the_pass_calls_takes_the_kernel_for_int8_with_the_plain_bits(lib, monkeypatch):
    values = kernels.awkward_chunk(3 * 64 + 5, seed=7)
    results = []
    for loaded in (lib, None):
        monkeypatch.setattr(kernels, "library", lambda loaded=loaded: loaded)
        work = [values[k].clone() for k in ("theta", "m", "r")] + [torch.empty(197) for _ in "ud"]

        done = kernels.step(Hyper(0.7, 0.9, True), Int8Codec(64), values["g"], work,
                            has_momentum=True)  # fmt: skip

        assert done is not None
        taken = "fused" if done.residual.data_ptr() == work[2].data_ptr() else "plain"
        results.append((taken, done, {"theta": work[0], "m": work[1]}))
    (fused_by, fused, fw), (plain_by, plain, pw) = results
    assert (fused_by, plain_by) == ("fused", "plain")
    assert kernels.same(plain, fused, pw, fw)


def test_the_fused_sum_adds_the_plain_terms_bits(lib, monkeypatch):
    """An int8 upload's chunk into the exact sum: decode then round(x · factor) added, the
    kernel's bits against torch's, on awkward scales and factors (ties, huge, negative)."""
    assert kernels.adds_alike(lib)
    codec, n = Int8Codec(64), 3 * 64 + 5  # a short last block
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
    scales = torch.tensor([0.5, 1e-40, 3.0e30, 0.013])  # ties, subnormal, huge, plain
    got = []
    for loaded in (lib, None):
        monkeypatch.setattr(kernels, "library", lambda loaded=loaded: loaded)
        acc = torch.arange(n, dtype=torch.float64)
        x = kernels.add_int8(acc, q, scales, codec, -7.0, torch.empty(n), torch.empty_like(acc))
        got.append((x.clone(), acc))
    (kx, kacc), (px, pacc) = got
    assert kx.view(torch.int32).equal(px.view(torch.int32)) and kacc.equal(pacc)
    assert pacc[0] == -round(q[0].item() * 0.5 * 7.0)  # the term, on the grid


def test_a_build_whose_sum_rounds_otherwise_is_caught(tmp_path, monkeypatch):
    """The load-time check tells a kernel whose product is rounded to float (not double)."""
    wrong = kernels.SOURCE.replace(
        "nearbyint((double)xi * factor)", "nearbyintf(xi * (float)factor)"
    )
    assert wrong != kernels.SOURCE
    monkeypatch.setattr(kernels, "SOURCE", wrong)
    try:
        lib = kernels.load(kernels.build(os.environ.get("CC", "cc"), tmp_path))
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"no C compiler here ({err})")

    assert not kernels.adds_alike(lib) and not kernels.agrees(lib)
