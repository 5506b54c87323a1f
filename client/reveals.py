"""What an audited volunteer sends (docs/verification.md): the AdamW state a lease began
from, for the upload the server audits. An upload drawn at once says so in its receipt;
one a close audited later (its round's least aligned, ``[audit] suspects``) is listed by
``GET /runs/{id}/audits/mine``, which the worker asks after each upload. The starts of the
last two uploads are kept beside the state (``client.optimizer_state``): the one an audit
asks for is the file with the SHA-256 its upload committed to."""

from __future__ import annotations

import asyncio
from pathlib import Path

from client.audit_api import AuditAPI
from client.http import ApiError
from client.optimizer_state import PREVIOUS_START_FILE, START_FILE
from client.progress import Reporter
from diloco.atomic import file_sha256


class Revealer:
    def __init__(self, api: AuditAPI, say: Reporter, run_id: str, state: Path) -> None:
        self.api, self.say, self.run_id = api, say, run_id
        self.kept = [state.with_name(START_FILE), state.with_name(PREVIOUS_START_FILE)]

    async def reveal(self, round: int, audit_id: str, start: Path) -> bool:
        """Send ``start``, the state our upload of ``round`` began from, for the audit. A
        failure is a warning: the audit then fails when its time runs out, and the line
        says so."""
        try:
            await self.api.reveal_state(self.run_id, audit_id, start)
        except (ApiError, OSError) as err:
            why = err.detail if isinstance(err, ApiError) else str(err)
            self.say.warn(
                f"round {round}: audit {audit_id}: could not send the starting AdamW "
                f"state ({why}); the audit fails if it does not arrive in time"
            )
            return False
        self.say.info(f"round {round}: audited: sent the starting AdamW state")
        return True

    async def earlier(self, round: int, *, drawn: str | None) -> int:
        """Send the starts that audits of our earlier uploads wait for (not ``drawn``, the
        one the last receipt named); how many were sent."""
        try:
            waiting = [a for a in await self.api.my_audits(self.run_id) if a.get("id") != drawn]
        except ApiError as err:
            self.say.warn(f"round {round}: could not list our audits ({err.detail})")
            return 0
        if not waiting:
            return 0
        kept = await asyncio.to_thread(lambda: {file_sha256(p): p for p in self.kept if p.exists()})
        sent = 0
        for audit in waiting:
            start = kept.get(str(audit.get("start")))
            if start is None:
                self.say.warn(
                    f"round {audit.get('round')}: audit {audit.get('id')}: the AdamW state it "
                    "began from is no longer kept here; the audit fails when its time runs out"
                )
                continue
            sent += await self.reveal(int(audit["round"]), str(audit["id"]), start)
        return sent
