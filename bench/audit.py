"""Audits by replay (docs/verification.md): does a replay tell honest work from each kind
of freeloading, and with how much room?

One volunteer's lease of round 2 (its AdamW state carried from its round 1, as a volunteer
that stays has), trained by the client's own ``LocalTrainer``, is replayed as a verifier
replays it (``client.verify``: the state restored from the file the upload committed to,
the lease's base, data, seed and steps, another thread count than the volunteer's) and
compared with what each kind of volunteer uploads for that lease:

- honest: the lease as given (must pass: cosine ≥ 0.99, norm within 10%);
- stale base: the same data and steps from version v − 2 (round 1's base);
- other data: another shard (the lease's data not read), and the lease's shard with
  other batches (another seed);
- fewer steps: half of H, claiming H;
- noise at the honest norm; the honest update scaled by 0.5 (a copy "diluted");
- fresh-state lie: trained honestly, but committing to a fresh AdamW state it did not
  start from (its replay then starts fresh): why the start is committed.

Every kind but honest must fail. Prints each kind's cosine, norm ratio and relative
error beside the rule, and whether the goal holds, measured in this run.

    python bench/audit.py [--data FILE] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attacks import config  # noqa: E402
from tests.support.corpora import TINYSHAKESPEARE  # noqa: E402

if TYPE_CHECKING:  # torch and the trainer load only once the arguments are read
    import torch

    from client.training import LocalTrainer
    from diloco.config import RunConfig
    from diloco.data.text import Dataset
    from diloco.protocol.audit import Verdict
    from diloco.protocol.messages import Lease

    Params = dict[str, torch.Tensor]


def main() -> None:
    args = parse_args()
    bench = Bench.make(args.data, args.steps)
    kinds, replayed, from_fresh = uploads(bench)
    results = verdicts(kinds, replayed, from_fresh)
    print_verdicts(bench, args.data, results)
    print_goal(results)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=TINYSHAKESPEARE)
    ap.add_argument("--steps", type=int, default=20, help="H of the lease")
    return ap.parse_args()


@dataclass(frozen=True)
class Bench:
    """The run the leases belong to: its config, data and version 0; ``steps`` is H."""

    cfg: RunConfig
    data: Dataset
    config_json: dict[str, Any]
    v0: Params
    steps: int

    @classmethod
    def make(cls, data_path: Path, steps: int) -> Bench:
        import torch

        from diloco.config import parse_config
        from diloco.data.text import simulated_data
        from diloco.model.architectures import build_model
        from diloco.train import parameters_of

        raw = config(data_path, 10, "clipped_mean")
        raw["inner"]["steps"] = steps
        cfg, data = simulated_data(parse_config(raw), 4)
        torch.manual_seed(0)
        v0 = {n: p.detach().clone() for n, p in parameters_of(build_model(cfg.model)).items()}
        return cls(cfg, data, cfg.model_dump(mode="json"), v0, steps)

    def lease(self, round_: int, shard: int, seed: int, steps: int) -> Lease:
        from diloco.protocol.messages import CheckpointRef, Lease, ShardRef

        ref: dict[str, Any] = {"url": "-", "sha256": "0" * 64, "nbytes": 0}
        return Lease(
            lease_id="bench", run_id="bench", round=round_, base_version=round_ - 1,
            checkpoint=CheckpointRef(version=round_ - 1, **ref),
            shard=ShardRef(index=shard, chunk_len=self.data.chunk_len, **ref),
            config=self.config_json, inner_steps=steps,
            start_step=(round_ - 1) * self.cfg.inner.steps,
            seed=seed, deadline=datetime.now(UTC), lease_expires_at=datetime.now(UTC),
            heartbeat_interval_s=10.0, max_upload_bytes=1 << 40,
        )  # fmt: skip

    def trainer(self) -> LocalTrainer:
        """A fresh trainer for this run, on the CPU in fp32."""
        import torch

        from client.training import LocalTrainer

        local = LocalTrainer(torch.device("cpu"), precision="fp32", micro_batch=16)
        local.prepare(self.config_json)
        return local

    def version_1(self) -> Params:
        """Version 0 after one lease's training (an outer step of lr 1)."""
        from diloco.train import parameters_of

        first = self.trainer()
        first.train(self.lease(1, 0, 10, self.steps), self.v0, self.data.shards[0], **NO_HOOKS)
        assert first.trainer is not None  # prepared
        return {n: p.detach().clone() for n, p in parameters_of(first.trainer.model).items()}

    def volunteer(self) -> LocalTrainer:
        """A volunteer after its round 1 (lease on shard 1 from v0): its state carried."""
        local = self.trainer()
        local.train(self.lease(1, 1, 11, self.steps), self.v0, self.data.shards[1], **NO_HOOKS)
        return local

    def uploaded(self, local: LocalTrainer, base: Params, the: Lease, steps: int) -> Params:
        """Train ``the`` lease from ``base`` for ``steps`` and encode Δ from there, as its
        volunteer would (claiming the lease's base, v1): the decoded upload."""
        from diloco.wire.codec import codec_from_description
        from diloco.wire.contribution import checked_decode

        shard = self.data.shards[the.shard.index]
        result = local.train(
            the, base, shard, **NO_HOOKS, until=lambda d: "x" if d >= steps else None
        )
        body = local.contribution(the, base, result)
        codec = codec_from_description(body.meta.codec)
        return {n: checked_decode(n, codec, t) for n, t in body.tensors.items()}


def uploads(bench: Bench) -> tuple[dict[str, Params], Params, Params]:
    """What each kind of volunteer uploads for the round-2 lease, the verifier's replay of
    the honest one (from the state its upload committed to, on another thread count), and
    a replay from a fresh AdamW state."""
    import torch

    H = bench.steps
    v0, v1 = bench.v0, bench.version_1()
    the = bench.lease(2, 2, 22, H)
    torch.set_num_threads(1)  # the volunteer's threads; the replay below uses two
    kinds: dict[str, Params] = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "start.safetensors"
        honest = bench.volunteer()
        honest.save_state(start, run_id="bench", round=1)  # what its upload commits to
        kinds["honest"] = bench.uploaded(honest, v1, the, H)
        kinds["stale base (v - 2)"] = bench.uploaded(bench.volunteer(), v0, the, H)
        other_data = bench.lease(2, 3, 22, H)
        kinds["other data (shard 3)"] = bench.uploaded(bench.volunteer(), v1, other_data, H)
        other_batches = bench.lease(2, 2, 99, H)
        kinds["other batches (seed)"] = bench.uploaded(bench.volunteer(), v1, other_batches, H)
        kinds["fewer steps (H / 2)"] = bench.uploaded(bench.volunteer(), v1, the, max(1, H // 2))
        kinds.update(forgeries(kinds["honest"]))

        torch.set_num_threads(2)
        replayer = bench.trainer()
        replayer.restore_state(start, run_id="bench")
        replayed = bench.uploaded(replayer, v1, the, H)
        from_fresh = bench.uploaded(bench.trainer(), v1, the, H)
    return kinds, replayed, from_fresh


def forgeries(honest: Params) -> dict[str, Params]:
    """Uploads made without training: noise at the honest norm, the honest one halved."""
    import torch

    gen = torch.Generator().manual_seed(1)
    norm = torch.cat([x.flatten() for x in honest.values()]).norm()
    noise = {n: torch.randn(x.shape, generator=gen) for n, x in honest.items()}
    scale = norm / torch.cat([x.flatten() for x in noise.values()]).norm()
    return {
        "noise at the honest norm": {n: x * scale for n, x in noise.items()},
        "honest x 0.5": {n: x * 0.5 for n, x in honest.items()},
    }


def verdicts(kinds: dict[str, Params], replayed: Params, from_fresh: Params) -> dict[str, Verdict]:
    """Each kind's upload compared with the replay, as a verifier compares them."""
    from client.verify import compare

    results: dict[str, Verdict] = {k: compare(replayed, u) for k, u in kinds.items()}
    results["fresh-state lie"] = compare(from_fresh, kinds["honest"])
    return results


def print_verdicts(bench: Bench, data_path: Path, results: dict[str, Verdict]) -> None:
    from diloco.protocol.audit import MIN_COSINE, NORM_RATIO

    cfg = bench.cfg
    low, high = NORM_RATIO
    print(
        f"one lease of H={bench.steps} on {data_path.name}, "
        f"{cfg.model.n_layer} layers x {cfg.model.n_embd}"
    )
    print(f"rule: passes at cosine >= {MIN_COSINE} and norm ratio {low}..{high}\n")
    print(f"{'upload':<26} {'cosine':>8} {'norm ratio':>10} {'rel error':>10}  verdict")
    for kind, v in results.items():
        verdict = "passes" if v.passed else "fails"
        print(f"{kind:<26} {v.cosine:>8.4f} {v.norm_ratio:>10.3f} {v.rel_error:>10.3g}  {verdict}")


def print_goal(results: dict[str, Verdict]) -> None:
    """Whether honest passes and every other kind fails, and the closest forgery."""
    from diloco.protocol.audit import NORM_RATIO

    low, high = NORM_RATIO
    met = results["honest"].passed and not any(
        v.passed for k, v in results.items() if k != "honest"
    )
    in_norm = {
        k: v.cosine for k, v in results.items() if k != "honest" and low <= v.norm_ratio <= high
    }
    closest = max(in_norm, key=in_norm.__getitem__) if in_norm else None
    near = "none" if closest is None else f"{closest}, cosine {in_norm[closest]:.4f}"
    print(
        f"\ngoal: honest passes, every other kind fails: {'met' if met else 'NOT met'} "
        f"(honest cosine {results['honest'].cosine:.6f}; the closest forgery within the "
        f"norm bounds: {near})"
    )


NO_HOOKS: dict[str, Any] = {"on_step": lambda done, loss, tokens: None, "stop": lambda: False}

if __name__ == "__main__":
    main()
