"""A round's sum taken as its uploads arrive (issue 29: fold on arrival), so that after the
deadline only the last uploads, the step and the publish remain.

A round can be folded when every term of its sum is fixed before its uploads arrive
(``FoldPlan``): its clip limit comes from the run's recent history (``clip_multiple`` times
its median norm), not from the round's own uploads, and its grid (``diloco.outer.exact``)
from that limit and the most a lease can weigh. ``method = "mean"`` has no limit and
``centered_clip`` needs the round's mean first: neither is folded; nor is a round with too
little history to clip against (the run's first rounds).

The running sum lives in a ``FoldState``: a directory of the process that folds (the sum,
float64 in the model's order, 8 bytes a parameter; which uploads are in it; each one's
sampled values for the close's checks). The sum is exact, so the close that finds a state
adds the uploads not yet in it and takes out the ones it leaves out (a term taken out
exactly), and publishes the very bits a close that reads every upload again would: a state
that is missing, of another boot, or left half-written by a crash is not used, and the close
reads the uploads again (``diloco.outer.attempt``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diloco.atomic import atomic_write_text
from diloco.config import AggregationSection, RunConfig
from diloco.outer import exact
from diloco.outer.checks import Sampler, Sampling
from diloco.outer.upload_file import UploadFile, upload_alignment
from diloco.wire.tensorfile import byte_view

Shapes = Mapping[str, tuple[int, ...]]
CHUNK = 1 << 18  # values per read-add-write of the sum (2 MiB of float64)


@dataclass(frozen=True)
class FoldPlan:
    """What fixes every term of a folded round: its clip limit and its grid."""

    limit: float  # ‖cᵢΔᵢ‖ ≤ limit: clip_multiple × the history's median norm
    unit: float  # the grid (``diloco.outer.exact.grid_unit`` of the most a term can be)

    @classmethod
    def of_run(cls, cfg: RunConfig, history: Sequence[float]) -> FoldPlan | None:
        """The plan of a round of a run with ``cfg`` opened after ``history`` (the run's
        latest aggregated norms); None when it is not folded (``[aggregation] fold`` off)."""
        if not cfg.aggregation.fold:
            return None
        return cls.for_round(
            cfg.aggregation, history, cfg.lease_tokens_for(cfg.inner.lease_max_steps)
        )

    @classmethod
    def for_round(
        cls, policy: AggregationSection, history: Sequence[float], max_weight: float
    ) -> FoldPlan | None:
        """None when the round cannot be folded (module docstring); ``max_weight``: the most
        tokens one upload can count for."""
        if policy.method != "clipped_mean" or len(history) < policy.reference_min:
            return None
        limit = policy.clip_multiple * statistics.median(history)
        if not (math.isfinite(limit) and limit > 0 and max_weight > 0):
            return None
        return cls(limit, exact.grid_unit(max_weight * limit))

    def clip(self, norm: float) -> float:
        return 1.0 if norm <= self.limit else self.limit / norm

    def factor(self, weight: float, norm: float) -> float:
        """The upload's term is round(Δ · factor)."""
        return weight * self.clip(norm) / self.unit

    def terms(self, weights: Sequence[float], norms: Sequence[float], total: float) -> exact.Terms:
        factors = tuple(self.factor(w, n) for w, n in zip(weights, norms, strict=True))
        return exact.Terms(self.unit, factors, total)


def boot_id() -> str:
    """This machine's boot: a state written before a reboot may have lost pages."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class _Meta:
    plan: dict[str, float]
    seeds: list[int]  # the samplings' seeds: the round's own, then the recent changes'
    names: list[str]  # the parameters in the sum's order
    boot: str
    ids: list[str]  # the uploads in the sum, in the order folded
    pending: str | None  # the uploads being folded: the sum is not to be trusted


@dataclass(frozen=True)
class Arrival:
    """An upload to fold: its id, its stored body on this machine and its factor
    (``FoldPlan.factor``)."""

    id: str
    path: Path
    factor: float


def _read_meta(folder: Path) -> _Meta | None:
    try:
        return _Meta(**json.loads((folder / "meta.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def folded_ids(folder: Path) -> list[str]:
    """The uploads the sum in ``folder`` holds; none when there is none or a fold was cut
    short (the next fold starts it afresh). Whether it can be trusted for a round's plan
    and samplings is ``FoldState.usable``'s to say."""
    meta = _read_meta(folder)
    return [] if meta is None or meta.pending is not None else list(meta.ids)


class FoldState:
    """A round's running sum on this machine's disk (module docstring)."""

    def __init__(self, folder: Path, shapes: Shapes) -> None:
        self.folder = folder
        self.shapes = dict(shapes)
        self.numel = sum(math.prod(s) for s in shapes.values())
        self.offsets: dict[str, int] = {}
        at = 0
        for name, shape in shapes.items():
            self.offsets[name] = at
            at += math.prod(shape)

    @property
    def _sum(self) -> Path:
        return self.folder / "sum.f64"

    def _meta(self) -> _Meta | None:
        return _read_meta(self.folder)

    def _write_meta(self, meta: _Meta) -> None:
        with atomic_write_text(self.folder / "meta.json") as f:
            f.write(json.dumps(asdict(meta)))

    def usable(self, plan: FoldPlan, seeds: Sequence[int]) -> list[str] | None:
        """The uploads in the sum when it can be trusted for ``plan`` and the close's
        samplings; None when it cannot (missing, another plan or boot, a fold cut short)."""
        meta = self._meta()
        if (
            meta is None
            or meta.pending is not None
            or meta.plan != asdict(plan)
            or meta.seeds != list(seeds)
            or meta.names != list(self.shapes)
            or meta.boot != boot_id()
        ):
            return None
        try:
            if self._sum.stat().st_size != 8 * self.numel:
                return None
        except OSError:
            return None
        return list(meta.ids)

    def start(self, plan: FoldPlan, seeds: Sequence[int]) -> None:
        """An empty sum for ``plan`` (whatever was here before is dropped)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "meta.json").unlink(missing_ok=True)
        with open(self._sum, "wb") as f:
            f.truncate(8 * self.numel)  # zeros
        self._write_meta(_Meta(asdict(plan), list(seeds), list(self.shapes), boot_id(), [], None))

    def fold(
        self, plan: FoldPlan, seeds: Sequence[int], arrivals: Sequence[Arrival], codec: dict
    ) -> None:
        """Add the terms of the uploads ``arrivals`` (``codec``'s bodies) to this sum for
        ``plan`` and the close's samplings (``seeds``), in one pass over the sum; started
        afresh when it cannot be trusted (``usable``). A stored upload that cannot be read
        raises ``SourceUnreadable`` naming it, and leaves the state for ``usable`` to refuse
        once the sum was touched."""
        if not arrivals:
            return
        if self.usable(plan, seeds) is None:
            self.start(plan, seeds)
        sampler = Sampler(self.shapes, [Sampling.for_round(self.numel, s) for s in seeds])
        with contextlib.ExitStack() as opened:
            uploads = [
                opened.enter_context(
                    contextlib.closing(UploadFile(a.id, a.path, self.shapes, codec))
                )
                for a in arrivals
            ]
            self._add(uploads, [a.factor for a in arrivals], sampler, align=upload_alignment(codec))

    def _add(
        self, uploads: Sequence[UploadFile], factors: Sequence[float], sampler: Sampler, *,
        align: int,
    ) -> None:  # fmt: skip
        """Add stored uploads' terms, each chunk of the sum read and written once for all of
        them, and keep their values at ``sampler``'s coordinates for the close's checks.
        Marked pending while the sum changes: a crash, or a trailer that does not match at
        the end, leaves a state ``usable`` refuses."""
        meta = self._meta()
        assert meta is not None and meta.pending is None, "fold on a usable state only"
        ids = [u.id for u in uploads]
        self._write_meta(replace(meta, pending=" ".join(ids)))
        chunk = max(align, CHUNK // align * align)
        x_buf = torch.empty(chunk, dtype=torch.float32)
        acc = torch.empty(chunk, dtype=torch.float64)
        work = torch.empty(chunk, dtype=torch.float64)
        # the uploads' own order when they share one: each is then hashed as it is read
        order = uploads[0].order if all(u.order == uploads[0].order for u in uploads) else []
        fd = os.open(self._sum, os.O_RDWR)
        try:
            for name in order or list(self.shapes):
                numel = math.prod(self.shapes[name])
                for upload in uploads:
                    upload.start_tensor(name, numel)
                for start in range(0, numel, chunk):
                    n = min(chunk, numel - start)
                    offset = 8 * (self.offsets[name] + start)
                    self.read_into(fd, acc[:n], offset)
                    for upload, factor in zip(uploads, factors, strict=True):
                        q = upload.chunk(name, start, n)
                        x = upload.add_into(q, start, x_buf[:n], acc[:n], factor, work[:n])
                        sampler.upload(upload.id, name, start, x)
                    os.pwrite(fd, byte_view(acc[:n]), offset)
                for upload in uploads:
                    upload.end_tensor()
            for upload in uploads:
                upload.finish()  # the trailer: a damaged blob leaves the state pending
        finally:
            os.close(fd)
        samples = sampler.uploads()
        for upload in uploads:
            self._save_samples(upload.id, samples[upload.id])
        self._write_meta(replace(meta, ids=[*meta.ids, *ids]))

    @staticmethod
    def read_into(fd: int, out: torch.Tensor, offset: int) -> None:
        view = byte_view(out)
        if os.preadv(fd, [view], offset) != len(view):
            raise OSError(f"the fold's sum ended early at byte {offset}")

    def open_sum(self) -> SumReader:
        return SumReader(self._sum, self.offsets)

    def _save_samples(self, upload_id: str, samples: Sequence[torch.Tensor]) -> None:
        save_file(
            {f"s{i}": t.contiguous() for i, t in enumerate(samples)},
            str(self.folder / f"{upload_id}.samples"),
        )

    def samples(self, upload_id: str) -> list[torch.Tensor]:
        loaded = load_file(str(self.folder / f"{upload_id}.samples"))
        return [loaded[f"s{i}"] for i in range(len(loaded))]

    def drop(self) -> None:
        """Remove the state (the round closed, or its plan changed)."""
        if not self.folder.exists():
            return
        for p in self.folder.iterdir():
            p.unlink(missing_ok=True)
        self.folder.rmdir()


def fold_files(
    folder: Path, shapes: Shapes, plan: FoldPlan, seeds: Sequence[int],
    arrivals: Sequence[Arrival], codec: dict,
) -> None:  # fmt: skip
    """``FoldState(folder, shapes).fold(...)``: everything in files, so another process can
    do it (``server.rounds.folding`` does, away from the requests' GIL)."""
    FoldState(folder, shapes).fold(plan, seeds, arrivals, codec)


class SumReader:
    """The folded sum, read chunk by chunk by the close's pass."""

    def __init__(self, path: Path, offsets: Mapping[str, int]) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._offsets = offsets

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        FoldState.read_into(self._fd, out, 8 * (self._offsets[name] + start))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
