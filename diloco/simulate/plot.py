"""Eval loss against tokens and against inner steps for ``diloco simulate`` results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def label_of(result: dict[str, Any]) -> str:
    if result["mode"] != "diloco":
        return f"{result['mode']} (seed {result['seed']})"
    drop = f", drop {result['drop_prob']:.0%}" if result["drop_prob"] else ""
    return f"DiLoCo H={result['inner_steps']} {result['compression']}{drop} (seed {result['seed']})"


def plot_results(
    results: Sequence[dict[str, Any]], out: str | Path, *, title: str = "eval loss"
) -> None:
    """Draw every result's per-round eval loss against tokens (left) and against inner
    steps per worker (right) into one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # plotting is an optional extra
        raise RuntimeError("plotting needs matplotlib: pip install 'diloco-hub[plot]'") from err
    fig, (by_tokens, by_steps) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=110)
    lowest = min(r["eval_loss"] for result in results for r in result["rounds"])
    for result in results:
        rounds = result["rounds"]
        label = result.get("label") or label_of(result)
        losses = [r["eval_loss"] for r in rounds]
        by_tokens.plot([r["tokens"] for r in rounds], losses, label=label, linewidth=1.4)
        steps = [r["round"] * result["inner_steps"] for r in rounds]
        by_steps.plot(steps, losses, label=label, linewidth=1.4)
    by_tokens.set_xlabel("tokens trained on (all workers)")
    by_steps.set_xlabel("inner steps per worker (time, at equal speed)")
    for ax in (by_tokens, by_steps):
        ax.set_ylabel("eval loss (nats / byte)")
        ax.set_ylim(lowest - 0.05, lowest + 0.8)  # the interesting part, not the first rounds
        ax.grid(alpha=0.3)
    by_steps.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def load_results(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
