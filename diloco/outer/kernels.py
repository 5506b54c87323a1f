"""The close's hot loops as fused C kernels with the same bits as plain torch: the outer step
on one chunk, and an int8 upload's chunk added to the round's exact sum (``add_int8``: decode,
weigh, round, add in one pass, as ``Int8Codec.decode_into`` then ``exact.add_term`` do in
five; the library is refused when it loads unless both agree with torch, ``adds_alike``).

The step (``diloco.outer.chunked``'s module docstring) on a chunk of θ, momentum m, residual
r and the round's sum g, publishing the change in the run's delta codec:

    m ← μ·m + g     u ← g + μ·m (Nesterov) or m     d ← r − lr·u
    q ← quantise(d)     θ ← θ + decode(q)     r ← d − decode(q)

``plain_step`` is that in torch ops (about 20 a chunk, each a pass over memory); for the
int8 delta codec (the default) ``fused_step`` does it in one pass a block: a small C
kernel (``step_kernel.c``, beside this module), compiled with the machine's C compiler
at first use and cached, split over ``torch.get_num_threads()`` threads by whole blocks
(each value's arithmetic is the same whatever the split, so the result is too). ``step``
takes the fused kernel when it is there and the plain path otherwise: a server with no
compiler, another codec, or ``DILOCO_FUSED_KERNELS=0``.

Both give the same bits, because the kernel does each value's operations in torch's order
and with torch's roundings, and the compiler is told not to fuse any other (``-ffp-contract=off``,
no fast-math):

- ``m.mul_(μ).add_(g)``: two roundings (μ·m, then + g), μ as fp32;
- ``torch.add(g, m, alpha=μ)`` and ``torch.add(r, u, alpha=-lr)``: ATen's vectorised ``add``
  is ``fmadd(m, μ, g)``, one rounding, on every element (its loop tail too, measured), so
  the kernel uses ``fmaf``;
- ``Int8Codec.encode``: absmax / 127 per block, a true division by the scale (or by 1 for
  an all-zero block), round half to even, clamp to ±127; ``decode``: code · scale; θ + change
  and d − change, one rounding each.

A torch build whose ``add`` rounds twice (one without FMA) would differ: the library is
checked against ``plain_step`` on awkward values when it is loaded, and not used if any bit
differs. ‖change‖² stays torch's ``dot`` (its summation order is BLAS's) in both paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from diloco.outer import exact
from diloco.wire import delta as deltas
from diloco.wire.codec import Int8Codec, NonFiniteError

if TYPE_CHECKING:
    from diloco.outer.chunked import Hyper

log = logging.getLogger(__name__)

SWITCH = "DILOCO_FUSED_KERNELS"  # "0": always the plain torch path
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")

# the kernel's C source, shipped beside this module (package data)
SOURCE = Path(__file__).with_name("step_kernel.c").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Published:
    """A chunk's step: its delta's codes and scales, the decoded change and the residual
    (θ and m are updated in place)."""

    data: torch.Tensor  # the codec's data: int8 codes, or diloco.wire.lowbit's packed bytes
    scales: torch.Tensor  # fp32, one a block
    change: torch.Tensor  # decode(codes): what θ took
    residual: torch.Tensor  # d − change


def plain_step(
    hp: Hyper,
    codec: deltas.DeltaCodec,
    g: torch.Tensor,
    theta: torch.Tensor,
    m: torch.Tensor,
    r: torch.Tensor,
    spare: tuple[torch.Tensor, torch.Tensor],
    *,
    has_momentum: bool,
) -> Published | None:
    """The step in torch ops, any delta codec: the reference. ``spare`` are two fp32
    buffers of g's length (u and d); None when d is not finite."""
    u, d = spare
    if has_momentum:
        m.mul_(hp.momentum).add_(g)
    else:
        m.copy_(g)
    if hp.nesterov:
        torch.add(g, m, alpha=hp.momentum, out=u)
    else:
        u.copy_(m)
    torch.add(r, u, alpha=-hp.lr, out=d)
    try:  # an overflow anywhere above (g, m, u) shows in d
        encoded, change = deltas.publish_change(d, codec)
    except NonFiniteError:
        return None
    deltas.apply_change(theta, change)
    d.sub_(change)  # the residual carried into the next round
    return Published(encoded.data, encoded.scales, change, d)


def fused_step(
    lib: ctypes.CDLL,
    hp: Hyper,
    codec: Int8Codec,
    g: torch.Tensor,
    theta: torch.Tensor,
    m: torch.Tensor,
    r: torch.Tensor,
    change: torch.Tensor,
    *,
    has_momentum: bool,
    threads: int = 0,
) -> Published | None:
    """The same step as ``plain_step`` for the int8 codec in one kernel call: θ, m, r (then
    the residual) in place, ``change`` filled; ``threads`` 0: torch's thread count. The
    tensors are flat, contiguous fp32 of one length; None when d is not finite."""
    n = g.numel()
    for t in (theta, m, r, change):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n:
            raise ValueError("fused_step takes flat contiguous fp32 chunks of one length")
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(codec.n_blocks(n), dtype=torch.float32)
    finite = lib.diloco_step_int8(
        *(t.data_ptr() for t in (theta, m, r, g.contiguous(), change, codes, scales)),
        n,
        codec.block_size,
        ctypes.c_float(hp.momentum),
        ctypes.c_float(-hp.lr),
        int(has_momentum),
        int(hp.nesterov),
        threads or torch.get_num_threads(),
    )
    return Published(codes, scales, change, r) if finite else None


def step(
    hp: Hyper,
    codec: deltas.DeltaCodec,
    g: torch.Tensor,
    work: list[torch.Tensor],
    *,
    has_momentum: bool,
) -> Published | None:
    """The step on a chunk whose θ, m and r were read into ``work[:3]`` (r zeroed when the
    base version has none); ``work[3:5]`` are spare: the fused kernel for the int8 codec
    when it loaded, ``plain_step`` otherwise. The same bits either way."""
    n = g.numel()
    theta, m, r, u, d = (w[:n] for w in work)
    if isinstance(codec, Int8Codec) and (lib := library()) is not None:
        return fused_step(lib, hp, codec, g, theta, m, r, u, has_momentum=has_momentum)
    return plain_step(hp, codec, g, theta, m, r, (u, d), has_momentum=has_momentum)


# ---------------------------------------------------------------- building and loading


def cache_dir() -> Path:
    """Where built kernels are kept: ``DILOCO_KERNEL_CACHE``, else the XDG cache."""
    if env := os.environ.get("DILOCO_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "diloco" / "kernels"


def _machine() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        info = ""
    lines = [ln for ln in info.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")]
    return platform.machine() + "\n" + (lines[0] if lines else platform.processor())


def build(compiler: str, folder: Path) -> Path:
    """The kernel's shared library, compiled by ``compiler`` into ``folder`` unless a
    build of this source, these flags, this compiler and this CPU is there already.
    Raises OSError or CalledProcessError when it cannot be built."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = "\n".join((SOURCE, " ".join(FLAGS), version, _machine()))
    path = folder / f"step_int8-{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = Path(tmp) / "step.c", Path(tmp) / "step.so"
        src.write_text(SOURCE, encoding="utf-8")
        subprocess.run(
            [compiler, *FLAGS, "-pthread", "-o", str(out), str(src)],
            capture_output=True,
            check=True,
            timeout=120,
        )
        os.replace(out, path)  # whole or not at all, whoever else builds it meanwhile
    return path


def add_int8(
    acc: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    codec: Int8Codec,
    factor: float,
    x: torch.Tensor,
    work: torch.Tensor,
) -> torch.Tensor:
    """An int8 upload's chunk ``q`` (from a block boundary, ``scales`` its blocks') into the
    exact sum: x ← ``codec.decode_into``, acc += round(x · factor) (``exact.add_term``, with
    ``work`` a float64 buffer), in one pass of the fused kernel when it loaded, in those two
    steps otherwise: the same bits. The decoded values, ``x``."""
    if (lib := library()) is None:
        codec.decode_into(q, scales, x)
        exact.add_term(acc, x, factor, work)
        return x
    for t, dtype in (
        (q, torch.int8),
        (scales, torch.float32),
        (x, torch.float32),
        (acc, torch.float64),
    ):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError("add_int8 takes contiguous int8 codes, fp32 scales and x, fp64 acc")
    n = q.numel()
    if x.numel() != n or acc.numel() != n or scales.numel() < codec.n_blocks(n):
        raise ValueError("add_int8: q, x and acc of one length, a scale for each block")
    lib.diloco_add_int8(
        q.data_ptr(), scales.data_ptr(), n, codec.block_size, ctypes.c_double(factor),
        x.data_ptr(), acc.data_ptr(),
    )  # fmt: skip
    return x


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.diloco_add_int8.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.diloco_add_int8.argtypes += [ctypes.c_int64, ctypes.c_double, ctypes.c_void_p]
    lib.diloco_add_int8.argtypes += [ctypes.c_void_p]
    lib.diloco_add_int8.restype = None
    lib.diloco_step_int8.argtypes = [ctypes.c_void_p] * 7 + [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.diloco_step_int8.restype = ctypes.c_int
    return lib


def awkward_chunk(n: int, seed: int) -> dict[str, torch.Tensor]:
    """θ, m, r and g of ``n`` values with the cases that tell two roundings from one:
    values of every scale, signed zeros, subnormals, values near overflow; and in
    [n/4, 5n/8) (whole blocks when a block is at most n/8) g = m = 0, r = -0 then +0:
    blocks whose d is all -0, then all +0."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("theta", "m", "r", "g"):
        x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen))
        pick = torch.randint(0, 12, (n,), generator=gen)
        x[pick == 0] = 0.0
        x[pick == 1] = -0.0
        x[pick == 2] *= 1e-38  # subnormal, or nearly
        x[pick == 3] = torch.randn(int((pick == 3).sum()), generator=gen) * 1e37
        out[name] = x
    lo, mid, hi = n // 4, (n // 4 + 5 * n // 8) // 2, 5 * n // 8
    out["g"][lo:hi] = 0.0
    out["m"][lo:hi] = 0.0
    out["r"][lo:mid], out["r"][mid:hi] = -0.0, 0.0
    return out


def agrees(lib: ctypes.CDLL) -> bool:
    """Whether the kernels give torch's bits here: the step ``plain_step``'s, with and
    without momentum and Nesterov, on 1 and 3 threads, and the sum's (``adds_alike``); a few
    milliseconds."""
    from diloco.outer.chunked import Hyper  # here: chunked imports this module

    codec, n = Int8Codec(64), 1000 + 37  # blocks cut at the end; a tail past the vector loops
    for seed, (momentum, nesterov, threads) in enumerate(
        [(True, True, 1), (False, True, 3), (True, False, 3), (False, False, 1)]
    ):
        hp = Hyper(0.7, 0.9, nesterov)
        a, b = awkward_chunk(n, seed), awkward_chunk(n, seed)
        spare = (torch.empty(n), torch.empty(n))
        want = plain_step(
            hp, codec, a["g"], a["theta"], a["m"], a["r"], spare, has_momentum=momentum
        )
        args = (lib, hp, codec, b["g"], b["theta"], b["m"], b["r"], torch.empty(n))
        got = fused_step(*args, has_momentum=momentum, threads=threads)
        if want is None or got is None or not same(want, got, a, b):
            return False
    return adds_alike(lib)


def adds_alike(lib: ctypes.CDLL) -> bool:
    """Whether the kernel's ``diloco_add_int8`` gives ``decode_into`` then
    ``exact.add_term``'s bits here: every code, scales of every scale (zero, subnormal, near
    overflow), factors that put products on ties and past 2**52, a block cut at the end."""
    codec, n = Int8Codec(64), 1000 + 37
    gen = torch.Generator().manual_seed(7)
    q = torch.arange(n, dtype=torch.int64).remainder(255).sub(127).to(torch.int8)
    scales = torch.randn(codec.n_blocks(n), generator=gen) * torch.exp2(
        torch.randint(-140, 120, (codec.n_blocks(n),), generator=gen).float()
    )
    scales[:2] = torch.tensor([0.0, 0.5])
    for factor in (1.0, 3.0, -2.5e-3, 2.0**40, -(2.0**-30)):
        acc = torch.randn(n, generator=gen, dtype=torch.float64).mul(2.0**20).round()
        want_acc, want_x = acc.clone(), torch.empty(n)
        codec.decode_into(q, scales, want_x)
        exact.add_term(want_acc, want_x, factor, torch.empty(n, dtype=torch.float64))
        x = torch.empty(n)
        args = (q.data_ptr(), scales.data_ptr(), n, codec.block_size, ctypes.c_double(factor))
        lib.diloco_add_int8(*args, x.data_ptr(), acc.data_ptr())
        if not (x.view(torch.int32).equal(want_x.view(torch.int32)) and acc.equal(want_acc)):
            return False
    return True


def same(want: Published, got: Published, a: dict, b: dict) -> bool:
    """Bit for bit: codes, scales, change, residual, θ and m."""
    pairs = [
        (want.data, got.data),
        (want.scales, got.scales),
        (want.change, got.change),
        (want.residual, got.residual),
        (a["theta"], b["theta"]),
        (a["m"], b["m"]),
    ]
    return all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in pairs)


@cache
def library() -> ctypes.CDLL | None:
    """The fused kernels, built at first use (about a second) and kept; None when they are
    switched off, cannot be built here, or do not agree with torch (``agrees``): the plain
    paths then run, with the same bits, slower."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        lib = load(build(compiler, cache_dir()))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning(
            "the fused outer step is off (plain torch runs): %s cannot build it: %s", compiler, err
        )
        return None
    if not agrees(lib):
        log.warning("the fused outer step is off: its bits differ from torch's on this machine")
        return None
    return lib
