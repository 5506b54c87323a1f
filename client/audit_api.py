"""The calls of audits by replay (``server.audits``): the audited volunteer reveals its
starting state; a verifier (or the admin) reads the ledger, claims and decides audits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from client.http import error_from, json_object
from client.session import ApiSession


class AuditAPI(ApiSession):
    async def reveal_state(self, run_id: str, audit_id: str, path: Path) -> dict[str, Any]:
        """PUT the AdamW state file an audited lease began from; the audit."""
        where = f"/runs/{run_id}/audits/{audit_id}/state"
        _, audit = await self._put_file(where, path, f"reveal for audit {audit_id}")
        return audit

    async def my_audits(self, run_id: str) -> list[dict[str, Any]]:
        """Our audits in the run that wait for a starting state (id, round, start)."""
        data = await self._json("GET", f"/runs/{run_id}/audits/mine")
        found = data.get("audits")
        return found if isinstance(found, list) else []

    async def ledger(self, run_id: str, round: int, contributor_id: str) -> dict[str, Any]:
        """What re-running a contributor's lease of a round needs (verifier or admin)."""
        return await self._json("GET", f"/runs/{run_id}/rounds/{round}/ledger/{contributor_id}")

    async def audits(self, run_id: str, status: str | None = None) -> list[dict[str, Any]]:
        path = f"/runs/{run_id}/audits" + ("" if status is None else f"?status={status}")
        data = await self._json("GET", path)
        found = data.get("audits")
        return found if isinstance(found, list) else []

    async def claim_audit(self, run_id: str) -> dict[str, Any] | None:
        """Hold the run's oldest pending audit; None when none is pending (204)."""
        url = self.url(f"/runs/{run_id}/audits/claim")

        async def once() -> dict[str, Any] | None:
            async with self._http().post(
                url, headers=self._headers(), timeout=self._call_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                return None if resp.status == 204 else await json_object(resp)

        return await self._with_retries("audit claim", once, idempotent=False)

    async def decide_audit(
        self, run_id: str, audit_id: str, result: dict[str, Any]
    ) -> dict[str, Any]:
        """Report a replay's figures (or a failure sentence); the decided audit."""
        return await self._json(
            "POST", f"/runs/{run_id}/audits/{audit_id}", body=result, idempotent=False
        )
