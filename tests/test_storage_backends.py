"""Both storage backends against one contract (a real S3 API server for the bucket), and
the signed URLs that direct transfers rest on, checked by that server."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.storage.base import BlobMissing, LocalStorage, Storage, open_storage, parse_storage_url
from server.storage.s3 import PART_BYTES, UNFINISHED, S3Storage
from server.storage.staging import FileCache, Stage, sweep_stale


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "blobs")
    request.getfixturevalue("s3_env")
    bucket = request.getfixturevalue("s3_server").bucket
    return open_storage(f"s3://{bucket}/t-{secrets.token_hex(4)}", tmp_path)


def test_a_committed_blob_reads_back_whole_and_by_listing(storage: Storage) -> None:
    with storage.writer("runs/r1/rounds/1/a.bin") as w:
        w.write(b"hello ")
        w.write(memoryview(b"world"))
        w.commit()
    assert storage.read_bytes("runs/r1/rounds/1/a.bin") == b"hello world"
    assert b"".join(storage.read_chunks("runs/r1/rounds/1/a.bin", 4)) == b"hello world"
    assert storage.size("runs/r1/rounds/1/a.bin") == 11
    assert storage.exists("runs/r1/rounds/1/a.bin")
    assert [b.key for b in storage.list_blobs("runs/r1/")] == ["runs/r1/rounds/1/a.bin"]
    assert list(storage.list_blobs("runs/r2/")) == []


def test_an_aborted_or_abandoned_blob_leaves_nothing(storage: Storage) -> None:
    with storage.writer("runs/r1/x.bin") as w:
        w.write(b"x" * 100)
        w.abort()
    with pytest.raises(RuntimeError), storage.writer("runs/r1/y.bin") as w:
        w.write(b"y" * (PART_BYTES + 10))  # a multipart upload on S3, begun
        raise RuntimeError("the body stalled")
    assert list(storage.list_blobs("runs/")) == []
    assert list(storage.list_unfinished("runs/")) == []
    assert not storage.exists("runs/r1/x.bin")


def test_a_blob_past_one_part_goes_up_in_parts_and_comes_back_equal(
    storage: Storage, tmp_path: Path
) -> None:
    data = secrets.token_bytes(2 * PART_BYTES + 12345)
    with storage.writer("runs/r1/big.bin") as w:
        for at in range(0, len(data), 1 << 20):
            w.write(data[at : at + (1 << 20)])
        w.commit()
    dest = tmp_path / "fetched.bin"
    storage.fetch("runs/r1/big.bin", dest)
    assert dest.read_bytes() == data
    assert storage.head("runs/r1/big.bin").nbytes == len(data)


def test_missing_blobs_say_so(storage: Storage, tmp_path: Path) -> None:
    for call in (
        lambda: storage.read_bytes("runs/none"),
        lambda: storage.head("runs/none"),
        lambda: storage.fetch("runs/none", tmp_path / "x"),
    ):
        with pytest.raises(BlobMissing):
            call()
    assert not storage.exists("runs/none")
    storage.delete("runs/none")  # idempotent


def test_put_file_copy_and_delete_prefix(storage: Storage, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"checkpoint bytes")
    storage.put_file("runs/r1/checkpoints/1.safetensors", src)
    storage.copy("runs/r1/checkpoints/1.safetensors", "runs/r1/checkpoints/copy.safetensors")
    assert storage.read_bytes("runs/r1/checkpoints/copy.safetensors") == b"checkpoint bytes"
    storage.put_file("runs/r2/keep.bin", src)
    assert storage.delete_prefix("runs/r1/") == 2
    assert [b.key for b in storage.list_blobs("runs/")] == ["runs/r2/keep.bin"]


def test_bad_keys_are_refused(storage: Storage) -> None:
    for key in ("", "/abs", "a/../b", "a//b", "./a"):
        with pytest.raises(ValueError):
            storage.writer(key)


def test_a_stage_hands_out_files_and_publishes_outputs(storage: Storage, tmp_path: Path) -> None:
    with storage.writer("runs/r1/in.bin") as w:
        w.write(b"input")
        w.commit()
    scratch = tmp_path / "scratch"
    storage.scratch_dir = scratch
    with Stage(storage) as stage:
        paths = stage.inputs(["runs/r1/in.bin", "runs/r1/gone.bin"], missing_ok=True)
        assert paths["runs/r1/in.bin"].read_bytes() == b"input"
        if storage.local_file("runs/r1/in.bin") is None:  # fetched once: asked again, kept
            storage.delete("runs/r1/in.bin")
            assert stage.input("runs/r1/in.bin").read_bytes() == b"input"
        assert not paths["runs/r1/gone.bin"].exists()
        out = stage.output("runs/r1/out.bin")
        out.write_bytes(b"output")
        stage.publish()
        with pytest.raises(BlobMissing):
            stage.input("runs/r1/gone.bin")
    assert storage.read_bytes("runs/r1/out.bin") == b"output"
    assert not any(scratch.rglob("*.bin")), "a stage leaves no scratch file behind"


# ---------------------------------------------------------------- object storage only


@pytest.fixture
def s3(s3_env: dict[str, str], s3_server, tmp_path: Path) -> S3Storage:  # type: ignore[no-untyped-def]
    store = open_storage(f"s3://{s3_server.bucket}/t-{secrets.token_hex(4)}/", tmp_path)
    assert isinstance(store, S3Storage)
    return store


def test_an_interrupted_multipart_upload_is_listed_unfinished_and_deletable(
    s3: S3Storage,
) -> None:
    w = s3.writer("runs/r1/rounds/1/cut.bin")
    w.write(b"z" * (PART_BYTES + 1))  # one part sent, then the process "dies"
    unfinished = list(s3.list_unfinished("runs/"))
    assert [u.key.split(UNFINISHED)[0] for u in unfinished] == ["runs/r1/rounds/1/cut.bin"]
    s3.delete(unfinished[0].key)
    assert list(s3.list_unfinished("runs/")) == []
    assert list(s3.list_blobs("runs/")) == []


def test_copy_with_if_match_refuses_a_replaced_object(s3: S3Storage) -> None:
    with s3.writer("runs/r1/incoming/a.bin") as w:
        w.write(b"validated bytes")
        w.commit()
    etag = s3.head("runs/r1/incoming/a.bin").etag
    with s3.writer("runs/r1/incoming/a.bin") as w:  # the volunteer PUTs again, after the check
        w.write(b"other bytes!!")
        w.commit()
    with pytest.raises(s3.client.exceptions.ClientError):
        s3.copy("runs/r1/incoming/a.bin", "runs/r1/rounds/1/a.bin", if_match=etag)
    assert not s3.exists("runs/r1/rounds/1/a.bin")


def test_a_missing_bucket_fails_at_startup_with_its_name(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="no-such-bucket"):
        open_storage("s3://no-such-bucket/x", tmp_path)


@pytest.mark.parametrize("url", ["ftp://x/y", "s3://", "file://host/dir", "file://"])
def test_storage_urls_other_than_file_and_s3_are_refused(url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        open_storage(url, tmp_path)


def test_a_signed_get_reads_its_one_object_and_nothing_else(s3: S3Storage) -> None:
    for key, body in (("runs/r1/a.bin", b"object a"), ("runs/r1/b.bin", b"object b")):
        with s3.writer(key) as w:
            w.write(body)
            w.commit()
    url = s3.signed_url("runs/r1/a.bin", "GET", 60)
    assert httpx.get(url).content == b"object a"
    assert httpx.get(url, headers={"Range": "bytes=2-3"}).content == b"je"
    other = url.replace("/runs/r1/a.bin?", "/runs/r1/b.bin?")
    assert other != url
    assert httpx.get(other).status_code == 403  # another object: the signature does not match
    assert httpx.put(url, content=b"evil").status_code == 403  # another method
    assert httpx.delete(url).status_code == 403
    assert s3.read_bytes("runs/r1/a.bin") == b"object a"
    unsigned = url.split("?")[0]
    assert httpx.get(unsigned).status_code == 403


def test_a_signed_put_writes_its_one_object_once_in_time(s3: S3Storage) -> None:
    url = s3.signed_url("runs/r1/incoming/c.bin", "PUT", 60)
    assert httpx.put(url, content=b"contribution").status_code == 200
    assert s3.read_bytes("runs/r1/incoming/c.bin") == b"contribution"
    assert httpx.get(url).status_code == 403  # a PUT URL reads nothing
    elsewhere = url.replace("/incoming/c.bin?", "/incoming/d.bin?")
    assert httpx.put(elsewhere, content=b"x").status_code == 403
    assert not s3.exists("runs/r1/incoming/d.bin")


def test_signed_urls_expire(s3: S3Storage) -> None:
    with s3.writer("runs/r1/a.bin") as w:
        w.write(b"a")
        w.commit()
    get = s3.signed_url("runs/r1/a.bin", "GET", 1)
    put = s3.signed_url("runs/r1/p.bin", "PUT", 1)
    time.sleep(2.5)
    expired = httpx.get(get)
    assert expired.status_code == 403 and b"expired" in expired.content
    assert httpx.put(put, content=b"late").status_code == 403
    assert not s3.exists("runs/r1/p.bin")
    with pytest.raises(ValueError):
        s3.signed_url("runs/r1/a.bin", "GET", 8 * 24 * 3600)  # SigV4's limit is a week


def test_stale_stage_folders_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    old = tmp_path / "diloco-stage-old"
    (old / "runs/r1").mkdir(parents=True)
    (old / "runs/r1/1.safetensors").write_bytes(b"x")
    live = tmp_path / "diloco-stage-live"
    live.mkdir()
    (live / "part").write_bytes(b"y")
    other = tmp_path / "not-ours"
    other.mkdir()
    for path in (old, old / "runs", old / "runs/r1", old / "runs/r1/1.safetensors", other):
        os.utime(path, (1000.0, 1000.0))
    now = time.time()
    assert sweep_stale(tmp_path, max_age_s=3600, now=now) == [old]
    assert not old.exists() and live.exists() and other.exists()


def test_signed_urls_name_the_public_endpoint_and_work_there(
    s3_env: dict[str, str], s3_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # the server reaches the store at 127.0.0.1; volunteers by another name (localhost here)
    public = s3_server.endpoint.replace("127.0.0.1", "localhost")
    store = open_storage(
        f"s3://{s3_server.bucket}/t-{secrets.token_hex(4)}", tmp_path, public_endpoint=public
    )
    with store.writer("runs/r1/a.bin") as w:
        w.write(b"by another name")
        w.commit()
    url = store.signed_url("runs/r1/a.bin", "GET", 60)
    assert url.startswith(public + "/")
    assert httpx.get(url).content == b"by another name"
    assert httpx.get(url.replace("localhost", "127.0.0.1")).status_code == 403  # host is signed


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("file:///srv/blobs", ("file", "/srv/blobs", "")),
        ("s3://bucket", ("s3", "bucket", "")),
        ("s3://bucket/a/b/", ("s3", "bucket", "a/b")),
    ],
)
def test_storage_urls_parse(url: str, parsed: tuple[str, str, str]) -> None:
    assert parse_storage_url(url) == parsed


@pytest.mark.parametrize("url", ["ftp://x/y", "s3:///p", "s3://b/p?x=1", "file:relative", "blobs"])
def test_diloco_serve_refuses_a_storage_url_it_cannot_use_before_starting(url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "client.cli", "serve", "--storage", url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--storage" in out.stderr and ("file:///" in out.stderr or "s3://" in out.stderr)


def test_the_file_cache_keeps_by_key_and_etag_and_evicts_the_least_recent(tmp_path: Path) -> None:
    cache = FileCache(tmp_path / "cache", max_bytes=250)
    for i, key in enumerate(
        ("runs/r/checkpoints/1.safetensors", "runs/r/checkpoints/2.safetensors")
    ):
        src = tmp_path / f"src{i}"  # a finished file, never written again (entries are links)
        src.write_bytes(bytes([i]) * 100)
        cache.put(key, f'"etag{i}"', src)
        os.utime(cache._path(key, f'"etag{i}"'), (1000.0 + i, 1000.0 + i))
    dest = tmp_path / "got"
    assert not cache.get("runs/r/checkpoints/1.safetensors", '"other"', dest)  # another version
    assert cache.get("runs/r/checkpoints/1.safetensors", '"etag0"', dest)  # used: now the newest
    assert dest.read_bytes() == b"\0" * 100
    src = tmp_path / "src2"
    src.write_bytes(b"\2" * 100)
    cache.put("runs/r/checkpoints/3.safetensors", '"etag2"', src)  # 300 > 250: one goes
    assert not cache.get("runs/r/checkpoints/2.safetensors", '"etag1"', tmp_path / "x")
    assert cache.get("runs/r/checkpoints/3.safetensors", '"etag2"', tmp_path / "y")


def test_the_file_cache_evicts_uploads_before_checkpoints(tmp_path: Path) -> None:
    cache = FileCache(tmp_path / "cache", max_bytes=250)
    kept = [
        ("runs/r/checkpoints/1.safetensors", 1000.0),  # the oldest, but a checkpoint
        ("runs/r/rounds/1/c1-00aa.bin", 2000.0),
        ("runs/r/rounds/1/c2-00bb.bin", 3000.0),
    ]
    for i, (key, when) in enumerate(kept):
        src = tmp_path / f"src{i}"
        src.write_bytes(bytes([i]) * 100)
        cache.put(key, '"e"', src)
        os.utime(cache._path(key, '"e"'), (when, when))
    # 300 > 250 after the third: the older upload went, not the older checkpoint
    assert cache.get("runs/r/checkpoints/1.safetensors", '"e"', tmp_path / "a")
    assert not cache.get("runs/r/rounds/1/c1-00aa.bin", '"e"', tmp_path / "b")
    assert cache.get("runs/r/rounds/1/c2-00bb.bin", '"e"', tmp_path / "c")


def test_an_upload_fetched_once_is_read_from_the_cache_by_the_next_stage(
    s3: S3Storage, tmp_path: Path
) -> None:
    """The fold, the score on arrival and the close each stage the same upload: the bucket
    is asked for its bytes once (then one HEAD a stage), until the object changes."""
    s3.scratch_dir, s3.scratch_cache_bytes = tmp_path / "scratch", 1 << 20
    key = "runs/r1/rounds/3/c7-0a0b0c0d.bin"
    with s3.writer(key) as w:
        w.write(b"an upload")
        w.commit()
    with Stage(s3) as stage:
        assert stage.input(key).read_bytes() == b"an upload"
        assert stage.hits == []
    with Stage(s3) as stage:
        assert stage.input(key).read_bytes() == b"an upload"
        assert stage.hits == [key]
    with s3.writer(key) as w:  # not the object the cache holds: fetched again
        w.write(b"another upload")
        w.commit()
    with Stage(s3) as stage:
        assert stage.input(key).read_bytes() == b"another upload"
        assert stage.hits == []


def test_a_published_version_is_read_back_from_the_cache_until_the_store_changes_it(
    s3: S3Storage, tmp_path: Path
) -> None:
    s3.scratch_dir, s3.scratch_cache_bytes = tmp_path / "scratch", 1 << 20
    key = "runs/r1/checkpoints/4.safetensors"
    with Stage(s3) as stage:
        stage.output(key).write_bytes(b"version 4")
        stage.publish()
    with Stage(s3) as stage:
        assert stage.input(key).read_bytes() == b"version 4"
        assert stage.hits == [key]
    with s3.writer(key) as w:  # another worker published this version again, differently
        w.write(b"version 4, again")
        w.commit()
    with Stage(s3) as stage:
        assert stage.input(key).read_bytes() == b"version 4, again"
        assert stage.hits == []
    with Stage(s3) as stage:  # and that one is kept now
        assert stage.input(key).read_bytes() == b"version 4, again"
        assert stage.hits == [key]
