"""Blob storage behind a small interface: local disk today, S3-compatible storage later.

Keys are ``/``-separated relative paths (``runs/<id>/rounds/3/<contributor>.bin``). A blob
is written through a ``BlobWriter``: bytes go to a temp name, and ``commit`` fsyncs the file,
renames it into place and fsyncs the directory, so a 2xx that follows a commit means the
bytes survive a crash (invariant 1). ``abort`` (or leaving the ``with`` block on an error)
removes the temp file: a rejected upload leaves nothing behind.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol


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
    def writer(self, key: str) -> BlobWriter: ...
    def open(self, key: str) -> BinaryIO: ...
    def read_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]: ...
    def size(self, key: str) -> int: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def path(self, key: str) -> Path: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriter:
    def __init__(self, final: Path) -> None:
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = final.with_name(f".{final.name}.tmp-{secrets.token_hex(6)}")
        self._file: BinaryIO | None = open(self.tmp, "xb")  # noqa: SIM115 - closed in commit/abort
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._file is None:
            raise RuntimeError(f"blob {self.final.name} is already committed or aborted")
        self._file.write(data)
        self.nbytes += len(data)

    def commit(self) -> None:
        if self._file is None:
            raise RuntimeError(f"blob {self.final.name} is already committed or aborted")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)

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

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"blob key {key!r} must be a relative path without . or ..")
        return self.root.joinpath(*parts)

    def writer(self, key: str) -> _LocalWriter:
        return _LocalWriter(self.path(key))

    def open(self, key: str) -> BinaryIO:
        return open(self.path(key), "rb")

    def read_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        with self.open(key) as f:
            while block := f.read(chunk_size):
                yield block

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
