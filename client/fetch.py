"""A lease's inputs on local disk: the base checkpoint and the data shard, cached by sha256.

A cached file is reused after a checksum check (once per process: a file this process
downloaded or checked is not hashed again), so a restarted volunteer does not download what
it already has, and a file damaged on disk is fetched again instead of poisoning a round.
Downloads resume where an earlier attempt stopped (``client.download``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from client import credentials
from client.api import ServerAPI
from client.download import sha256_file
from client.lease import Lease
from client.optimizer_state import STATE_FILE
from client.progress import Reporter
from client.training import load_checkpoint_params, load_shard


class Fetcher:
    def __init__(self, api: ServerAPI, reporter: Reporter, cache_root: Path | None) -> None:
        self.api, self.say, self.root = api, reporter, cache_root
        self.verified: set[Path] = set()  # files whose sha256 this process has checked
        self.downloads = 0  # files fetched over the network by this process

    async def file(self, what: str, url: str, path: Path, sha256: str) -> Path:
        """``path`` holding the file with this sha256: the cached copy if it checks out,
        else a (resumed) download."""
        if path in self.verified and path.exists():
            return path
        if path.exists():
            if await asyncio.to_thread(sha256_file, path) == sha256:
                self.verified.add(path)
                self.say.info(f"{what}: cached copy verified (sha256 ok), not downloaded again")
                return path
            self.say.warn(f"{what}: the cached copy does not match its sha256; downloading again")
            path.unlink(missing_ok=True)
        fetched = await self.api.download(url, path, sha256)
        self.downloads += 1
        self.verified.add(path)
        resumed = (
            f", resumed after {fetched.resumed_from:,} B already on disk"
            if fetched.resumed_from
            else ""
        )
        self.say.info(f"{what}: downloaded {fetched.transferred:,} B{resumed} (sha256 ok)")
        return path

    async def inputs(
        self, lease: Lease, block_size: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """θ(t−1) (fp32, CPU) and the shard as ``(chunks, chunk_len)`` uint8 tokens."""
        ck, sh, root = lease.checkpoint, lease.shard, self.root
        ck_path = credentials.checkpoint_path(lease.run_id, ck.version, ck.sha256, root)
        await self.file(f"checkpoint v{ck.version}", ck.url, ck_path, ck.sha256)
        credentials.prune_checkpoints(lease.run_id, ck.version, root)
        sh_path = credentials.shard_path(lease.run_id, sh.index, sh.sha256, root)
        await self.file(f"shard {sh.index}", sh.url, sh_path, sh.sha256)
        params = await asyncio.to_thread(load_checkpoint_params, ck_path)
        shard = await asyncio.to_thread(load_shard, sh_path, lease, block_size)
        return params, shard

    def state_path(self, run_id: str) -> Path:
        """Where this run's inner AdamW state is kept between restarts."""
        return credentials.run_cache_dir(run_id, self.root) / STATE_FILE
