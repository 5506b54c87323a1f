"""A round's outer step in one pass over the model, a cache-sized chunk at a time.

For each chunk of each parameter (a whole number of int8 blocks) the pass reads the
round's stored uploads (``diloco.outer.upload_file``: small reusable buffers, never the
whole blob), dequantises them and sums them exactly with their weights (``diloco.outer.exact``:
the same bits in any order), measures each one's dot product
with the sum, then — when asked to step — applies the Nesterov outer step with the delta's
error feedback (``diloco.wire.delta``) and writes what its ``Outputs`` take in place in their
files (``diloco.wire.tensorfile``): the compressed delta and the new parameters' digest on
the close's critical path, the parameters, momentum and residual in its second pass
(``diloco.outer.rebuild``). Memory is a few chunks per
upload, whatever the model's size; the base version is read, never modified, so a step
the guard discards costs nothing to undo.

The Nesterov step, as ``torch.optim.SGD(nesterov=True)`` takes it with Δ as the gradient
(g the aggregate, m the momentum, r the residual, μ the momentum factor):

    m ← μ·m + g  (m ← g on the first step)     u ← g + μ·m  (u ← m without Nesterov)
    d ← r − lr·u    q ← quantise(d)    θ ← θ + decode(q)    r ← d − decode(q)

The uploads' bytes are hashed in file order as they are read, and each one's sha256
trailer checked at the end (``UploadFile.finish``): a stored upload damaged on disk makes
the pass raise ``SourceUnreadable`` and publishes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from diloco.checkpoint import MOMENTUM_PREFIX, RESIDUAL_PREFIX, OuterStateFile
from diloco.outer import exact, kernels
from diloco.outer.checks import Sampler
from diloco.outer.exact import Terms
from diloco.outer.upload_file import UploadFile
from diloco.wire import delta as deltas
from diloco.wire.tensorfile import TensorFileReader, TensorFileWriter

Shapes = Mapping[str, tuple[int, ...]]
CHUNK_ELEMENTS = 1 << 17  # 512 KiB of fp32: the ops stay in the core's L2 here
UPLOAD_BUFFER_BUDGET = 64 << 20  # bytes of upload chunks held at once, all uploads together


def chunk_elements(n_sources: int, align: int) -> int:
    """The pass's chunk: a multiple of ``align`` values (the delta codec's
    ``diloco.wire.delta.alignment``), smaller when many uploads share the buffer budget."""
    # per upload and element: two int8 read buffers and the decoded fp32 chunk
    want = min(CHUNK_ELEMENTS, UPLOAD_BUFFER_BUDGET // (6 * max(1, n_sources)))
    return max(align, want // align * align)


class FoldedSum(Protocol):
    """A sum of terms taken before the pass (``diloco.outer.fold.SumReader``)."""

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Hyper:
    lr: float
    momentum: float
    nesterov: bool


@dataclass
class Outputs:
    """Where a stepping pass writes the new version (temp files until committed). The close
    runs two passes over the same inputs (``diloco.outer.close``): the first writes the delta
    alone (what returning volunteers need, on the critical path) and only takes the sha256 of
    the parameters (a digest-only writer, no outer state); the second, off the critical path,
    writes the parameters and the outer state and only takes the delta's sha256, which must
    be the published one (``diloco.outer.rebuild``)."""

    params: TensorFileWriter
    state: TensorFileWriter | None  # None: the outer state is not written by this pass
    delta: TensorFileWriter

    def commit_delta(self) -> tuple[str, str]:
        """fsync and rename the delta (a digest-only one: its sha256 alone); the sha256 of
        the params file (as written or digested, not committed) and of the delta file."""
        return self.params.sha256(), self.delta.commit()

    def commit_rest(self) -> str:
        """fsync and rename the parameters and the outer state; the params file's sha256."""
        assert self.state is not None, "a pass that wrote no outer state has none to commit"
        sha = self.params.commit()
        self.state.commit()
        return sha

    def abort(self) -> None:
        """Remove what is not committed (a committed file stays)."""
        for w in (self.params, self.state, self.delta):
            if w is not None:
                w.abort()


@dataclass
class Step:
    """What a stepping pass needs besides the sum: the base version and the outputs."""

    hyper: Hyper
    params: TensorFileReader  # θ at the base version
    state: OuterStateFile  # its momentum and residual
    codec: deltas.DeltaCodec  # the published delta's
    out: Outputs
    sampler: Sampler | None = None  # samples the published change (``diloco.outer.checks``)


@dataclass
class PassResult:
    dots: dict[str, float]  # ⟨Δᵢ, g⟩ for each upload, g the pass's sum
    g_sq: float  # ‖g‖²
    change_sq: float = 0.0  # ‖θ_new − θ_old‖² (the published change)
    finite: bool = True  # the sum, the momentum and the change are all finite
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # g itself, when asked
    # where the pass's time went: read (uploads and base, hashing included), sum, step, write
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("read", "sum", "step", "write"), 0.0)
    )

    def lap(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[part] += now - since
        return now


def _range_chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(chunk, numel - s)) for s in range(0, numel, chunk)] or [(0, 0)]


def run_pass(
    uploads: Sequence[UploadFile],
    terms: Terms,
    shapes: Shapes,
    *,
    align: int,
    center: tuple[Mapping[str, torch.Tensor], float] | None = None,
    step: Step | None = None,
    keep: bool = False,
    sampler: Sampler | None = None,
    folded: FoldedSum | None = None,
) -> PassResult:
    """g = Σ wᵢcᵢΔᵢ / W (+ α·center) over every parameter, summed exactly
    (``diloco.outer.exact``: ``terms``); with ``step``, the outer step and the new version's
    files from g; with ``keep``, g itself (memory O(model)); with ``sampler``, each upload's
    values at its sampled coordinates (``diloco.outer.checks``); with ``folded``, the sum of
    the terms starts from it (``diloco.outer.fold``: the terms of uploads folded as they
    arrived) instead of from zero."""
    chunk = chunk_elements(len(uploads), align)
    decoded = [torch.empty(chunk, dtype=torch.float32) for _ in uploads]  # kept for the dots
    g_buf = torch.empty(chunk, dtype=torch.float32)
    acc_buf = torch.empty(chunk, dtype=torch.float64)  # the chunk's sum of terms
    term_buf = torch.empty(chunk, dtype=torch.float64)
    work = [torch.empty(chunk, dtype=torch.float32) for _ in range(5)] if step else []
    result = PassResult(dict.fromkeys((u.id for u in uploads), 0.0), 0.0)
    order = list(shapes)  # the new files' (a digest-only writer's) and an honest upload's order
    for name in order:
        shape = shapes[name]
        numel = math.prod(shape)
        for u in uploads:
            u.start_tensor(name, numel)
        kept = torch.empty(numel, dtype=torch.float32) if keep else None
        for start, n in _range_chunks(numel, chunk):
            acc = acc_buf[:n]
            if folded is None:
                acc.zero_()
            else:
                folded.read_into(name, start, acc)
            xs = [
                _add_chunk(u, factor, buf[:n], acc, term_buf[:n], name, start, sampler, result)
                for u, factor, buf in zip(uploads, terms.factors, decoded, strict=True)
            ]
            t = time.perf_counter()
            g = exact.value_into(g_buf[:n], acc, terms.scale, term_buf[:n])
            if sampler is not None:
                sampler.total(name, start, g)
            if center is not None:
                g.add_(center[0][name].view(-1)[start : start + n], alpha=center[1])
            for u, x in zip(uploads, xs, strict=True):
                result.dots[u.id] += float(torch.dot(x, g))
            result.g_sq += float(torch.dot(g, g))
            if kept is not None:
                kept[start : start + n] = g
            result.lap("sum", t)
            if step is not None and not _step_chunk(step, name, start, g, work, result):
                result.finite = False
                return result
        for u in uploads:
            u.end_tensor()
        if kept is not None:
            result.kept[name] = kept.view(shape)
    for u in uploads:
        u.finish()
    result.finite = result.finite and math.isfinite(result.g_sq) and math.isfinite(result.change_sq)
    return result


def _add_chunk(
    u: UploadFile,
    factor: float,
    buf: torch.Tensor,
    acc: torch.Tensor,
    work: torch.Tensor,
    name: str,
    start: int,
    sampler: Sampler | None,
    result: PassResult,
) -> torch.Tensor:
    """Read and decode an upload's chunk of ``name`` from ``start`` into ``buf``, add its
    term to ``acc`` (sampled on the way); the decoded values, for the dot products."""
    t = time.perf_counter()
    q = u.chunk(name, start, buf.numel())
    t = result.lap("read", t)
    x = u.add_into(q, start, buf, acc, factor, work)
    if sampler is not None:
        sampler.upload(u.id, name, start, x)
    result.lap("sum", t)
    return x


def _step_chunk(
    step: Step, name: str, start: int, g: torch.Tensor, work: list[torch.Tensor], res: PassResult
) -> bool:
    """The outer step on one chunk (module docstring; ``diloco.outer.kernels``: fused for
    the int8 delta codec when it can be built here); False when it is not finite."""
    n = g.numel()
    theta, m, r = (w[:n] for w in work[:3])
    hp, state = step.hyper, step.state
    t = time.perf_counter()
    step.params.read_into(name, start, theta)
    if state.has_momentum:
        state.reader.read_into(MOMENTUM_PREFIX + name, start, m)
    if state.has_residual:
        state.reader.read_into(RESIDUAL_PREFIX + name, start, r)
    else:
        r.zero_()
    t = res.lap("read", t)
    done = kernels.step(hp, step.codec, g, work, has_momentum=state.has_momentum)
    if done is None:
        return False
    if step.sampler is not None:
        step.sampler.change(name, start, done.change)
    res.change_sq += float(torch.dot(done.change, done.change))
    t = res.lap("step", t)
    out = step.out
    out.params.write(name, start, theta)
    if out.state is not None:
        out.state.write(MOMENTUM_PREFIX + name, start, m)
        out.state.write(RESIDUAL_PREFIX + name, start, done.residual)
    at, scale_at = deltas.piece_offsets(step.codec, start)
    out.delta.write(deltas.DATA + name, at, done.data)
    out.delta.write(deltas.SCALES + name, scale_at, done.scales)
    res.lap("write", t)
    return True
