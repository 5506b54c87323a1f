"""A prepared dataset's manifest: what ``diloco data prepare`` writes and everything else reads.

A prepared dataset is a folder::

    manifest.json      this document
    tokenizer.json     the tokenizer (a ``tokenizers`` file), byte-identical to what trained it
    shard-00000.bin    training tokens, little-endian ``dtype``, documents back to back,
    shard-00001.bin    each followed by the end-of-document token
    ...
    val.bin            held-out validation tokens, same layout

Every file is named with its size and sha256, so that a copy (an upload, a volunteer's
download) is checked against the manifest and nothing else. The dataset's identity is the
sha256 of its manifest's canonical JSON (``dataset_id``): the same tokens and tokenizer
always give the same id, so an upload cut halfway resumes, and a second run on the same data
uploads nothing.

Tokens are uint16 when the vocabulary fits (at most 65,536 ids), uint32 otherwise
(``token_dtype``); a byte-level text run (``data.path``) keeps its uint8 shards.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FORMAT: Literal["diloco-dataset"] = "diloco-dataset"
VERSION: Literal[1] = 1
MANIFEST = "manifest.json"
TOKENIZER: Literal["tokenizer.json"] = "tokenizer.json"
VAL = "val.bin"


def shard_file(index: int) -> str:
    """The file name of training shard ``index``."""
    return f"shard-{index:05d}.bin"


SHARD_NAME = re.compile(r"^shard-\d{5}\.bin$")
MAX_SHARDS = 100_000  # shard-NNNNN
MAX_VOCAB = 1 << 24  # past any tokenizer in use (Llama 3: 128,256)
MAX_FILE_BYTES = 1 << 40

TokenDtype = Literal["uint16", "uint32"]
SHA256 = r"^[0-9a-f]{64}$"


class ManifestError(ValueError):
    """A manifest (or a file it names) that cannot be used; the message says which part."""


def token_dtype(vocab_size: int) -> TokenDtype:
    """The narrowest dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def itemsize(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Part):
    file: str = Field(min_length=1, max_length=64)
    tokens: int = Field(ge=1, le=MAX_FILE_BYTES)
    nbytes: int = Field(ge=1, le=MAX_FILE_BYTES)
    sha256: str = Field(pattern=SHA256)


class TokenizerEntry(_Part):
    kind: Literal["bytes", "bpe"]  # bytes: ids 0..255 are the bytes themselves
    file: Literal["tokenizer.json"] = TOKENIZER
    sha256: str = Field(pattern=SHA256)
    nbytes: int = Field(ge=1, le=1 << 30)
    vocab_size: int = Field(ge=2, le=MAX_VOCAB)
    eod_id: int = Field(ge=0)  # appended after every document


class Source(_Part):
    name: str = Field(min_length=1, max_length=255)
    kind: Literal["txt", "jsonl", "parquet"]
    bytes: int = Field(ge=0)
    documents: int = Field(ge=0)


class Manifest(_Part):
    format: Literal["diloco-dataset"] = FORMAT
    version: Literal[1] = VERSION
    tokenizer: TokenizerEntry
    dtype: TokenDtype
    shard_tokens: int = Field(ge=2, le=MAX_FILE_BYTES)  # every shard but the last holds this many
    shards: tuple[FileEntry, ...] = Field(min_length=1, max_length=MAX_SHARDS)
    val: FileEntry
    documents: int = Field(ge=1)
    sources: tuple[Source, ...] = Field(default=(), max_length=10_000)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.tokenizer.eod_id >= self.tokenizer.vocab_size:
            raise ValueError(
                f"tokenizer.eod_id {self.tokenizer.eod_id} is outside the vocabulary "
                f"({self.tokenizer.vocab_size})"
            )
        if self.dtype != token_dtype(self.tokenizer.vocab_size):
            raise ValueError(
                f"dtype {self.dtype} does not fit vocabulary {self.tokenizer.vocab_size} "
                f"({token_dtype(self.tokenizer.vocab_size)} does)"
            )
        size = itemsize(self.dtype)
        for i, entry in enumerate(self.shards):
            if entry.file != shard_file(i):
                raise ValueError(f"shards[{i}].file must be {shard_file(i)}, not {entry.file!r}")
            if entry.nbytes != entry.tokens * size:
                raise ValueError(f"shards[{i}]: nbytes must be tokens x {size}")
            if entry.tokens > self.shard_tokens:
                raise ValueError(f"shards[{i}] holds more than shard_tokens tokens")
        if self.val.file != VAL or self.val.nbytes != self.val.tokens * size:
            raise ValueError(f"val: file must be {VAL} and nbytes tokens x {size}")
        return self

    @property
    def train_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards) + self.val.nbytes + self.tokenizer.nbytes

    def files(self) -> dict[str, tuple[int, str]]:
        """Every file of the dataset but the manifest: name -> (nbytes, sha256)."""
        out: dict[str, tuple[int, str]] = {
            TOKENIZER: (self.tokenizer.nbytes, self.tokenizer.sha256)
        }
        out[VAL] = (self.val.nbytes, self.val.sha256)
        out.update({s.file: (s.nbytes, s.sha256) for s in self.shards})
        return out

    def canonical(self) -> bytes:
        """The manifest's canonical JSON: sorted keys, no spaces (what its id hashes)."""
        return json.dumps(
            self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")
        ).encode()


def dataset_id(manifest: Manifest) -> str:
    return "ds_" + hashlib.sha256(manifest.canonical()).hexdigest()[:24]


def parse_manifest(raw: bytes | str) -> Manifest:
    """Validate a manifest's JSON; ManifestError names the offending key."""
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as err:
        parts = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"]) or "manifest"
            parts.append(f"{key}: {e['msg'].removeprefix('Value error, ')}")
        raise ManifestError("; ".join(parts)) from None


def read_manifest(folder: str | Path) -> Manifest:
    path = Path(folder) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(
            f"{folder} is not a prepared dataset (no {MANIFEST}); make one with "
            "`diloco data prepare INPUT... --out DIR`"
        ) from None
    return parse_manifest(raw)
