"""Blob storage behind a small interface: local disk (``LocalStorage``, the default) or an
S3-compatible bucket (``server.storage.s3.S3Storage``), chosen by URL (``open_storage``).

Keys are ``/``-separated relative paths (``runs/<id>/rounds/3/<contributor>.bin``); the
interface speaks keys, streams, whole-file transfers (``fetch``/``put_file``) and signed
URLs, never file system paths: ``local_file`` answers one only where the backend keeps
blobs as files (sendfile serves them), and None elsewhere. Work that needs files (the
close's pass, an eval) goes through ``server.storage.staging``.

A blob is written through a ``BlobWriter``: on disk, bytes go to a temp name (the
``diloco.atomic`` scheme) and ``commit`` fsyncs the file, renames it into place and fsyncs
the directory; in a bucket, ``commit`` returns when the object is whole and durable. Either
way a 2xx that follows a commit means the bytes survive a crash (invariant 1). ``abort``
(or leaving the ``with`` block on an error) removes what was written: a rejected upload
leaves nothing behind. A crash leaves an unfinished write (a temp file, an incomplete
multipart upload), which ``list_unfinished`` finds and the janitor (``server.upkeep.janitor``)
deletes once it is old.

The layout of the keys (which object lives where) is ``server.storage.keys``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import sys
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal, Protocol
from urllib.parse import urlsplit

from diloco import atomic

log = logging.getLogger("diloco.server.storage")


@dataclass(frozen=True)
class BlobInfo:
    key: str
    nbytes: int
    modified: float  # seconds since the epoch: the file's mtime (S3: LastModified)
    etag: str = ""  # S3's ETag (quoted, as the store gives it); "" on disk


class BlobMissing(FileNotFoundError):
    """No blob under this key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no blob {key!r}")
        self.key = key


def check_key(key: str) -> str:
    """A key is a relative ``/`` path without empty, ``.`` or ``..`` parts."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"blob key {key!r} must be a relative path without . or ..")
    return key


class BlobWriter(Protocol):
    nbytes: int

    def write(self, data: bytes | bytearray | memoryview) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...
    def __enter__(self) -> BlobWriter: ...
    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Storage(Protocol):
    url: str  # file:///dir or s3://bucket/prefix/
    direct: bool  # volunteers move bytes straight to and from it (signed URLs)
    scratch_dir: Path | None  # where server.storage.staging puts fetched files (None: system temp)
    scratch_cache_bytes: int  # published versions server.storage.staging keeps there (0: none)

    def writer(self, key: str) -> BlobWriter: ...
    def read_chunks(
        self, key: str, chunk_size: int = 1 << 20, *, if_match: str | None = None
    ) -> Generator[bytes, None, None]:
        """The blob's bytes in order; with ``if_match``, only while its ETag is that one."""
        ...

    def read_bytes(self, key: str) -> bytes: ...
    def head(self, key: str) -> BlobInfo: ...
    def size(self, key: str) -> int: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...

    def local_file(self, key: str) -> Path | None:
        """The blob's file on this machine where the backend keeps files, else None."""
        ...

    def fetch(self, key: str, dest: Path) -> None:
        """Copy the blob into the local file ``dest`` (BlobMissing if there is none)."""
        ...

    def put_file(self, key: str, src: Path) -> None:
        """A finished local file becomes the blob, durable when this returns."""
        ...

    def copy(self, src: str, dst: str, *, if_match: str | None = None) -> None:
        """Copy inside the store; with ``if_match``, only if ``src``'s ETag is still that."""
        ...

    def signed_url(self, key: str, method: Literal["GET", "PUT"], expires_s: int) -> str:
        """A URL for one method on one object until it expires (object storage only)."""
        ...

    def list_blobs(self, prefix: str) -> Iterator[BlobInfo]:
        """Committed blobs whose keys start with ``prefix`` ("" or ending in "/")."""
        ...

    def list_unfinished(self, prefix: str) -> Iterator[BlobInfo]:
        """Writes under ``prefix`` never committed nor aborted (a crash, a kill): temp
        files here, incomplete multipart uploads on S3. ``delete`` removes one by its key."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Remove everything under ``prefix`` (ending in "/"); returns how many blobs."""
        ...


WRITEBACK_BYTES = 8 << 20  # a blob being written goes to disk in pieces of this size


def _libc_sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


class _LocalWriter:
    def __init__(self, final: Path) -> None:
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = atomic.temp_path(final)
        self._file: BinaryIO | None = open(self.tmp, "xb")  # noqa: SIM115 - closed in commit/abort
        self.nbytes = 0
        self._written_back = 0  # bytes whose writeback to disk has been started

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._file is None:
            raise RuntimeError(f"blob {self.final.name} is already committed or aborted")
        self._file.write(data)
        self.nbytes += len(data)
        if _SYNC_FILE_RANGE is not None and self.nbytes - self._written_back >= WRITEBACK_BYTES:
            # the disk writes while the rest arrives, so that commit's fsync finds little left
            # (an fsync of 48 MB took 85 ms here; Linux only, a hint: errors are ignored)
            self._file.flush()
            _SYNC_FILE_RANGE(
                self._file.fileno(),
                self._written_back,
                self.nbytes - self._written_back,
                _SYNC_FILE_RANGE_WRITE,
            )
            self._written_back = self.nbytes

    def commit(self) -> None:
        if self._file is None:
            raise RuntimeError(f"blob {self.final.name} is already committed or aborted")
        self._file.close()
        self._file = None
        atomic.commit(self.tmp, self.final)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> _LocalWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._file is not None:  # not committed: an error or an early return
            self.abort()


class LocalStorage:
    """Blobs as files under ``root``."""

    direct = False  # the server proxies every transfer
    scratch_dir: Path | None = None  # its blobs are files: nothing is ever staged
    scratch_cache_bytes = 0

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.resolve().as_uri()

    def path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def local_file(self, key: str) -> Path:
        return self.path(key)

    def writer(self, key: str) -> _LocalWriter:
        return _LocalWriter(self.path(key))

    def _open(self, key: str) -> BinaryIO:
        try:
            return open(self.path(key), "rb")
        except FileNotFoundError:
            raise BlobMissing(key) from None

    def read_chunks(
        self, key: str, chunk_size: int = 1 << 20, *, if_match: str | None = None
    ) -> Generator[bytes, None, None]:
        if if_match:
            raise ValueError("files on disk have no ETag to match")
        with self._open(key) as f:
            while block := f.read(chunk_size):
                yield block

    def read_bytes(self, key: str) -> bytes:
        with self._open(key) as f:
            return f.read()

    def head(self, key: str) -> BlobInfo:
        try:
            st = self.path(key).stat()
        except FileNotFoundError:
            raise BlobMissing(key) from None
        return BlobInfo(key, st.st_size, st.st_mtime)

    def size(self, key: str) -> int:
        return self.head(key).nbytes

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def fetch(self, key: str, dest: Path) -> None:
        with self._open(key) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)

    def put_file(self, key: str, src: Path) -> None:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = atomic.temp_path(final)
        shutil.copyfile(src, tmp)
        atomic.commit(tmp, final)

    def copy(self, src: str, dst: str, *, if_match: str | None = None) -> None:
        if if_match:
            raise ValueError("files on disk have no ETag to match")
        self.put_file(dst, self.path(src))

    def signed_url(self, key: str, method: Literal["GET", "PUT"], expires_s: int) -> str:
        raise NotImplementedError(
            "a local-disk store signs no URLs: the server proxies its transfers"
        )

    def list_blobs(self, prefix: str) -> Iterator[BlobInfo]:
        return (b for b, unfinished in self._walk(prefix) if not unfinished)

    def list_unfinished(self, prefix: str) -> Iterator[BlobInfo]:
        return (b for b, unfinished in self._walk(prefix) if unfinished)

    def delete_prefix(self, prefix: str) -> int:
        if not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must name a folder: end it with /")
        top = self.path(prefix.removesuffix("/"))
        count = 0
        # bottom up, tolerating files that another process removes meanwhile; links are
        # removed, never followed
        for folder, dirs, files in os.walk(top, topdown=False):
            for name in files:
                Path(folder, name).unlink(missing_ok=True)
                count += 1
            for name in dirs:
                _remove_dir(Path(folder, name))
        _remove_dir(top)
        return count

    def _walk(self, prefix: str) -> Iterator[tuple[BlobInfo, bool]]:
        """Every regular file under ``prefix`` and whether it is an unfinished write; files
        that vanish meanwhile (another process deleted them) are skipped."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must name a folder: end it with /")
        top = self.path(prefix.removesuffix("/")) if prefix else self.root
        for folder, _, names in os.walk(top):
            rel = Path(folder).relative_to(self.root).as_posix()
            for name in names:
                if not _keyable(folder, name):
                    continue
                try:
                    st = os.stat(os.path.join(folder, name), follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                yield BlobInfo(key, st.st_size, st.st_mtime), atomic.is_temp_name(name)


def _keyable(folder: str, name: str) -> bool:
    """Keys are UTF-8 (as S3's are): a name that is not (undecodable bytes) is no blob of
    ours, and is left alone with a warning rather than passed on to fail elsewhere."""
    try:
        (folder + "/" + name).encode("utf-8")
    except UnicodeEncodeError:
        log.warning("storage: ignoring %r: its name is not UTF-8", os.path.join(folder, name))
        return False
    return True


def _remove_dir(path: Path) -> None:
    try:
        if path.is_symlink():
            path.unlink()
        else:
            path.rmdir()
    except FileNotFoundError:
        return


def open_storage(
    url: str,
    default_root: Path,
    *,
    scratch_dir: Path | None = None,
    scratch_cache_bytes: int = 0,
    public_endpoint: str = "",
) -> Storage:
    """The store a URL names: ``file:///dir``, ``s3://bucket/prefix`` (credentials and
    endpoint from the ``AWS_*`` variables; signed URLs for ``public_endpoint`` when the
    volunteers reach the store by another address), or "" for ``default_root`` on disk."""
    if not url:
        return LocalStorage(default_root)
    scheme, where, prefix = parse_storage_url(url)
    if scheme == "file":
        return LocalStorage(Path(where))
    from server.storage.s3 import S3Storage

    s3 = S3Storage(
        where,
        prefix,
        scratch_dir=scratch_dir,
        scratch_cache_bytes=scratch_cache_bytes,
        public_endpoint=public_endpoint,
    )
    s3.check()
    return s3


def parse_storage_url(url: str) -> tuple[Literal["file", "s3"], str, str]:
    """``("file", dir, "")`` or ``("s3", bucket, prefix)``; ValueError saying how to write
    it otherwise."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"storage {url!r}: write file:///absolute/dir")
        return "file", parts.path, ""
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"storage {url!r}: write s3://bucket or s3://bucket/prefix")
        return "s3", parts.netloc, parts.path.strip("/")
    raise ValueError(f"storage {url!r}: use file:///dir or s3://bucket/prefix")
