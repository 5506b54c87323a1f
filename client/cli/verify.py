"""``diloco verify``: replay a contribution's lease on this machine and compare it with the
upload (``client.verify``); with ``--pending``, work through a run's pending audits as a
verifier, reporting each finding to the server."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from client.api import ServerAPI
from client.cli.run import RunId, Server
from client.cli.support import ExitStatus, fail, run_api

Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="The admin token, or the token of an account the admin made a verifier.",
        envvar="DILOCO_TOKEN",
    ),
]


def verify(
    run: RunId,
    server: Server,
    round_: Annotated[int | None, typer.Argument(metavar="ROUND", help="The round.")] = None,
    contributor: Annotated[
        str | None, typer.Argument(help="The contributor whose upload to replay (ctr_…).")
    ] = None,
    token: Token = None,
    device: Annotated[str, typer.Option(help="cpu, cuda, mps or auto.")] = "cpu",
    pending: Annotated[
        bool, typer.Option("--pending", help="Claim the run's pending audits and decide them.")
    ] = False,
    report: Annotated[
        bool, typer.Option("--report", help="Report the finding on this upload's audit.")
    ] = False,
    max_audits: Annotated[
        int, typer.Option("--max", min=1, help="With --pending: at most this many.")
    ] = 100,
) -> None:
    """Train a contribution's lease again (same base, data, seed, steps and starting AdamW
    state) and compare with its upload: passes at cosine >= 0.99 and a norm within 10%.
    Exit 0 when it passes, 6 when it does not, 7 when it cannot be replayed."""
    from client.progress import Reporter
    from client.training import resolve_device
    from client.verify import Unverifiable, VolunteerFault, replay

    if pending == (round_ is not None or contributor is not None):
        fail("name a ROUND and a CONTRIBUTOR, or pass --pending (not both)", ExitStatus.USAGE)
    if not pending and (round_ is None or contributor is None):
        fail("name both the ROUND and the CONTRIBUTOR", ExitStatus.USAGE)
    if token is None:
        fail("pass --token (the admin's, or a verifier's)", ExitStatus.USAGE)
    say, where = Reporter(), resolve_device(device)

    async def one(api: ServerAPI, index: int, who: str, audit: dict[str, Any] | None) -> str:
        entry = await api.ledger(run, index, who)
        finding = await replay(api, entry, device=where, say=say)
        audit = audit or entry.get("audit")
        line = f"round {index}, {who}: "
        if isinstance(finding, Unverifiable):
            typer.echo(line + f"cannot be replayed: {finding.why}")
            return "unverifiable"
        result: dict[str, Any]
        if isinstance(finding, VolunteerFault):
            typer.echo(line + f"FAILED: {finding.why}")
            result, outcome = {"failure": finding.why}, "failed"
        else:
            typer.echo(line + ("passed: " if finding.passed else "FAILED: ") + finding.sentence())
            result = {
                "cosine": finding.cosine,
                "rel_error": finding.rel_error,
                "norm_ratio": finding.norm_ratio,
            }
            outcome = "passed" if finding.passed else "failed"
        if audit is not None and (pending or report) and audit.get("status") == "pending":
            decided = await api.decide_audit(run, audit["id"], result)
            typer.echo(f"  audit {decided['id']}: {decided['status']}")
        return outcome

    async def call(api: ServerAPI) -> list[str]:
        if not pending:
            assert round_ is not None and contributor is not None
            return [await one(api, round_, contributor, None)]
        outcomes = []
        for _ in range(max_audits):
            audit = await api.claim_audit(run)
            if audit is None:
                break
            outcomes.append(await one(api, audit["round"], audit["contributor_id"], audit))
        typer.echo(f"{len(outcomes)} audit(s): " + _counts(outcomes))
        return outcomes

    outcomes = run_api(server, token, call)
    if not pending and outcomes == ["unverifiable"]:
        raise typer.Exit(7)
    if not pending and outcomes == ["failed"]:
        raise typer.Exit(6)


def _counts(outcomes: list[str]) -> str:
    kinds = ("passed", "failed", "unverifiable")
    return ", ".join(f"{outcomes.count(k)} {k}" for k in kinds)
