"""A minimal server-rendered status page until the dashboard lands: runs and their rounds."""

from __future__ import annotations

from html import escape

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server.rounds.models import Round
from server.runs.models import Run


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


async def render(session: AsyncSession) -> str:
    runs = list(await session.scalars(select(Run).order_by(Run.created_at.desc())))
    sections = []
    for run in runs:
        rounds = await session.scalars(
            select(Round).where(Round.run_id == run.id).order_by(Round.index.desc()).limit(20)
        )
        rows = "".join(
            f"<tr><td>{r.index}</td><td>{escape(r.state)}</td><td>{r.accepted}</td>"
            f"<td>{r.tokens:,}</td><td>{_fmt(r.train_loss)}</td><td>{_fmt(r.eval_loss)}</td>"
            f"<td>{escape(r.close_reason or '')}</td></tr>"
            for r in rounds
        )
        sections.append(
            f"<h2>{escape(run.name)} <small>{escape(run.id)} · {escape(run.status)} · "
            f"version {run.checkpoint_version}</small></h2>"
            "<table><tr><th>round</th><th>state</th><th>accepted</th><th>tokens</th>"
            f"<th>train loss</th><th>eval loss</th><th>reason</th></tr>{rows}</table>"
        )
    body = "".join(sections) or "<p>No runs yet: <code>diloco run create CONFIG.toml</code></p>"
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>DiLoCo Hub</title>"
        "<meta http-equiv=refresh content=5><style>body{font:14px system-ui;margin:2em}"
        "table{border-collapse:collapse}td,th{padding:2px 8px;border-bottom:1px solid #ddd;"
        "text-align:left}</style></head><body><h1>DiLoCo Hub</h1>"
        f"{body}<p><a href=/docs>API</a> · <a href=/metrics>metrics</a></p></body></html>"
    )
