"""Eval loss against tokens for one or more ``diloco simulate`` result files (matplotlib)."""

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
    results: Sequence[dict[str, Any]], out: str | Path, *, title: str = "eval loss vs tokens"
) -> None:
    """Draw every result's per-round eval loss against tokens into one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # plotting is an optional extra
        raise RuntimeError("plotting needs matplotlib: pip install 'diloco-hub[plot]'") from err
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for result in results:
        rounds = result["rounds"]
        ax.plot(
            [r["tokens"] for r in rounds],
            [r["eval_loss"] for r in rounds],
            label=result.get("label") or label_of(result),
            linewidth=1.4,
        )
    ax.set_xlabel("tokens trained on (all workers)")
    ax.set_ylabel("eval loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def load_results(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
