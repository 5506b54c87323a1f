"""Blobs in an S3-compatible bucket (AWS S3, R2, MinIO, SeaweedFS, ...), through boto3.

boto3 is the reference S3 client: it signs URLs (``generate_presigned_url``), runs
multipart uploads on threads (``upload_file``) and retries throttled requests; its client
objects are thread-safe, which the close's parallel fetches need.
Credentials and the endpoint come from the standard variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``).

Keys map to ``<prefix><key>`` in the bucket. A blob written through ``writer`` goes up in
8 MiB parts (a multipart upload once it outgrows one part, a single PUT otherwise) and
exists for readers only when ``commit`` returns: S3 makes an object visible, whole and
durable, when its PUT or CompleteMultipartUpload answers. An upload cut by a crash stays
an incomplete multipart upload, which ``list_unfinished`` reports under the key
``<key>#upload=<id>`` and ``delete`` aborts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from server.storage.base import BlobInfo, BlobMissing, check_key

log = logging.getLogger("diloco.server.storage")

PART_BYTES = 8 << 20  # multipart part size (S3's minimum is 5 MiB, except the last part)
READ_BYTES = 4 << 20  # what each read of a GET's body asks for
UNFINISHED = "#upload="  # marks an incomplete multipart upload's key in list_unfinished
MAX_SIGNED_S = 7 * 24 * 3600  # SigV4 presigned URLs live at most a week


def _missing(err: Exception) -> bool:
    code = getattr(err, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchUpload")


class _S3Writer:
    def __init__(self, storage: S3Storage, key: str) -> None:
        self._s3, self._key, self._full = storage, key, storage.full(key)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._open = True
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._open:
            raise RuntimeError(f"blob {self._key} is already committed or aborted")
        self._buffer += data
        self.nbytes += len(data)
        while len(self._buffer) >= PART_BYTES:
            self._send_part(bytes(self._buffer[:PART_BYTES]))
            del self._buffer[:PART_BYTES]

    def _send_part(self, body: bytes) -> None:
        client, bucket = self._s3.client, self._s3.bucket
        if self._upload_id is None:
            started = client.create_multipart_upload(Bucket=bucket, Key=self._full)
            self._upload_id = started["UploadId"]
        number = len(self._parts) + 1
        sent = client.upload_part(
            Bucket=bucket, Key=self._full, UploadId=self._upload_id, PartNumber=number, Body=body
        )
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})

    def commit(self) -> None:
        if not self._open:
            raise RuntimeError(f"blob {self._key} is already committed or aborted")
        client, bucket = self._s3.client, self._s3.bucket
        if self._upload_id is None:
            client.put_object(Bucket=bucket, Key=self._full, Body=bytes(self._buffer))
        else:
            if self._buffer:
                self._send_part(bytes(self._buffer))
            client.complete_multipart_upload(
                Bucket=bucket,
                Key=self._full,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
        self._open = False
        self._buffer = bytearray()

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        self._buffer = bytearray()
        if self._upload_id is not None:
            self._s3.abort_upload(self._full, self._upload_id)

    def __enter__(self) -> _S3Writer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._open:  # not committed: an error or an early return
            self.abort()


class S3Storage:
    """Blobs as objects under ``s3://<bucket>/<prefix>``."""

    direct = True  # volunteers can move bytes to and from the bucket with signed URLs

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any | None = None,
        scratch_dir: Path | None = None,
        scratch_cache_bytes: int = 0,
        public_endpoint: str = "",
    ) -> None:
        self.scratch_dir, self.scratch_cache_bytes = scratch_dir, scratch_cache_bytes
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}"
        self.client = client if client is not None else make_client()
        # signed URLs name the host volunteers reach the store by, which may not be the one
        # this server uses (a compose network's http://minio:9000): signing is local
        # computation, so a second client only signs
        self._signer = make_client(public_endpoint) if public_endpoint else self.client
        import boto3.s3.transfer

        # multipart transfers of 16 MiB parts on 8 threads: a 1 GB blob moves in ~64 parts
        self._transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=64 << 20, multipart_chunksize=16 << 20, max_concurrency=8
        )

    def full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _key_of(self, full: str) -> str:
        return full[len(self.prefix) :]

    # ---------------------------------------------------------------- reading

    def read_chunks(
        self, key: str, chunk_size: int = 1 << 20, *, if_match: str | None = None
    ) -> Generator[bytes, None, None]:
        body = self._get(key, **({} if if_match is None else {"IfMatch": if_match}))["Body"]
        try:
            yield from body.iter_chunks(chunk_size)
        finally:
            body.close()

    def read_bytes(self, key: str) -> bytes:
        body = self._get(key)["Body"]
        try:
            return bytes(body.read())
        finally:
            body.close()

    def _get(self, key: str, **extra: Any) -> dict[str, Any]:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.full(key), **extra)
        except self.client.exceptions.ClientError as err:
            if _missing(err):
                raise BlobMissing(key) from None
            raise

    def head(self, key: str) -> BlobInfo:
        try:
            got = self.client.head_object(Bucket=self.bucket, Key=self.full(key))
        except self.client.exceptions.ClientError as err:
            if _missing(err):
                raise BlobMissing(key) from None
            raise
        return BlobInfo(
            key, got["ContentLength"], got["LastModified"].timestamp(), got.get("ETag", "")
        )

    def size(self, key: str) -> int:
        return self.head(key).nbytes

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except BlobMissing:
            return False
        return True

    def local_file(self, key: str) -> Path | None:
        return None  # objects are not files on this machine: fetch() makes one

    def fetch(self, key: str, dest: Path) -> None:
        """One streaming GET, written as it arrives: the least CPU of the ways tried here,
        with the close's fetches four at a time (``staging.FETCH_THREADS``): 0.32 CPU-s for
        8 uploads of 50 MB, against 0.44 for s3transfer's ``download_file`` (ranged GETs
        on 8 threads, 256 KiB pieces through queues) and 0.5-1.1 for ranged GETs on threads
        of our own (medians of 5, 2026-11-28). One stream per blob is slower than ranges
        for a big blob alone (a base version the cache lacks); the close's CPU comes first."""
        with open(dest, "wb") as out:
            for chunk in self.read_chunks(key, READ_BYTES):
                out.write(chunk)

    # ---------------------------------------------------------------- writing

    def writer(self, key: str) -> _S3Writer:
        return _S3Writer(self, key)

    def put_file(self, key: str, src: Path) -> None:
        self.client.upload_file(str(src), self.bucket, self.full(key), Config=self._transfer)

    def copy(self, src: str, dst: str, *, if_match: str | None = None) -> None:
        extra = {} if if_match is None else {"CopySourceIfMatch": if_match}
        source = {"Bucket": self.bucket, "Key": self.full(src)}
        try:
            if self.head(src).nbytes < (5 << 30):  # one request, done inside the store
                self.client.copy_object(
                    Bucket=self.bucket, Key=self.full(dst), CopySource=source, **extra
                )
            else:  # CopyObject's limit: a multipart copy
                self.client.copy(
                    source, self.bucket, self.full(dst), ExtraArgs=extra, Config=self._transfer
                )
        except self.client.exceptions.ClientError as err:
            if _missing(err):
                raise BlobMissing(src) from None
            raise

    def delete(self, key: str) -> None:
        if UNFINISHED in key:
            key, upload_id = key.split(UNFINISHED, 1)
            self.abort_upload(self.full(key), upload_id)
            return
        self.client.delete_object(Bucket=self.bucket, Key=self.full(key))

    def abort_upload(self, full: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except self.client.exceptions.ClientError as err:
            if not _missing(err):
                raise

    def delete_prefix(self, prefix: str) -> int:
        if not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must name a folder: end it with /")
        count = 0
        batch: list[dict[str, str]] = []
        for blob in list(self.list_blobs(prefix)):
            batch.append({"Key": self.full(blob.key)})
            if len(batch) == 1000:  # DeleteObjects' limit
                count += self._delete_batch(batch)
                batch = []
        if batch:
            count += self._delete_batch(batch)
        for unfinished in list(self.list_unfinished(prefix)):
            self.delete(unfinished.key)
        return count

    def _delete_batch(self, batch: list[dict[str, str]]) -> int:
        answer = self.client.delete_objects(
            Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
        )
        if errors := answer.get("Errors"):
            raise OSError(f"the bucket refused to delete {len(errors)} objects: {errors[:3]}")
        return len(batch)

    # ---------------------------------------------------------------- listing

    def list_blobs(self, prefix: str) -> Iterator[BlobInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must name a folder: end it with /")
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield BlobInfo(
                    self._key_of(obj["Key"]),
                    obj["Size"],
                    obj["LastModified"].timestamp(),
                    obj.get("ETag", ""),
                )

    def list_unfinished(self, prefix: str) -> Iterator[BlobInfo]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"prefix {prefix!r} must name a folder: end it with /")
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        for page in pages:
            for up in page.get("Uploads", []):
                key = self._key_of(up["Key"]) + UNFINISHED + up["UploadId"]
                yield BlobInfo(key, 0, up["Initiated"].timestamp())

    # ---------------------------------------------------------------- signed URLs

    def signed_url(self, key: str, method: Literal["GET", "PUT"], expires_s: int) -> str:
        """A URL that lets its holder do ``method`` on this one object, for ``expires_s``
        seconds (1 s to a week), and nothing else: the store checks the signature, which
        covers the method, the bucket, the key and the expiry."""
        if not 1 <= expires_s <= MAX_SIGNED_S:
            raise ValueError(f"a signed URL lives 1 s to {MAX_SIGNED_S} s, not {expires_s}")
        operation = {"GET": "get_object", "PUT": "put_object"}[method]
        return str(
            self._signer.generate_presigned_url(
                operation,
                Params={"Bucket": self.bucket, "Key": self.full(key)},
                ExpiresIn=expires_s,
            )
        )

    def check(self) -> None:
        """Fail early, with the bucket's name, when it cannot be reached or does not exist."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as err:  # botocore raises several unrelated classes here
            raise RuntimeError(f"storage {self.url}: the bucket cannot be reached: {err}") from err


def make_client(endpoint: str = "") -> Any:
    """A boto3 S3 client from the standard environment variables (``endpoint`` instead of
    ``AWS_ENDPOINT_URL`` when given); SigV4 everywhere (the presigned URLs too), standard
    retries, a connection pool for parallel transfers.

    Bodies are sent unsigned (``UNSIGNED-PAYLOAD``, with botocore's CRC32 checksum, which
    the store checks): what botocore does by itself over https. To an ``http://`` endpoint
    it would otherwise SHA-256 every body it sends, a second hash of bytes the server has
    hashed already (a version's files, a proxied upload), 0.6 ns a byte: half the CPU of a
    put. The signature still covers the method, the key, the headers and the checksum; over
    plain http the body itself is as exposed as every GET's answer is (never signed), so
    tampering on that link is TLS's to stop, as it is for reads."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL") or None,
        region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
        config=Config(
            signature_version="s3v4",
            retries={"max_attempts": 5, "mode": "standard"},
            max_pool_connections=32,
            s3={"payload_signing_enabled": False},
        ),
    )
