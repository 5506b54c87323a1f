"""Work trained on other data than its lease's (issue 26): does the score's ``own_alignment``
tell it from honest work, and how often does the close's suspect rule then name it?

A base model (the demo's, trained ``--warm`` steps on the text, its AdamW state kept as a
returning volunteer's), then ``--leases`` leases, each trained twice from that base with
that state for H steps: honestly on its lease's batches, and on other batches of the same
text (a volunteer that trains, but not on what it was dealt). Both Δs go through the run's
codec into upload bodies and are scored as the close scores them (``diloco.outer.scoring``:
``score_windows`` windows drawn across the lease's batches, the judging windows of held-out
text), with the gains' verdict beside the alignment.

Then rounds of four honest uploads and one on other data, drawn from the measured figures
(``--rounds`` draws), each put to ``diloco.protocol.audit.suspect`` with the direction
cosines all alike (work on other data points with the round: the direction rule names no
one), and rounds of five honest ones: how often the other-data upload is the suspect, how
often within three rounds, and how often an honest round has a suspect (a replay spent on
honest work, which passes).

    python bench/own_alignment.py            # ~3 min on one core
    python bench/own_alignment.py --quick    # a toy model, into bench/out/own_alignment
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doc_sections import replace_section  # noqa: E402

from diloco.checkpoint import write_params  # noqa: E402
from diloco.config import RunConfig, parse_config  # noqa: E402
from diloco.data.text import random_batch  # noqa: E402
from diloco.model.architectures import build_model  # noqa: E402
from diloco.outer.optimizer import pseudo_gradient  # noqa: E402
from diloco.outer.scoring import Score, Scorer, Windows, lease_windows  # noqa: E402
from diloco.protocol.audit import suspect  # noqa: E402
from diloco.train import InnerTrainer, load_parameters, snapshot  # noqa: E402
from diloco.wire.contribution import ContributionMeta, encode_contribution  # noqa: E402
from diloco.wire.exchange import encode_delta  # noqa: E402
from tests.support.corpora import TINYSHAKESPEARE  # noqa: E402

HONEST, ELSEWHERE = 4, 1  # a round's uploads in the draws


def run_config(quick: bool, windows: int | None = None) -> RunConfig:
    raw = tomllib.loads((REPO / "examples" / "demo.toml").read_text())
    raw["data"]["path"] = str(TINYSHAKESPEARE)
    if windows is not None:
        raw["aggregation"] = {"score_windows": windows}
    if quick:
        raw["model"] = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
        raw["inner"]["batch_size"] = 8
    return parse_config(raw)


def batch(text: torch.Tensor, cfg: RunConfig, gen: torch.Generator) -> tuple:
    return random_batch(
        text, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size, generator=gen
    )


def measure(args: argparse.Namespace, cfg: RunConfig, work: Path) -> list[tuple[Score, Score]]:
    """Each lease's (honest, other-data) scores."""
    raw = TINYSHAKESPEARE.read_bytes()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    cut = int(len(data) * 0.95)
    train_text, held_out = data[:cut], data[cut:].long()
    torch.manual_seed(0)
    H = cfg.inner.steps
    trainer = InnerTrainer(
        build_model(cfg.model), cfg.inner, total_steps=args.warm + 10 * H,
        device=torch.device("cpu"),
    )  # fmt: skip
    warm = torch.Generator().manual_seed(1)
    trainer.start_lease(snapshot(trainer.model))
    trainer.run(args.warm, start_step=0, next_batch=lambda: batch(train_text, cfg, warm))
    base, state = snapshot(trainer.model), copy.deepcopy(trainer.optimizer.state_dict())
    write_params(work / "base.safetensors", base, version=0)
    windows = cfg.aggregation.score_windows
    scorer = Scorer(cfg, work / "base.safetensors",
                    Windows.validation(held_out, windows, cfg.model.block_size))  # fmt: skip

    def upload(batches: list, name: str) -> Path:
        load_parameters(trainer.model, base)
        trainer.optimizer.load_state_dict(copy.deepcopy(state))
        trainer.start_lease(base)
        feed = iter(batches)
        trainer.run(H, start_step=args.warm, next_batch=lambda: next(feed))
        delta = pseudo_gradient(base, snapshot(trainer.model))
        encoded, codec, _ = encode_delta(delta, cfg.compression)
        meta = ContributionMeta("run", 1, 0, 1000, H, 3.0, codec)
        path = work / f"{name}.upload"
        path.write_bytes(b"".join(encode_contribution(meta, encoded)))
        return path

    pairs = []
    for lease in range(args.leases):
        gen = torch.Generator().manual_seed(100 + lease)
        own, other = ([batch(train_text, cfg, gen) for _ in range(H)] for _ in range(2))
        # the windows the close reads again, drawn by a round's secret (here the lease's)
        picked = lease_windows(iter(own).__next__, cfg, steps=H, secret=lease, lease=100 + lease)
        honest = scorer.score(upload(own, "honest"), picked)
        pairs.append((honest, scorer.score(upload(other, "other"), picked)))
    return pairs


def draws(pairs: list[tuple[Score, Score]], rounds: int) -> dict[str, float]:
    """The suspect rule on rounds drawn (with replacement) from the measured alignments
    (module docstring)."""
    honest = [h.own_alignment for h, _ in pairs if h.own_alignment is not None]
    other = [o.own_alignment for _, o in pairs if o.own_alignment is not None]
    rng = random.Random(0)
    named = flagged = 0
    for _ in range(rounds):
        mixed = rng.choices(honest, k=HONEST) + rng.choices(other, k=ELSEWHERE)
        ids = [f"h{i}" for i in range(HONEST)] + ["other"]
        alike = dict.fromkeys(ids, 0.9)
        named += suspect(alike, dict(zip(ids, mixed, strict=True))) == "other"
        clean = rng.choices(honest, k=HONEST + ELSEWHERE)
        ids = [f"h{i}" for i in range(len(clean))]
        flagged += suspect(dict.fromkeys(ids, 0.9), dict(zip(ids, clean, strict=True))) is not None
    per_round = named / rounds
    return {"named": per_round, "within3": 1 - (1 - per_round) ** 3, "honest": flagged / rounds}


def render(
    args: argparse.Namespace, cfg: RunConfig, pairs: list[tuple[Score, Score]], odds: dict
) -> str:
    def row(label: str, scores: list[Score]) -> str:
        a = [s.own_alignment for s in scores if s.own_alignment is not None]
        gains = sum(s.failed for s in scores)
        return (f"| {label} | {statistics.fmean(a):+.4f} | {min(a):+.4f} | {max(a):+.4f} | "
                f"{gains} of {len(scores)} |")  # fmt: skip

    above = sum(
        1
        for h, o in pairs
        if h.own_alignment is not None
        and o.own_alignment is not None
        and h.own_alignment > o.own_alignment
    )
    m = cfg.model
    return "\n".join(
        [
            "## Work on other data: the score's alignment with its own lease "
            "(`bench/own_alignment.py`, issue 26)",
            "",
            f"The demo's model ({m.n_layer} layers, width {m.n_embd}) trained {args.warm} "
            f"steps on tinyshakespeare, then {args.leases} leases of H = {cfg.inner.steps} "
            "from that base and its AdamW state, each trained honestly and on other batches of "
            "the same text, int8 uploads scored as the close scores them "
            f"({cfg.aggregation.score_windows} windows). *own_alignment* = cos(Δ, ∇L(base; "
            "the windows scored, drawn across the lease's batches)) − cos(Δ, ∇L(base; the "
            "judging windows)).",
            "",
            "```",
            "python bench/own_alignment.py"
            + (" --quick" if args.quick else "")
            + (f" --windows {args.windows}" if args.windows is not None else ""),
            "```",
            "",
            "| work | own_alignment, mean | lowest | highest | failed by the gains |",
            "|---|---|---|---|---|",
            row("honest", [h for h, _ in pairs]),
            row("other data", [o for _, o in pairs]),
            "",
            f"- In {above} of {len(pairs)} leases the honest Δ is above the other-data one.",
            f"- The suspect rule (`diloco.protocol.audit.suspect`, {args.rounds} rounds drawn "
            f"from these figures): a round of {HONEST} honest uploads and one on other data "
            f"names the latter {odds['named']:.0%} of the time ({odds['within3']:.0%} within "
            f"three rounds, against 14% for the 5% draw alone); a round of "
            f"{HONEST + ELSEWHERE} honest ones has a suspect {odds['honest']:.0%} of the time "
            "(a replay that passes).",
            "",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--warm", type=int, default=800, help="the base's training steps")
    p.add_argument("--leases", type=int, default=16)
    p.add_argument("--windows", type=int, help="[aggregation] score_windows (the run's default)")
    p.add_argument("--rounds", type=int, default=20_000, help="rounds drawn for the rule")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--work-dir", type=Path, default=REPO / "bench" / "out" / "own_alignment")
    p.add_argument("--quick", action="store_true", help="a toy model, 3 leases, into --work-dir")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.warm, args.leases, args.rounds = 30, 3, 200
        args.work_dir.mkdir(parents=True, exist_ok=True)
        args.doc = args.work_dir / "benchmarks.md"
    cfg = run_config(args.quick, args.windows)
    with tempfile.TemporaryDirectory(prefix="own-alignment-") as work:
        pairs = measure(args, cfg, Path(work))
    section = render(args, cfg, pairs, draws(pairs, args.rounds))
    replace_section(args.doc, "own-alignment", section)
    print(section, flush=True)


if __name__ == "__main__":
    main()
