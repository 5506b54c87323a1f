"""LocalStorage on a real folder: blob writers, and the listing and prefix removal the janitor
uses (keys, never paths)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.storage.base import LocalStorage


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    return LocalStorage(tmp_path / "blobs")


def put(storage: LocalStorage, key: str, data: bytes) -> None:
    with storage.writer(key) as w:
        w.write(data)
        w.commit()


def test_a_committed_blob_is_listed_with_its_size_and_mtime(storage: LocalStorage):
    put(storage, "runs/r1/data/val.bin", b"12345")
    put(storage, "runs/r1/rounds/1/a.bin", b"xy")
    put(storage, "other/x.bin", b"")
    os.utime(storage.path("runs/r1/data/val.bin"), (1000.0, 1000.0))

    listed = {b.key: b for b in storage.list_blobs("runs/")}

    assert sorted(listed) == ["runs/r1/data/val.bin", "runs/r1/rounds/1/a.bin"]
    assert listed["runs/r1/data/val.bin"].nbytes == 5
    assert listed["runs/r1/data/val.bin"].modified == 1000.0
    assert sorted(b.key for b in storage.list_blobs("")) == sorted([*listed, "other/x.bin"])


def test_a_write_in_progress_is_unfinished_until_committed(storage: LocalStorage):
    writer = storage.writer("runs/r1/rounds/1/a.bin")
    writer.write(b"half")

    unfinished = [b.key for b in storage.list_unfinished("runs/")]
    listed = list(storage.list_blobs("runs/"))
    writer.commit()

    assert len(unfinished) == 1 and unfinished[0].startswith("runs/r1/rounds/1/.a.bin.tmp-")
    assert listed == []
    assert list(storage.list_unfinished("")) == []
    assert [b.key for b in storage.list_blobs("runs/")] == ["runs/r1/rounds/1/a.bin"]


def test_an_unfinished_write_can_be_deleted_by_its_key(storage: LocalStorage):
    writer = storage.writer("runs/r1/rounds/1/a.bin")
    writer.write(b"left by a crash")
    (leftover,) = storage.list_unfinished("")

    storage.delete(leftover.key)

    assert list(storage.list_unfinished("")) == []
    writer.abort()


def test_delete_prefix_removes_the_folder_and_counts_its_files(storage: LocalStorage):
    put(storage, "runs/r1/data/val.bin", b"1")
    put(storage, "runs/r1/checkpoints/0.safetensors", b"2")
    crashed = storage.writer("runs/r1/checkpoints/1.safetensors")
    crashed.write(b"unfinished")
    put(storage, "runs/r2/data/val.bin", b"3")

    removed = storage.delete_prefix("runs/r1/")
    crashed.abort()

    assert removed == 3
    assert not (storage.root / "runs" / "r1").exists()
    assert [b.key for b in storage.list_blobs("")] == ["runs/r2/data/val.bin"]
    assert storage.delete_prefix("runs/r1/") == 0  # already gone: nothing to do


def test_delete_prefix_never_follows_a_link_out_of_the_folder(
    storage: LocalStorage, tmp_path: Path
):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    put(storage, "runs/r1/data/val.bin", b"1")
    (storage.root / "runs" / "r1" / "link").symlink_to(outside, target_is_directory=True)

    storage.delete_prefix("runs/r1/")

    assert (outside / "keep.txt").read_text() == "keep"
    assert not (storage.root / "runs" / "r1").exists()


@pytest.mark.parametrize("prefix", ["runs/r1", "../", "runs/../", "/"])
def test_a_prefix_must_be_a_relative_folder(storage: LocalStorage, prefix: str):
    with pytest.raises(ValueError):
        storage.delete_prefix(prefix)
    with pytest.raises(ValueError):
        list(storage.list_blobs(prefix))


def test_a_name_that_is_not_utf8_is_no_key_and_is_left_alone(storage: LocalStorage):
    put(storage, "runs/r1/data/val.bin", b"1")
    odd = os.path.join(os.fsencode(storage.root / "runs" / "r1"), b"\xff.bin")
    with open(odd, "wb") as f:
        f.write(b"not ours")

    keys = [b.key for b in storage.list_blobs("runs/")]

    assert keys == ["runs/r1/data/val.bin"]
    assert os.path.exists(odd)
