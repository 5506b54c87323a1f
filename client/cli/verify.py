"""``diloco verify``: replay a contribution's lease on this machine and compare it with the
upload (``client.verify``); with ``--pending``, work through a run's pending audits as a
verifier, reporting each finding to the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from client.api import ServerAPI
from client.cli.run import RunId, Server
from client.cli.support import ExitStatus, fail, run_api

if TYPE_CHECKING:  # imported where used: they load torch
    import torch

    from client.progress import Reporter
    from client.verify import Finding

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

    _check_arguments(round_, contributor, token, pending=pending)
    say = Reporter()
    verifier = _Verifier(run, resolve_device(device), say, decide=pending or report)

    async def call(api: ServerAPI) -> list[str]:
        if pending:
            return await verifier.pending(api, max_audits)
        assert round_ is not None and contributor is not None
        return [await verifier.one(api, round_, contributor, None)]

    outcomes = run_api(server, token, call)
    if not pending:
        _exit_for(outcomes)


def _check_arguments(
    round_: int | None, contributor: str | None, token: str | None, *, pending: bool
) -> None:
    """A ROUND and a CONTRIBUTOR, or --pending; and a token: else exit with USAGE."""
    if pending == (round_ is not None or contributor is not None):
        fail("name a ROUND and a CONTRIBUTOR, or pass --pending (not both)", ExitStatus.USAGE)
    if not pending and (round_ is None or contributor is None):
        fail("name both the ROUND and the CONTRIBUTOR", ExitStatus.USAGE)
    if token is None:
        fail("pass --token (the admin's, or a verifier's)", ExitStatus.USAGE)


@dataclass(frozen=True)
class _Verifier:
    """Replays uploads of ``run`` on ``device``; ``decide``: report each finding on its
    upload's audit while that audit is pending."""

    run: str
    device: torch.device
    say: Reporter
    decide: bool

    async def one(self, api: ServerAPI, index: int, who: str, audit: dict[str, Any] | None) -> str:
        """Replay round ``index``'s upload by ``who``, say what was found and, where asked,
        decide its audit; the outcome: passed, failed or unverifiable."""
        from client.verify import replay

        entry = await api.ledger(self.run, index, who)
        finding = await replay(api, entry, device=self.device, say=self.say)
        audit = audit or entry.get("audit")
        outcome, result = _tell(f"round {index}, {who}: ", finding)
        if result is None:
            return outcome
        if audit is not None and self.decide and audit.get("status") == "pending":
            decided = await api.decide_audit(self.run, audit["id"], result)
            typer.echo(f"  audit {decided['id']}: {decided['status']}")
        return outcome

    async def pending(self, api: ServerAPI, max_audits: int) -> list[str]:
        """Claim and decide the run's pending audits, at most ``max_audits``; say the counts."""
        outcomes = []
        for _ in range(max_audits):
            audit = await api.claim_audit(self.run)
            if audit is None:
                break
            outcomes.append(await self.one(api, audit["round"], audit["contributor_id"], audit))
        typer.echo(f"{len(outcomes)} audit(s): " + _counts(outcomes))
        return outcomes


def _tell(line: str, finding: Finding) -> tuple[str, dict[str, Any] | None]:
    """Say what a replay found, after ``line``; the outcome, and the result to report on
    its audit (None: it could not be replayed, and nothing is reported)."""
    from client.verify import Unverifiable, VolunteerFault

    if isinstance(finding, Unverifiable):
        typer.echo(line + f"cannot be replayed: {finding.why}")
        return "unverifiable", None
    if isinstance(finding, VolunteerFault):
        typer.echo(line + f"FAILED: {finding.why}")
        return "failed", {"failure": finding.why}
    typer.echo(line + ("passed: " if finding.passed else "FAILED: ") + finding.sentence())
    result = {
        "cosine": finding.cosine,
        "rel_error": finding.rel_error,
        "norm_ratio": finding.norm_ratio,
    }
    return ("passed" if finding.passed else "failed"), result


def _exit_for(outcomes: list[str]) -> None:
    """One upload's outcome as the exit status: 0 passed, 6 failed, 7 unverifiable."""
    if outcomes == ["unverifiable"]:
        raise typer.Exit(7)
    if outcomes == ["failed"]:
        raise typer.Exit(6)


def _counts(outcomes: list[str]) -> str:
    kinds = ("passed", "failed", "unverifiable")
    return ", ".join(f"{outcomes.count(k)} {k}" for k in kinds)
