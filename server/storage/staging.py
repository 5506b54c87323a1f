"""Local files for work that reads or writes blobs as files: the close's one pass
(``preadv``/``pwrite`` on the base version, the uploads and the new version), an eval,
version 0.

On disk a ``Stage`` hands out the blobs' own files: nothing is copied, and outputs are
written in place (their writers rename temp files into place). On object storage inputs
are fetched into a scratch folder (in parallel: multipart GETs on boto3's threads), and
outputs are written there and put into the bucket by ``publish``; ``close`` removes the
folder, whatever happened. The scratch folder is ``DILOCO_SCRATCH_DIR`` (default: the
system's temp dir), never the data dir.

A worker keeps the checkpoint files it published or fetched (params and outer state), the
uploads and the data it fetched in a ``FileCache`` beside the stages, up to
``DILOCO_SCRATCH_CACHE_BYTES``: the version a close publishes is the base of the next close
and the file of its eval, an accepted upload is read by its fold, its score on arrival and
its round's close, and a shard or the validation tokens by every score and eval, usually on
the same worker, so those need not come back from the bucket each time. Uploads leave the
cache first (a round's uploads can be many times the model, and the next close needs its
base). An entry is used only while the object's ETag (one HEAD) is the one it was kept
under: another worker's version of the same key (after a crash, a re-close) is fetched,
never mistaken for it. It is a cache: a replica that loses it loses only the time to
fetch again.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from server.storage import keys
from server.storage.base import BlobMissing, Storage

log = logging.getLogger("diloco.server.staging")

FETCH_THREADS = 4  # blobs fetched at once (each a multipart download of its own)
PREFIX = "diloco-stage-"
CACHE_FOLDER = "diloco-cache"


def cacheable(key: str) -> bool:
    """A version's parameters and outer state (what the next close and the eval read), an
    accepted upload (what its fold, its score and its close read), and training or
    validation data (what every score and eval reads)."""
    return (
        keys.is_contribution(key)
        or keys.is_data(key)
        or ("/checkpoints/" in key and not key.endswith(".delta.safetensors"))
    )


class FileCache:
    """Blobs kept as files under ``root``, by key and ETag, out once they pass ``max_bytes``:
    uploads first, then the rest (checkpoints, data), each least recently used first. Safe
    to share between processes: entries are written to a temp name and renamed, handed out
    as hard links."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes

    def _path(self, key: str, etag: str) -> Path:
        tag = re.sub(r"[^0-9A-Za-z-]", "", etag)
        return self.root / (key.replace("/", "__") + "." + tag)

    @staticmethod
    def _key_of(entry: Path) -> str:
        """The key an entry's file was named after (``_path`` read back, its ETag dropped)."""
        return entry.name.rpartition(".")[0].replace("__", "/")

    def get(self, key: str, etag: str, dest: Path) -> bool:
        """Link the entry for ``key`` at ``etag`` to ``dest``; False when there is none."""
        entry = self._path(key, etag)
        try:
            os.link(entry, dest)
            os.utime(entry)  # recently used
        except FileNotFoundError:
            return False
        return True

    def put(self, key: str, etag: str, src: Path) -> None:
        """Keep ``src`` (a finished file) as ``key`` at ``etag``; then evict."""
        if not etag or self.max_bytes <= 0:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        entry = self._path(key, etag)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
        try:
            os.link(src, tmp)
        except OSError:  # another file system: a copy
            shutil.copyfile(src, tmp)
        os.replace(tmp, entry)
        self._evict()

    def _evict(self) -> None:
        entries = []
        for path in self.root.iterdir():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            upload = keys.is_contribution(self._key_of(path))
            entries.append((not upload, st.st_mtime, st.st_size, path))
        total = sum(size for _, _, size, _ in entries)
        for _, _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


class Stage:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._scratch_root = storage.scratch_dir
        self._dir: Path | None = None
        self._outputs: dict[str, Path] = {}
        root = Path(storage.scratch_dir or tempfile.gettempdir())
        self.cache = FileCache(root / CACHE_FOLDER, storage.scratch_cache_bytes)
        self.hits: list[str] = []  # keys the cache gave, not the store
        self._fetched: dict[str, Path] = {}  # key -> its file here (absent: could not be)

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
        cannot be fetched is logged and its path left absent (its reader then says so). A
        blob this stage fetched already is not fetched again."""
        keys = list(dict.fromkeys(keys))
        paths: dict[str, Path] = {}
        fetch: list[str] = []
        for key in keys:
            if key in self._fetched:
                paths[key] = self._fetched[key]
                if not missing_ok and not paths[key].is_file():
                    raise BlobMissing(key)
                continue
            local = self.storage.local_file(key)
            if local is not None:
                if not missing_ok and not local.is_file():
                    raise BlobMissing(key)
                paths[key] = local
            else:
                paths[key] = self._fetched[key] = self._scratch(key)
                fetch.append(key)
        if not fetch:
            return paths

        def one(key: str) -> None:
            try:
                etag = ""
                if cacheable(key) and self.cache.max_bytes > 0:
                    etag = self.storage.head(key).etag
                    if self.cache.get(key, etag, paths[key]):
                        self.hits.append(key)
                        return
                self.storage.fetch(key, paths[key])
                if etag:
                    self.cache.put(key, etag, paths[key])
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

        def one(key: str) -> None:
            self.storage.put_file(key, self._outputs[key])
            if cacheable(key) and self.cache.max_bytes > 0:  # the next close's base, the eval's
                self.cache.put(key, self.storage.head(key).etag, self._outputs[key])

        with ThreadPoolExecutor(min(FETCH_THREADS, len(todo)), "stage-put") as pool:
            for done in [pool.submit(one, k) for k in todo]:
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
