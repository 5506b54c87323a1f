"""diloco.atomic: the one temp-file, fsync, rename, fsync-the-folder sequence, on a real folder."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diloco import atomic
from diloco.atomic import (
    atomic_path,
    atomic_write,
    atomic_write_text,
    commit,
    fsync_dir,
    is_temp_name,
    temp_path,
)


class Boom(Exception):
    pass


@pytest.fixture
def umask() -> Iterator[None]:
    """A known umask (022) for the test, the caller's restored afterwards."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_write_replaces_the_content_and_leaves_only_the_target(tmp_path: Path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    with atomic_write(target) as f:
        f.write(b"new ")
        f.write(b"bytes")

    assert target.read_bytes() == b"new bytes"
    assert names(tmp_path) == ["state.bin"]


def test_readers_see_the_old_file_until_the_block_ends_and_the_temp_is_beside_it(
    tmp_path: Path,
):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    with atomic_write(target) as f:
        f.write(b"new")
        f.flush()
        assert target.read_bytes() == b"old"
        temps = [n for n in names(tmp_path) if n != "state.bin"]
        assert len(temps) == 1 and is_temp_name(temps[0]) and temps[0].startswith(".state.bin.")

    assert target.read_bytes() == b"new"


def test_an_error_in_the_block_keeps_the_old_file_and_removes_the_temp_file(tmp_path: Path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    with pytest.raises(Boom), atomic_write(target) as f:
        f.write(b"half of the new")
        raise Boom

    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["state.bin"]


def test_an_error_on_a_first_write_leaves_no_file_at_all(tmp_path: Path):
    with pytest.raises(Boom), atomic_write_text(tmp_path / "new.txt") as f:
        f.write("partial")
        raise Boom

    assert names(tmp_path) == []


def test_text_is_written_in_the_encoding_asked(tmp_path: Path):
    target = tmp_path / "client.toml"

    with atomic_write_text(target) as f:
        f.write('name = "zoë"\n')

    assert target.read_bytes() == 'name = "zoë"\n'.encode()


def test_permissions_are_set_before_any_byte_is_written_whatever_the_umask(
    tmp_path: Path, umask: None
):
    target = tmp_path / "credentials.json"
    os.umask(0o077)  # would take the group bit away from 0o640

    with atomic_write_text(target, permissions=0o640) as f:
        (temp,) = [p for p in tmp_path.iterdir() if is_temp_name(p.name)]
        assert mode(temp) == 0o640
        f.write("{}\n")

    assert mode(target) == 0o640


def test_secret_permissions_replace_a_world_readable_file(tmp_path: Path, umask: None):
    target = tmp_path / "credentials.json"
    target.write_text("old")
    target.chmod(0o644)

    with atomic_write_text(target, permissions=0o600) as f:
        f.write("secret")

    assert mode(target) == 0o600 and target.read_text() == "secret"


def test_without_permissions_the_file_gets_what_open_would_give(tmp_path: Path, umask: None):
    target = tmp_path / "plain.txt"

    with atomic_write(target) as f:
        f.write(b"x")

    assert mode(target) == 0o644  # 0o666 & ~0o022


def test_atomic_path_commits_what_a_library_wrote_by_name(tmp_path: Path):
    target = tmp_path / "adamw.safetensors"
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}

    with atomic_path(target, permissions=0o600) as tmp:
        assert tmp.parent == tmp_path and is_temp_name(tmp.name)
        save_file(tensors, str(tmp))

    assert torch.equal(load_file(str(target))["w"], tensors["w"])
    assert mode(target) == 0o600
    assert names(tmp_path) == ["adamw.safetensors"]


def test_atomic_path_removes_what_the_library_wrote_when_it_fails(tmp_path: Path):
    target = tmp_path / "adamw.safetensors"

    with pytest.raises(Boom), atomic_path(target) as tmp:
        tmp.write_bytes(b"half a file")
        raise Boom

    assert names(tmp_path) == []


def test_atomic_path_fails_when_nothing_was_written_and_leaves_the_target(tmp_path: Path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    with pytest.raises(FileNotFoundError), atomic_path(target):
        pass  # the library wrote nothing

    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["state.bin"]


def test_commit_publishes_a_file_written_elsewhere(tmp_path: Path):
    part = tmp_path / "v3.safetensors.part"
    part.write_bytes(b"downloaded")

    commit(part, tmp_path / "v3.safetensors")

    assert names(tmp_path) == ["v3.safetensors"]
    assert (tmp_path / "v3.safetensors").read_bytes() == b"downloaded"


def test_a_failed_commit_removes_the_temp_file_and_keeps_the_target(tmp_path: Path):
    part = tmp_path / ".blob.bin.tmp-0123456789ab"
    part.write_bytes(b"new")
    target = tmp_path / "blob.bin"
    target.mkdir()  # a folder cannot be replaced by a file: the rename fails

    with pytest.raises(OSError):
        commit(part, target)

    assert names(tmp_path) == ["blob.bin"] and target.is_dir()


def test_the_file_and_then_its_folder_are_fsynced_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Prepare: every fsync still happens; we only note what it was on and what the folder
    # held at that moment
    target = tmp_path / "ckpt.safetensors"
    target.write_bytes(b"old")
    real_fsync = os.fsync
    synced: list[tuple[str, int, bytes]] = []

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        synced.append((kind, st.st_ino, target.read_bytes()))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", spy)

    # Execute
    with atomic_write(target) as f:
        f.write(b"new")

    # Assert: the temp file (before the rename), then the folder (after it)
    monkeypatch.undo()
    assert [(kind, content) for kind, _, content in synced] == [
        ("file", b"old"),
        ("dir", b"new"),
    ]
    assert synced[0][1] == target.stat().st_ino  # the renamed temp file is the target now
    assert synced[1][1] == tmp_path.stat().st_ino


def test_fsync_dir_of_a_missing_folder_raises(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")


@pytest.mark.parametrize(
    ("name", "is_temp"),
    [
        # its random part must not name the test: xdist's workers must collect the same ids
        pytest.param(temp_path(Path("/x/3.safetensors")).name, True, id="fresh-temp-name"),
        (".ctr_1-0a1b.bin.tmp-0a1b2c3d4e5f", True),
        ("3.state.tmp-0123456789abcdef", True),  # the older checkpoint scheme
        ("3.safetensors", False),
        ("shard-0.bin", False),
        ("notes.tmp", False),
        (".hidden.tmp-not-hex", False),
    ],
)
def test_temp_names_are_recognised_and_nothing_else(name: str, is_temp: bool):
    assert is_temp_name(name) is is_temp
