"""The simulator's checkpoint store: each version's files, as the server keeps them.

A simulated run keeps its versions in a temp dir of its own: the parameters file, the
outer state file (momentum and delta residual) and the delta from the version before (in
the run's download codec), written by the close itself (``diloco.outer.close``, through
``diloco.simulate.server.RoundDesk``) exactly as the server writes them. The published
parameters θ are the base's plus the decoded delta; what the compression left out is
carried in the residual r, so θ + r is the exact Nesterov iterate x (``exact``, for
information).

A round whose step was rejected, or that had nothing to aggregate, still publishes a
version in the simulator (the server reopens such a round, the blamed contributions left
out for good, to wait for more uploads: ``decide_after_guard``): the same files, and a
delta of zeros. With ``delta_dir`` every version's delta file is also copied there
(``delta-<version>.safetensors``).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from diloco.checkpoint import RESIDUAL_PREFIX, write_initial_state, write_params
from diloco.config import RunConfig
from diloco.outer.checks import RECENT_CHANGES, RecentChange
from diloco.outer.close import VersionPaths
from diloco.wire.delta import write_delta
from diloco.wire.exchange import delta_codec_for
from diloco.wire.tensorfile import TensorFileReader

Params = Mapping[str, torch.Tensor]


class Versions:
    """The latest version's files, in a temp dir removed by ``cleanup`` (or at exit)."""

    def __init__(
        self, cfg: RunConfig, params: Params, *, run_id: str, delta_dir: Path | None = None
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="diloco-simulate-")
        self.root = Path(self._tmp.name)
        self.run_id, self.delta_dir = run_id, delta_dir
        self.codec = delta_codec_for(cfg.compression)
        hparams = {
            "lr": cfg.outer.lr,
            "momentum": cfg.outer.momentum,
            "nesterov": cfg.outer.nesterov,
        }
        self.version = 0
        self.seed = cfg.seed
        self.recent: list[RecentChange] = []  # the last published changes, sampled
        base = self.paths(0)
        meta = {"run_id": run_id}
        write_params(base.params, params, version=0, metadata=meta)
        write_initial_state(base.state, names=list(params), hparams=hparams, metadata=meta)
        self.theta = self._read_params(base.params)
        self.shapes = {n: tuple(t.shape) for n, t in self.theta.items()}
        self.judge_loss: float | None = None  # the latest version's loss on the judging sample
        self.sizes: dict[int, int] = {}  # each version's delta file, in bytes
        self.residual_norms: list[float] = []  # ‖r‖ = ‖x − θ‖ after each version

    def paths(self, version: int) -> VersionPaths:
        return VersionPaths(
            self.root / f"{version}.safetensors",
            self.root / f"{version}.state.safetensors",
            self.root / f"{version}.delta.safetensors",
        )

    @property
    def latest(self) -> VersionPaths:
        return self.paths(self.version)

    def check_seed(self, version: int) -> int:
        """The close of ``version``'s round samples its uploads from this seed
        (``diloco.outer.checks``); the server draws one per round and keeps it secret, the
        simulator derives it from the run's seed so that a simulation replays."""
        return random.Random(f"{self.seed}/{version}").getrandbits(62)

    def published(
        self, version: int, judge_loss: float | None, change_sample: torch.Tensor | None = None
    ) -> None:
        """The close wrote ``version``'s files (``paths(version)``): it is the latest now.
        ``change_sample``: its change where its round sampled, kept for the next rounds'
        copy check (the last ``RECENT_CHANGES``)."""
        if change_sample is not None:
            change = RecentChange(version, self.check_seed(version), change_sample)
            self.recent = [*self.recent, change][-RECENT_CHANGES:]
        self._advance(version)
        self.theta = self._read_params(self.latest.params)
        self.judge_loss = judge_loss  # None: unjudged, measured by the next close if needed

    def unchanged(self, version: int) -> None:
        """No step in this round: ``version`` is the latest one's parameters and state
        again, with a delta of zeros."""
        before, now = self.latest, self.paths(version)
        shutil.copyfile(before.params, now.params)
        shutil.copyfile(before.state, now.state)
        zeros = {name: self.codec.encode(torch.zeros(shape)) for name, shape in self.shapes.items()}
        write_delta(
            now.delta,
            zeros,
            run_id=self.run_id,
            version=version,
            base_version=version - 1,
            codec=self.codec,
        )
        self._advance(version)

    def _advance(self, version: int) -> None:
        old, self.version = self.version, version
        paths = self.latest
        self.sizes[version] = paths.delta.stat().st_size
        if self.delta_dir is not None:
            shutil.copyfile(paths.delta, self.delta_dir / f"delta-{version:06d}.safetensors")
        self.residual_norms.append(
            sum(float(r.pow(2).sum()) for r in self.residual().values()) ** 0.5
        )
        gone = self.paths(old)  # only the latest version's files are kept
        for path in (gone.params, gone.state, gone.delta):
            path.unlink(missing_ok=True)

    def residual(self) -> dict[str, torch.Tensor]:
        """r of the latest version (zeros before the first step)."""
        with TensorFileReader(self.latest.state) as f:
            return {
                n: f.tensor(RESIDUAL_PREFIX + n).view(shape)
                if RESIDUAL_PREFIX + n in f.entries
                else torch.zeros(shape)
                for n, shape in self.shapes.items()
            }

    def exact(self) -> dict[str, torch.Tensor]:
        """x = θ + r: the outer iterate with nothing left out by quantisation."""
        r = self.residual()
        return {n: t + r[n] for n, t in self.theta.items()}

    @staticmethod
    def _read_params(path: Path) -> dict[str, torch.Tensor]:
        with TensorFileReader(path) as f:
            return {n: f.tensor(n) for n in json.loads(f.metadata["param_names"])}

    def cleanup(self) -> None:
        self._tmp.cleanup()
