"""The close's critical path with uploads scored on arrival, beside the close that scores
them itself (issue 29, item 1; ``server.rounds.arrival_scores``).

For each size, K uploads of a round (one shared direction and a little noise each, through
the real int8 codec and wire encoder) are closed by ``diloco.outer.close.close_round`` from
the same files, on the same base version:

- **in the close**: each upload with its lease's scored windows and no score: the close
  scores all K (a round of at most 8 is scored whole), as every close did before;
- **on arrival**: each upload scored first, one after the other as the round worker does
  while the round is open (timed: the arrival cost), then the close with those scores;
- **scoring off**, the limit measured in the same run.

The last two run in turn ``REPEAT`` times and the least time of each is kept (the machine
is shared). All run the same pass, checks, step and writes (the judge is left out of each:
it is the same work either way). Printed per size: each close's time and ``score`` stage,
the arrival cost per upload, and the goal: the close with arrival scores takes at most
``SLACK`` times the close without scoring, i.e. the scoring left the critical path and
nothing else grew.

    python bench/close_scoring.py [--sizes 10M,50M] [--uploads 8] [--windows 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from diloco.config import RunConfig, parse_config
from diloco.model.architectures import build_model
from diloco.outer.close import CloseInputs, Upload, close_round
from diloco.outer.scoring import Scorer, Windows
from diloco.simulate.server import SIM_RUN_ID, Standings, open_round
from diloco.simulate.versions import Versions
from diloco.train import parameters_of
from diloco.wire.codec import make_codec
from diloco.wire.contribution import ContributionMeta, encode_contribution

SIZES = {"10M": (6, 384, 6), "50M": (8, 720, 6), "tiny": (1, 64, 4)}  # layers, width, heads
BLOCK = 128
SLACK = 1.25  # the close's own noise between runs of the same work on a shared machine
REPEAT = 3  # closes of each kind, in turn: the least of each is compared


def config(shape: tuple[int, int, int], windows: int) -> RunConfig:
    n_layer, n_embd, n_head = shape
    return parse_config(
        {
            "name": "close-scoring",
            "model": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": BLOCK},
            "data": {"path": "corpus.txt"},
            "inner": {"steps": 10, "batch_size": 8},
            "rounds": {"quorum": 1, "max_rounds": 10},
            "aggregation": {"score_windows": windows},
        }
    )


def uploads(cfg: RunConfig, params: dict[str, torch.Tensor], k: int, folder: Path) -> list[Upload]:
    """K bodies sharing a direction, small enough that applied alone each moves the loss
    by far less than the scoring's tolerance (so every one passes it)."""
    gen = torch.Generator().manual_seed(0)
    common = {n: 1e-5 * torch.randn(t.shape, generator=gen) for n, t in params.items()}
    codec = make_codec(cfg.compression.kind, cfg.compression.block_size)
    standings, out = Standings(), []
    for i in range(k):
        delta = {n: c + 2e-6 * torch.randn(c.shape, generator=gen) for n, c in common.items()}
        meta = ContributionMeta(
            run_id=SIM_RUN_ID, round=1, base_version=0, tokens=cfg.lease_tokens,
            inner_steps=cfg.inner.steps, loss=3.0, codec=codec.describe(),
        )  # fmt: skip
        chunks = list(encode_contribution(meta, {n: codec.encode(t) for n, t in delta.items()}))
        path = folder / f"upload-{i}.bin"
        path.write_bytes(b"".join(chunks))
        admitted = open_round(cfg, 1, standings).admit(str(i), f"v{i}", chunks)
        assert hasattr(admitted, "source"), admitted
        own = random_windows(cfg, seed=100 + i)
        out.append(Upload(str(i), path, admitted.source.weight, admitted.source.norm, own))
    return out


def random_windows(cfg: RunConfig, seed: int) -> Windows:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (cfg.aggregation.score_windows, BLOCK + 1), generator=gen)
    return Windows(tokens[:, :-1], tokens[:, 1:])


def close(
    cfg: RunConfig, versions: Versions, ups: list[Upload], sample: Windows | None
) -> tuple[float, float]:
    """One close of the round (its files written to the version's temp paths, then
    replaced by the next close's): its seconds and its score stage's."""
    inputs = CloseInputs(
        SIM_RUN_ID, 1, cfg, versions.latest.params, versions.latest.state, ups, [], 1,
        versions.paths(1), score_sample=sample,
    )  # fmt: skip
    started = time.perf_counter()
    closed = close_round(inputs, evaluate=lambda p, d: 0.0, base_judge_loss=0.0)
    seconds = time.perf_counter() - started
    assert closed.committed and closed.pending is not None and not closed.excluded
    closed.pending.write().commit_rest()
    return seconds, closed.seconds.get("score", 0.0)


def measure(label: str, k: int, windows: int) -> bool:
    cfg = config(SIZES[label], windows)
    torch.manual_seed(0)
    params = {n: p.detach().clone() for n, p in parameters_of(build_model(cfg.model)).items()}
    n_params = sum(t.numel() for t in params.values())
    with tempfile.TemporaryDirectory(prefix="close-scoring-") as scratch:
        ups = uploads(cfg, params, k, Path(scratch))
        sample = random_windows(cfg, seed=1)
        versions = Versions(cfg, params, run_id=SIM_RUN_ID)
        try:
            in_close, score_stage = close(cfg, versions, ups, sample)
            started = time.perf_counter()
            scorer = Scorer(cfg, versions.latest.params, sample)
            scored = [replace(u, score=scorer.score(u.path, own(u)), own=None) for u in ups]
            arrival = (time.perf_counter() - started) / k
            del scorer
            offs, arrivals = [], []
            for _ in range(REPEAT):  # in turn, so that both see the same machine
                offs.append(close(cfg, versions, ups, None)[0])
                on, left = close(cfg, versions, scored, sample)
                arrivals.append(on)
        finally:
            versions.cleanup()
    off, on_arrival = min(offs), min(arrivals)
    limit = SLACK * off
    met = on_arrival <= limit
    print(f"== {label}: {n_params / 1e6:.1f}M parameters, {k} uploads, {windows} windows")
    print(f"  close, scoring off         {off:8.2f} s  (the least of {REPEAT})")
    print(f"  close, scoring in it       {in_close:8.2f} s  (its score stage {score_stage:.2f} s)")
    verdict = "met" if met else "NOT MET"
    print(f"  close, scores on arrival   {on_arrival:8.2f} s  (the least of {REPEAT}; score stage "
          f"{left:.2f} s); "
          f"limit {limit:.2f} s ({SLACK} x scoring off): {verdict}")  # fmt: skip
    print(f"  arrival cost per upload    {arrival:8.2f} s  (off the critical path)")
    return met


def own(upload: Upload) -> Windows:
    assert upload.own is not None
    return upload.own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,50M", help="of " + ", ".join(SIZES))
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--windows", type=int, default=8, help="[aggregation] score_windows")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the close's thread runs
    results = [measure(label, args.uploads, args.windows) for label in args.sizes.split(",")]
    print("Goals: " + ("met" if all(results) else "NOT MET"))


if __name__ == "__main__":
    main()
