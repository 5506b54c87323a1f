"""This process's running sums of folded rounds (``diloco.outer.fold``; filled by
``server.rounds.folding``, read by the close in ``server.rounds.outer_step``).

They live under the scratch dir, ``diloco-folds/<pid>/<run>/<round>`` (8 bytes a parameter
per open round), one folder per process so that two processes of one machine never write one
sum. A fold and its round's close never overlap (a lock per round): an upload folding when
the round closes is finished first. Folders of rounds that closed, and of processes that are
gone, are removed; a closed round's once the close's second pass, which reads it, is done
(``server.rounds.full_files.Pending``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from server.storage.base import Storage


class Folds:
    """This process's running sums, one folder per open round, and a lock per round."""

    def __init__(self, scratch_dir: Path | None) -> None:
        self.parent = Path(scratch_dir or tempfile.gettempdir()) / "diloco-folds"
        self.root = self.parent / str(os.getpid())
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()
        self.failed: set[str] = set()  # uploads that could not be read: the close decides
        self._remove_orphans()

    def folder(self, run_id: str, index: int) -> Path:
        return self.root / run_id / str(index)

    def lock(self, run_id: str, index: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((run_id, index), threading.Lock())

    def drop(self, run_id: str, index: int, *, wait: bool = True) -> bool:
        """The round closed: its sum goes (not while its lock is held, by a fold, the close
        or the close's second pass; ``wait`` False: then not now). Whether it went."""
        lock = self.lock(run_id, index)
        if not lock.acquire(blocking=wait):
            return False
        try:
            shutil.rmtree(self.folder(run_id, index), ignore_errors=True)
        finally:
            lock.release()
        with self._guard:
            self._locks.pop((run_id, index), None)
        return True

    def keep_only(self, rounds: set[tuple[str, int]]) -> None:
        """Remove the sums of rounds not in ``rounds`` (closed, here or by another process),
        but for those still in use (their lock held: removed at a later call)."""
        if not self.root.exists():
            return
        for run_dir in self.root.iterdir():
            for round_dir in run_dir.iterdir():
                if round_dir.name.isdigit() and (run_dir.name, int(round_dir.name)) not in rounds:
                    self.drop(run_dir.name, int(round_dir.name), wait=False)

    def _remove_orphans(self) -> None:
        """Folders of processes of this machine that are gone (a restart's old sums)."""
        if not self.parent.exists():
            return
        for other in self.parent.iterdir():
            if other.name.isdigit() and other != self.root and not _alive(int(other.name)):
                shutil.rmtree(other, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


_FOLDS: dict[Path | None, Folds] = {}
_FOLDS_GUARD = threading.Lock()


def folds_for(storage: Storage) -> Folds:
    """The process's ``Folds`` for a store (its scratch dir)."""
    with _FOLDS_GUARD:
        if storage.scratch_dir not in _FOLDS:
            _FOLDS[storage.scratch_dir] = Folds(storage.scratch_dir)
        return _FOLDS[storage.scratch_dir]
