"""``diloco data prepare``: a corpus becomes token shards, a validation file and a manifest
(``diloco.data.manifest``), streamed: memory holds one batch of text and its tokens, never an
input or the dataset.

The token stream is the inputs' documents in order, each followed by the end-of-document
token. It is cut into blocks of ``val_block`` tokens; every ``val_every``-th block, from
the first on, goes to ``val.bin`` until that holds ``val_tokens``, and everything else to
the training shards, ``shard_tokens`` each (the last one shorter). A rule of position
alone: it needs no total, gives the same split for the same inputs every time, and spreads
the held-out text over the whole corpus rather than its tail. Every file is hashed as it
is written; ``manifest.json`` is written last, so a folder with a manifest is complete.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from diloco.data.inputs import InputError, Piece, kind_of, pieces
from diloco.data.manifest import (
    MANIFEST,
    TOKENIZER,
    VAL,
    FileEntry,
    Manifest,
    ManifestError,
    Source,
    TokenizerEntry,
    read_manifest,
    shard_file,
    token_dtype,
)
from diloco.data.tokenizer import TextTokenizer, resolve

BATCH_BYTES = 2 << 20  # text tokenized at once (encode_batch runs on every core)
Progress = Callable[[str, int], None]  # (stage, input bytes consumed)


class PrepareError(ValueError):
    """The dataset cannot be prepared as asked; the message says why."""


@dataclass(frozen=True)
class PrepareOptions:
    tokenizer: str = "bytes"  # bytes | train:VOCAB | PATH to a tokenizer.json
    eod_token: str | None = None
    shard_tokens: int = 1 << 24  # 32 MiB of uint16 per shard
    val_block: int = 8192
    val_every: int = 100
    val_tokens: int = 1 << 22
    force: bool = False

    def check(self) -> None:
        if self.shard_tokens < 2 or self.val_block < 2 or self.val_every < 1:
            raise PrepareError("--shard-tokens and the validation block must be >= 2 tokens")
        if self.val_tokens < self.val_block:
            raise PrepareError(
                f"--val-tokens {self.val_tokens} is less than one validation block "
                f"({self.val_block})"
            )


@dataclass
class _File:
    """One output file being written, hashed on the way."""

    path: Path
    handle: BinaryIO
    tokens: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)

    def write(self, raw: bytes, count: int) -> None:
        self.handle.write(raw)
        self.digest.update(raw)
        self.tokens += count

    def close(self) -> FileEntry:
        self.handle.close()
        size = self.path.stat().st_size
        return FileEntry(
            file=self.path.name, tokens=self.tokens, nbytes=size, sha256=self.digest.hexdigest()
        )


class TokenSink:
    """Deals the token stream into the validation file and the training shards."""

    def __init__(self, out: Path, dtype: str, opts: PrepareOptions) -> None:
        self.out, self.dtype, self.opts = out, np.dtype(dtype).newbyteorder("<"), opts
        self.position = 0  # tokens of the stream so far
        # the files stay open across extend() calls; close() closes them
        self.val = _File(out / VAL, open(out / VAL, "wb"))  # noqa: SIM115
        self.shards: list[FileEntry] = []
        self.shard: _File | None = None

    def _to_val(self, block: int) -> bool:
        return block % self.opts.val_every == 0 and self.val.tokens < self.opts.val_tokens

    def extend(self, ids: np.ndarray) -> None:
        while ids.size:
            block, within = divmod(self.position, self.opts.val_block)
            take = min(ids.size, self.opts.val_block - within)
            part, ids = ids[:take], ids[take:]
            if self._to_val(block):
                self.val.write(part.astype(self.dtype).tobytes(), take)
            else:
                self._train(part)
            self.position += take

    def _train(self, part: np.ndarray) -> None:
        while part.size:
            if self.shard is None:
                path = self.out / shard_file(len(self.shards))
                self.shard = _File(path, open(path, "wb"))  # noqa: SIM115
            room = self.opts.shard_tokens - self.shard.tokens
            head, part = part[:room], part[room:]
            self.shard.write(head.astype(self.dtype).tobytes(), head.size)
            if self.shard.tokens == self.opts.shard_tokens:
                self.shards.append(self.shard.close())
                self.shard = None

    def close(self) -> tuple[list[FileEntry], FileEntry]:
        if self.shard is not None:
            self.shards.append(self.shard.close())
            self.shard = None
        if self.val.tokens == 0:
            raise PrepareError("the corpus gave no validation tokens")
        val = self.val.close()
        if not self.shards:
            raise PrepareError(
                f"the corpus ({self.position:,} tokens) is all validation: its first "
                f"{self.opts.val_block:,} tokens are held out; for a corpus this small pass a "
                f"smaller --val-block (e.g. {max(2, self.position // 10):,})"
            )
        return self.shards, val


@dataclass
class Summary:
    manifest: Manifest
    path: Path


def _batches(stream: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch: list[Piece] = []
    size = 0
    for piece in stream:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _clear(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise PrepareError(f"--out {out} is not empty; pass --force to replace it")
        (out / MANIFEST).unlink(missing_ok=True)  # first: the folder is no longer complete
        for child in out.iterdir():
            if child.name in (TOKENIZER, VAL) or child.name.startswith("shard-"):
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)


def prepare(
    inputs: Sequence[Path], out: Path, opts: PrepareOptions, progress: Progress | None = None
) -> Summary:
    """Tokenize ``inputs`` into a prepared dataset at ``out``."""
    opts.check()
    if not inputs:
        raise PrepareError("give at least one input file")
    kinds = {path: kind_of(path) for path in inputs}  # every input checked before any work
    report = progress or (lambda stage, n: None)

    def texts() -> Iterator[str]:  # the training pass of train:VOCAB
        for path in inputs:
            for piece in pieces(path):
                report("training tokenizer", piece.nbytes)
                yield piece.text

    tokenizer = resolve(opts.tokenizer, texts, eod_token=opts.eod_token)
    _clear(out, opts.force)
    dtype = token_dtype(tokenizer.vocab_size)
    sink = TokenSink(out, dtype, opts)
    sources, documents = [], 0
    for path in inputs:
        docs = _tokenize(path, tokenizer, sink, report)
        sources.append(Source(name=path.name, kind=kinds[path], bytes=path.stat().st_size,
                              documents=docs))  # fmt: skip
        documents += docs
    if documents == 0:
        raise PrepareError("the inputs hold no documents")
    shards, val = sink.close()
    text = tokenizer.to_json()
    (out / TOKENIZER).write_text(text, encoding="utf-8")
    raw = text.encode("utf-8")
    manifest = Manifest(
        tokenizer=TokenizerEntry(
            kind=tokenizer.kind,
            sha256=hashlib.sha256(raw).hexdigest(),
            nbytes=len(raw),
            vocab_size=tokenizer.vocab_size,
            eod_id=tokenizer.eod_id,
        ),
        dtype=dtype,
        shard_tokens=opts.shard_tokens,
        shards=tuple(shards),
        val=val,
        documents=documents,
        sources=tuple(sources),
    )
    (out / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return Summary(manifest, out)


def _tokenize(path: Path, tokenizer: TextTokenizer, sink: TokenSink, report: Progress) -> int:
    """Stream one input's documents into the sink; returns how many there were."""
    documents = 0
    eod = np.array([tokenizer.eod_id], dtype=np.int64)
    for batch in _batches(pieces(path)):
        encoded = tokenizer.encode_batch([p.text for p in batch])
        parts: list[np.ndarray] = []
        for piece, ids in zip(batch, encoded, strict=True):
            parts.append(np.asarray(ids, dtype=np.int64))
            if piece.ends_document:
                parts.append(eod)
                documents += 1
        sink.extend(np.concatenate(parts))
        report("tokenizing", sum(p.nbytes for p in batch))
    return documents


def verify(folder: str | Path, progress: Progress | None = None) -> Manifest:
    """Check every file of a prepared dataset against its manifest (size and sha256, read
    streamed); ManifestError names the first file that differs."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for name, (nbytes, sha) in manifest.files().items():
        path = folder / name
        if not path.is_file():
            raise ManifestError(f"{path}: missing")
        if path.stat().st_size != nbytes:
            raise ManifestError(f"{path}: {path.stat().st_size} bytes, the manifest says {nbytes}")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
                if progress is not None:
                    progress("verifying", len(block))
        if digest.hexdigest() != sha:
            raise ManifestError(f"{path}: its sha256 is not the manifest's (the file changed)")
    return manifest


def open_tokens(path: str | Path, dtype: str) -> np.memmap:
    """A token file as a read-only memory map: pages are read as windows touch them."""
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


__all__ = ["InputError", "PrepareError", "PrepareOptions", "open_tokens", "prepare", "verify"]
