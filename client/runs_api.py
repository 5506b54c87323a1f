"""The run owner's calls (``diloco run ...``): runs, datasets, checkpoints as files. The
volunteer's calls are ``client.api.ServerAPI``, which has these too."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from client.http import error_from, json_object
from client.lease import ProtocolError, require
from client.session import ApiSession


class RunsAPI(ApiSession):
    # ------------------------------------------------ runs (the admin or a run owner for writes)

    async def create_run(
        self, config: Mapping[str, Any], data_path: Path | None, init_path: Path | None = None
    ) -> dict[str, Any]:
        """POST /runs as multipart: ``config`` (JSON text), ``data`` (a text run's file,
        streamed; none for a dataset run) and ``init`` (starting weights, safetensors)."""
        url = self.url("/runs")

        async def once() -> dict[str, Any]:
            with contextlib.ExitStack() as files:
                form = aiohttp.FormData()
                form.add_field("config", json.dumps(config), content_type="application/json")
                parts = [("data", data_path, "text/plain")]
                parts.append(("init", init_path, "application/octet-stream"))
                for field, path, kind in parts:
                    if path is not None:
                        f = files.enter_context(open(path, "rb"))
                        form.add_field(field, f, filename=Path(path).name, content_type=kind)
                async with self._http().post(
                    url, data=form, headers=self._headers(), timeout=self._transfer_timeout
                ) as resp:
                    if resp.status >= 400:
                        raise await error_from(resp)
                    return await json_object(resp)

        return await self._with_retries("create run", once, idempotent=False)

    # ---------------------------------------------------------------- datasets (admin)

    async def register_dataset(self, manifest: bytes) -> dict[str, Any]:
        """POST /datasets with the manifest: the dataset's id and its files' states."""
        url = self.url("/datasets")

        async def once() -> dict[str, Any]:
            headers = self._headers({"Content-Type": "application/json"})
            async with self._http().post(
                url, data=manifest, headers=headers, timeout=self._transfer_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                return await json_object(resp)

        return await self._with_retries("dataset registration", once)

    async def dataset(self, dataset_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/datasets/{dataset_id}")

    async def upload_dataset_file(
        self, dataset_id: str, name: str, path: Path, on_bytes: Callable[[int], None]
    ) -> bool:
        """PUT one file of a dataset, streamed; False when the server had it already.
        A retry after a cut starts the file again (the server kept nothing of it)."""
        where = f"/datasets/{dataset_id}/files/{name}"
        status, _ = await self._put_file(where, path, f"upload of {name}", on_bytes)
        return status == 201

    async def list_runs(self, owner: str | None = None) -> list[dict[str, Any]]:
        """Every run, newest first; only ``owner``'s (a run owner's account id) when given."""
        path = "/runs" if owner is None else f"/runs?{urlencode({'owner': owner})}"
        return require(await self._json("GET", path), "runs", list, "the run list")

    async def get_run(self, run_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/runs/{run_id}")

    async def run_action(self, run_id: str, action: str) -> dict[str, Any]:
        """``pause``, ``resume`` or ``cancel``; returns the run."""
        if action not in ("pause", "resume", "cancel"):
            raise ValueError(f"run action must be pause, resume or cancel, not {action!r}")
        return await self._json("POST", f"/runs/{run_id}/{action}", idempotent=False)

    async def new_invite(self, run_id: str) -> str:
        """Make the run private with a new invite code (admin); the code."""
        data = await self._json("POST", f"/runs/{run_id}/invite", idempotent=False)
        return require(data, "invite", str, "the invite answer")

    async def ban_from_run(self, run_id: str, contributor_id: str, reason: str) -> dict[str, Any]:
        """Ban a contributor from one run (its owner or the admin); the ban."""
        body = {"contributor_id": contributor_id, "reason": reason}
        return await self._json("POST", f"/runs/{run_id}/bans", body=body)

    async def lift_run_ban(self, run_id: str, contributor_id: str) -> None:
        await self._json("DELETE", f"/runs/{run_id}/bans/{contributor_id}")

    async def run_bans(self, run_id: str) -> list[dict[str, Any]]:
        """Who is banned from the run, newest first (its owner or the admin)."""
        data = await self._json("GET", f"/runs/{run_id}/bans")
        return require(data, "bans", list, "the run's bans")

    async def become_member(self, run_id: str, invite: str) -> dict[str, Any]:
        """Join a private run's members with its invite code (a public run: nothing to do)."""
        return await self._json("POST", f"/runs/{run_id}/members", body={"invite": invite})

    async def checkpoint_etag(self, run_id: str, version: int | str) -> tuple[int, str]:
        """The version number and sha256 of a run's checkpoint (``latest`` or a number),
        from the headers of a one-byte read (the body is never fetched; on object storage
        the redirect carries them)."""
        url = self.url(f"/runs/{run_id}/checkpoints/{version}")

        async def once() -> tuple[int, str]:
            headers = self._headers({"Range": "bytes=0-0", "Accept": "*/*"})
            async with self._http().get(
                url, headers=headers, allow_redirects=False, timeout=self._call_timeout
            ) as resp:
                if resp.status >= 400:
                    raise await error_from(resp)
                etag = resp.headers.get("ETag", "").strip('"')
                number = resp.headers.get("X-Checkpoint-Version", "")
                if len(etag) != 64 or not number.isdigit():
                    raise ProtocolError(
                        f"the checkpoint answer for {version!r} lacks its sha256 ETag or "
                        "X-Checkpoint-Version header; is this a DiLoCo Hub server?"
                    )
                return int(number), etag

        return await self._with_retries("checkpoint lookup", once)

    async def list_rounds(self, run_id: str) -> list[dict[str, Any]]:
        """The run's rounds, oldest first."""
        data = await self._json("GET", f"/runs/{run_id}/rounds")
        return require(data, "rounds", list, "the round list")
