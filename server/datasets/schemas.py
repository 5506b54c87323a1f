from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class FileState(BaseModel):
    nbytes: int
    sha256: str
    present: bool  # stored and its size checked (its sha256 was checked as it arrived)


class DatasetOut(BaseModel):
    """A registered dataset: every file's state and which are still missing."""

    id: str
    complete: bool
    total_bytes: int
    files: dict[str, FileState]
    missing: list[str]
    manifest: dict[str, Any]


class StoredFile(BaseModel):
    dataset_id: str
    file: str
    stored: bool  # False: it was there already, nothing was read
