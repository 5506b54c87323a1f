"""A lease's inputs on local disk: the base checkpoint and the data shard, cached by sha256.

A cached file is reused after a checksum check (once per process: a file this process
downloaded or checked is not hashed again), so a restarted volunteer does not download what
it already has, and a file damaged on disk is fetched again instead of poisoning a round.
Downloads resume where an earlier attempt stopped (``client.download``). A volunteer that
holds an older version of the run's checkpoint catches up by int8 deltas when the server
says they are smaller (``client.catchup``), and downloads the full file otherwise.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch

from client import catchup, credentials
from client.api import ServerAPI
from client.lease import Lease, ProtocolError
from client.optimizer_state import STATE_FILE
from client.progress import Reporter
from diloco.atomic import file_sha256
from diloco.checkpoint import CheckpointError, checkpoint_params_only
from diloco.data.text import read_lease_tokens


def load_shard(path: Path, lease: Lease, block_size: int) -> torch.Tensor:
    """A text run's shard as uint8 tokens ``(nbytes / chunk_len, chunk_len)``; a dataset
    run's lease range (``lease.data_range``) as a 1-D int64 tensor, read from the shard file
    by offset (the rest of the shard is never loaded)."""
    ref = lease.shard
    dtype = np.dtype(ref.dtype).newbyteorder("<")
    if path.stat().st_size != ref.nbytes:
        raise ProtocolError(
            f"shard {path} holds {path.stat().st_size} bytes, the lease says {ref.nbytes}"
        )
    rng = lease.data_range
    if rng is not None:
        total = ref.nbytes // dtype.itemsize
        if rng.start < 0 or rng.tokens < block_size + 1 or rng.start + rng.tokens > total:
            raise ProtocolError(
                f"shard {ref.index}: the lease's range [{rng.start}, {rng.start + rng.tokens}) "
                f"is not inside its {total} tokens or holds no window; tell the run's operator"
            )
        return read_lease_tokens(
            path, dtype=ref.dtype, chunk_len=ref.chunk_len, start=rng.start, tokens=rng.tokens
        )
    if ref.chunk_len < block_size + 1 or ref.nbytes % ref.chunk_len or ref.dtype != "uint8":
        raise ProtocolError(
            f"shard {ref.index}: chunk_len {ref.chunk_len} must exceed block_size {block_size} "
            f"and divide nbytes {ref.nbytes} (uint8 tokens); tell the run's operator"
        )
    return read_lease_tokens(path, dtype=ref.dtype, chunk_len=ref.chunk_len)


def load_checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    """θ(t−1) in fp32 on the CPU; a cached file that no longer reads is deleted first."""
    try:
        params = checkpoint_params_only(path)
    except CheckpointError:
        path.unlink(missing_ok=True)  # the next join downloads it again
        raise
    return {n: t.float() for n, t in params.items()}


class Fetcher:
    def __init__(self, api: ServerAPI, reporter: Reporter, cache_root: Path | None) -> None:
        self.api, self.say, self.root = api, reporter, cache_root
        self.verified: set[Path] = set()  # files whose sha256 this process has checked
        self.downloads = 0  # files fetched over the network by this process
        self.full_bytes = 0  # bytes of whole files transferred by this process
        self.delta_bytes = 0  # bytes of checkpoint deltas fetched instead of whole checkpoints
        self.caught_up = 0  # checkpoints rebuilt from deltas

    async def file(self, what: str, url: str, path: Path, sha256: str) -> Path:
        """``path`` holding the file with this sha256: the cached copy if it checks out,
        else a (resumed) download."""
        if path in self.verified and path.exists():
            return path
        if path.exists():
            if await asyncio.to_thread(file_sha256, path) == sha256:
                self.verified.add(path)
                self.say.info(f"{what}: cached copy verified (sha256 ok), not downloaded again")
                return path
            self.say.warn(f"{what}: the cached copy does not match its sha256; downloading again")
            path.unlink(missing_ok=True)
        fetched = await self.api.download(url, path, sha256)
        self.downloads += 1
        self.full_bytes += fetched.transferred
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
        if not ck_path.exists():
            await self.catch_up(lease, ck_path)
        await self.file(f"checkpoint v{ck.version}", ck.url, ck_path, ck.sha256)
        credentials.prune_checkpoints(lease.run_id, ck.version, root)
        sh_path = credentials.shard_path(lease.run_id, sh.index, sh.sha256, root)
        await self.file(f"shard {sh.index}", sh.url, sh_path, sh.sha256)
        params = await asyncio.to_thread(load_checkpoint_params, ck_path)
        shard = await asyncio.to_thread(load_shard, sh_path, lease, block_size)
        return params, shard

    async def catch_up(self, lease: Lease, ck_path: Path) -> None:
        """The leased checkpoint from an older cached one and its deltas, if that is the
        smaller download and the result checks out (else the caller downloads it whole)."""
        done = await catchup.by_deltas(
            self.api,
            self.say,
            run_id=lease.run_id,
            checkpoint=lease.checkpoint,
            dest=ck_path,
            root=self.root,
        )
        if done is not None:
            self.verified.add(ck_path)  # its sha256 was checked as it was written
            self.delta_bytes += done.delta_nbytes
            self.caught_up += 1

    def state_path(self, run_id: str) -> Path:
        """Where this run's inner AdamW state is kept between restarts."""
        return credentials.run_cache_dir(run_id, self.root) / STATE_FILE
