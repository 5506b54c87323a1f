"""safetensors files written piece by piece and read range by range, never whole in memory.

A checkpoint of a billion parameters is 4 GB: serialising it into one ``bytes`` first (what
``safetensors.torch.save`` does) doubles the memory of whoever writes it. ``TensorFileWriter``
lays the file out up front (the header says where every tensor's bytes go), then takes
each tensor in as many pieces as the caller likes, at any offset (``os.pwrite``), and
commits the file the ``diloco.atomic`` way (temp name, fsync, rename, fsync the folder).
The sha256 of the file is computed on the way when the pieces arrive in file order, and by
reading the file back otherwise. A writer that does not ``store`` only takes that sha256 of
the file its pieces make, writing nothing (the close's critical pass: the new parameters'
digest, published before the file itself is written).

``TensorFileReader`` reads one tensor's elements ``[start, stop)`` into a caller's buffer
(``os.preadv``): a pass over a model holds one chunk, not the model.

Layout: float32 tensors first, then int8, then uint8, in the order given within each dtype,
so every tensor's bytes are aligned to its item size (``safetensors.torch.load`` and
``safe_open`` read the files as usual).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from diloco import atomic

DTYPE_NAMES = {torch.float32: "F32", torch.int8: "I8", torch.uint8: "U8"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
_ORDER = (torch.float32, torch.int8, torch.uint8)  # larger items first: every offset stays aligned
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class TensorFileError(ValueError):
    """A file that is not the safetensors file it should be (truncated, foreign, damaged)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def byte_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (little-endian hosts only)."""
    arr: Any = t.detach().contiguous().numpy()
    return memoryview(arr).cast("B")


def layout(entries: Sequence[Entry], metadata: Mapping[str, str]) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) and each tensor's absolute file offset."""
    ordered = sorted(entries, key=lambda e: _ORDER.index(e.dtype))  # stable within a dtype
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offsets: dict[str, int] = {}
    at = 0
    for e in ordered:
        header[e.name] = {
            "dtype": DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        offsets[e.name] = at
        at += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad to 8 bytes, as safetensors does
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {n: start + o for n, o in offsets.items()}


class TensorFileWriter:
    """Write a safetensors file in pieces: ``write(name, start, values)`` puts ``values``
    (a flat chunk of tensor ``name``'s elements, from element ``start``) in place; with
    ``store`` False, only the sha256 of that file is taken (module docstring)."""

    def __init__(
        self,
        path: Path,
        entries: Sequence[Entry],
        metadata: Mapping[str, str],
        *,
        digest: bool = True,
        hasher: Executor | None = None,
        store: bool = True,
    ) -> None:
        if len({e.name for e in entries}) != len(entries):
            raise ValueError("tensor names must be unique")
        if not (store or digest):
            raise ValueError("a writer that stores nothing must take the digest")
        self.path = Path(path)
        self.entries = {e.name: e for e in entries}
        head, self._offsets = layout(entries, metadata)
        self.nbytes = len(head) + sum(e.nbytes for e in entries)
        self._tmp = atomic.temp_path(self.path)
        self._store = store
        self._open = True  # until committed or aborted
        self._fd: int | None = None
        if store:
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.pwrite(self._fd, head, 0)
            os.ftruncate(self._fd, self.nbytes)
        self._digest = digest  # False: nobody needs the file's sha256 (commit returns "")
        self._hasher = hasher  # hash on this thread (one worker: in order); None: inline
        self._sha = hashlib.sha256(head)
        self._hashed = len(head)  # bytes hashed so far: the sha follows while writes are in order

    def write(self, name: str, start: int, values: torch.Tensor) -> None:
        if not self._open:
            raise RuntimeError(f"{self.path.name} is already committed or aborted")
        entry = self.entries[name]
        if values.dtype != entry.dtype or not 0 <= start <= start + values.numel() <= entry.numel:
            raise ValueError(
                f"{name}: {values.numel()} {values.dtype} values at {start} do not fit "
                f"{entry.numel} {entry.dtype}"
            )
        data = byte_view(values)
        at = self._offsets[name] + start * entry.dtype.itemsize
        if self._fd is not None and os.pwrite(self._fd, data, at) != len(data):
            raise OSError(f"short write to {self._tmp}")
        if self._digest and at == self._hashed:
            if self._hasher is None:
                self._sha.update(data)
            else:  # a copy: the caller reuses its buffer
                self._hasher.submit(self._sha.update, bytes(data))
            self._hashed += len(data)
        elif not self._store:  # nothing to read back: its digest is lost
            raise ValueError(f"{self.path.name}: a digest-only writer takes its pieces in order")

    def settle(self) -> None:
        """Wait for the hashing queued so far; hash any later writes inline (the caller's
        hashing thread may go away)."""
        if self._hasher is not None:
            self._hasher.submit(lambda: None).result()
            self._hasher = None

    def sha256(self) -> str:
        """The file's sha256, once every write is done, without committing it ("" without
        a digest)."""
        if not self._open:
            raise RuntimeError(f"{self.path.name} is already committed or aborted")
        self.settle()
        if self._digest and self._hashed != self.nbytes:  # written out of order: reread
            if self._fd is None:
                raise ValueError(f"{self.path.name}: a digest-only writer was not written whole")
            self._sha = hashlib.sha256()
            for at in range(0, self.nbytes, 1 << 22):
                self._sha.update(os.pread(self._fd, min(1 << 22, self.nbytes - at), at))
            self._hashed = self.nbytes
        return self._sha.hexdigest() if self._digest else ""

    def commit(self) -> str:
        """fsync, rename into place; the file's sha256 (a digest-only writer: the sha256
        alone, nothing committed)."""
        sha = self.sha256()
        self._open = False
        if self._fd is None:
            return sha
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        atomic.commit(self._tmp, self.path)
        return sha

    @property
    def temp_path(self) -> Path:
        """Where the bytes are until ``commit`` (readable meanwhile: the guard's eval)."""
        if not self._store:
            raise RuntimeError(f"{self.path.name}: a digest-only writer has no file")
        return self._tmp

    def abort(self) -> None:
        self._open = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._open:  # not committed: an error or an early return
            self.abort()


class TensorFileReader:
    """Read a safetensors file's tensors range by range (one open file, ``preadv``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise TensorFileError(f"cannot read {self.path}: {err.strerror}") from err
        try:
            self.entries, self.metadata, self._offsets = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> tuple[dict[str, Entry], dict[str, str], dict[str, int]]:
        size = os.fstat(self._fd).st_size
        prefix = os.pread(self._fd, 8, 0)
        if len(prefix) < 8:
            raise TensorFileError(f"{self.path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise TensorFileError(f"{self.path} is truncated or corrupt (header runs past the end)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TensorFileError(f"{self.path} has a corrupt header: {err}") from err
        if not isinstance(header, dict):
            raise TensorFileError(f"{self.path} has a header that is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        entries: dict[str, Entry] = {}
        offsets: dict[str, int] = {}
        spans = []
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise TensorFileError(f"{self.path}: tensor {name!r} is malformed: {err}") from err
            entry = Entry(name, dtype, shape)
            if end - begin != entry.nbytes or begin < 0:
                raise TensorFileError(f"{self.path}: tensor {name!r} has inconsistent offsets")
            entries[name], offsets[name] = entry, 8 + n + begin
            spans.append((begin, end))
        spans.sort()
        starts = [b for b, _ in spans]
        if (
            starts != [0, *(e for _, e in spans[:-1])][: len(starts)]
            or 8 + n + (spans[-1][1] if spans else 0) != size
        ):
            raise TensorFileError(f"{self.path} is truncated or its tensors overlap")
        return entries, {str(k): str(v) for k, v in meta.items()}, offsets

    def read_into(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of ``name`` into ``out`` (contiguous)."""
        entry = self.entries[name]
        if out.dtype != entry.dtype or not 0 <= start <= start + out.numel() <= entry.numel:
            raise ValueError(f"{name}: cannot read {out.numel()} {out.dtype} values at {start}")
        view = byte_view(out)
        at = self._offsets[name] + start * entry.dtype.itemsize
        if os.preadv(self._fd, [view], at) != len(view):
            raise TensorFileError(f"{self.path} ended early in tensor {name!r}")
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """One whole tensor, in its shape."""
        entry = self.entries[name]
        out = torch.empty(entry.numel, dtype=entry.dtype)
        return self.read_into(name, 0, out).view(entry.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
