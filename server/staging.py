"""Local files for work that reads or writes blobs as files: the close's one pass
(``preadv``/``pwrite`` on the base version, the uploads and the new version), an eval,
version 0.

On disk a ``Stage`` hands out the blobs' own files: nothing is copied, and outputs are
written in place (their writers rename temp files into place). On object storage inputs
are fetched into a scratch folder (in parallel: multipart GETs on boto3's threads), and
outputs are written there and put into the bucket by ``publish``; ``close`` removes the
folder, whatever happened. The scratch folder is ``DILOCO_SCRATCH_DIR`` (default: the
system's temp dir), never the data dir: a replica keeps no blob.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from server.storage import BlobMissing, Storage

log = logging.getLogger("diloco.server.staging")

FETCH_THREADS = 4  # blobs fetched at once (each a multipart download of its own)
PREFIX = "diloco-stage-"


class Stage:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._scratch_root = storage.scratch_dir
        self._dir: Path | None = None
        self._outputs: dict[str, Path] = {}

    def _scratch(self, key: str) -> Path:
        if self._dir is None:
            root = self._scratch_root
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
        path = self._dir.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def input(self, key: str) -> Path:
        """The blob as a local file (BlobMissing when there is none)."""
        return self.inputs([key])[key]

    def inputs(self, keys: Iterable[str], *, missing_ok: bool = False) -> dict[str, Path]:
        """Each blob as a local file, fetched in parallel. With ``missing_ok`` a blob that
        cannot be fetched is logged and its path left absent (its reader then says so)."""
        keys = list(dict.fromkeys(keys))
        paths: dict[str, Path] = {}
        fetch: list[str] = []
        for key in keys:
            local = self.storage.local_file(key)
            if local is not None:
                if not missing_ok and not local.is_file():
                    raise BlobMissing(key)
                paths[key] = local
            else:
                paths[key] = self._scratch(key)
                fetch.append(key)
        if not fetch:
            return paths

        def one(key: str) -> None:
            try:
                self.storage.fetch(key, paths[key])
            except (BlobMissing, OSError) as err:
                paths[key].unlink(missing_ok=True)
                if not missing_ok:
                    raise
                log.warning("staging: %s cannot be fetched from %s: %s", key, self.storage.url, err)

        with ThreadPoolExecutor(min(FETCH_THREADS, len(fetch)), "stage-fetch") as pool:
            for done in [pool.submit(one, key) for key in fetch]:
                done.result()
        return paths

    def output(self, key: str) -> Path:
        """Where to write the file that becomes blob ``key`` (``publish`` puts it there)."""
        local = self.storage.local_file(key)
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            return local
        path = self._outputs[key] = self._scratch(key)
        return path

    def publish(self, keys: Iterable[str] | None = None) -> None:
        """Put finished outputs (all of them, or ``keys``) into the store; durable on return."""
        chosen = list(self._outputs) if keys is None else list(keys)
        todo = [k for k in chosen if k in self._outputs]
        if not todo:
            return
        with ThreadPoolExecutor(min(FETCH_THREADS, len(todo)), "stage-put") as pool:
            for done in [pool.submit(self.storage.put_file, k, self._outputs[k]) for k in todo]:
                done.result()

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Stage:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def sweep_stale(scratch_dir: Path | None, *, max_age_s: float, now: float) -> list[Path]:
    """Remove the stage folders a killed process left in the scratch dir: those whose
    newest file is older than ``max_age_s`` (a live stage writes, or is younger). Returns
    what was removed."""
    root = Path(scratch_dir) if scratch_dir is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    for folder in root.glob(f"{PREFIX}*"):
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            newest = max([p.lstat().st_mtime for p in folder.rglob("*")], default=0.0)
            newest = max(newest, folder.lstat().st_mtime)
        except FileNotFoundError:  # another process is removing it
            continue
        if now - newest > max_age_s:
            shutil.rmtree(folder, ignore_errors=True)
            log.info("staging: removed %s, left by an interrupted close", folder)
            removed.append(folder)
    return removed
