"""Atomic file writes, the one way this project replaces a file: commit or discard.

The bytes go to a temp file beside the target, named ``.<name>.tmp-<12 hex>`` (one scheme
everywhere, so that ``is_temp_name`` can tell a leftover of an interrupted write from a real
file), the temp file is fsynced, renamed over the target, and the directory is fsynced so
that the rename itself survives a crash. Any error on the way removes the temp file; a
crash leaves the old file or the new one, never a mix, plus at worst a temp file that the
server's janitor collects.

- ``atomic_write(path)`` / ``atomic_write_text(path)``: a file object to write to
  (``permissions=0o600`` for secrets: set on the temp file before any byte is written,
  whatever the umask).
- ``atomic_path(path)``: a temp *path*, for libraries that write by name
  (``safetensors.torch.save_file``).
- ``commit(tmp, path)``: publish a file written elsewhere, incrementally (a resumable
  download's ``.part``, a blob streamed from the network).
- ``fsync_dir(path)``: make renames and creations inside ``path`` durable.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO

TEMP_MARK = ".tmp-"
# this scheme (``.3.safetensors.tmp-0a1b2c3d4e5f``) and the older checkpoint one
# (``3.tmp-<16 hex>``): both end in ``.tmp-`` and hex
_TEMP_NAME = re.compile(r"\.tmp-[0-9a-f]{8,32}$")


def temp_path(target: Path) -> Path:
    """A fresh temp name beside ``target``: ``.<name>.tmp-<12 hex>``."""
    return target.with_name(f".{target.name}{TEMP_MARK}{secrets.token_hex(6)}")


def is_temp_name(name: str) -> bool:
    """Whether a file name is a temp file of an atomic write (this scheme or the older one)."""
    return _TEMP_NAME.search(name) is not None


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the renames and new entries in it survive a crash."""
    if os.name == "nt":  # Windows cannot open a directory; NTFS journals renames itself
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, target: Path) -> None:
    """Publish ``tmp`` (written and closed by the caller) as ``target``: fsync the file,
    rename it over ``target``, fsync the directory. On an error ``tmp`` is removed."""
    try:
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


@contextmanager
def atomic_path(target: Path, *, permissions: int | None = None) -> Iterator[Path]:
    """Yield a temp path for the caller to write ``target``'s new content to, by name; when
    the block ends without an error it is committed (``permissions`` applied first)."""
    target = Path(target)
    tmp = temp_path(target)
    try:
        yield tmp
        if permissions is not None:
            os.chmod(tmp, permissions)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    commit(tmp, target)


@contextmanager
def atomic_write(target: Path, *, permissions: int | None = None) -> Iterator[BinaryIO]:
    """A binary file whose content replaces ``target`` when the ``with`` block ends without
    an error. ``permissions`` (e.g. 0o600) are set before anything is written; without them
    the file gets ``0o666 & ~umask``, as ``open`` would give it."""
    with atomic_path(target) as tmp, os.fdopen(_create(tmp, permissions), "wb") as f:
        yield f


@contextmanager
def atomic_write_text(
    target: Path, *, permissions: int | None = None, encoding: str = "utf-8"
) -> Iterator[TextIO]:
    """``atomic_write`` for text."""
    with (
        atomic_path(target) as tmp,
        os.fdopen(_create(tmp, permissions), "w", encoding=encoding) as f,
    ):
        yield f


def _create(tmp: Path, permissions: int | None) -> int:
    initial = 0o666 if permissions is None else 0o600  # never wider than asked, even briefly
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, initial)
    if permissions is not None:
        try:
            os.chmod(tmp, permissions)  # exactly these, whatever the umask
        except BaseException:
            os.close(fd)
            raise
    return fd


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """The SHA-256 (hex) of a file's bytes, read in pieces so memory stays flat: how a
    file written here is checked against a digest it was given or committed to."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
