"""Reading a corpus for ``diloco data prepare``, streamed: never a whole file in memory.

Each input yields ``Piece``s of text; a piece that ends a document says so, and the
preparation appends the end-of-document token after it.

- ``.txt``: the file is one document, read in pieces of about ``PIECE_BYTES`` cut after a
  newline (or, in a line longer than that, before a character's first byte), so no
  character is ever split and the byte-level BPE sees the same words it would whole.
- ``.jsonl``: one JSON object per line with a string ``text`` field: one document each;
  blank lines are skipped.
- ``.parquet``: a string column ``text``, one document per row, read in record batches;
  a null row is an error (a corpus with holes is a corpus to clean first).

Text must be UTF-8: undecodable bytes are an error naming the file and byte offset (or
line), never replaced silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 1 << 20
KINDS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}


class InputError(ValueError):
    """An input that cannot be prepared; the message names the file and where."""


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool
    nbytes: int  # input bytes this piece consumed (for progress)


def kind_of(path: Path) -> str:
    kind = KINDS.get(path.suffix.lower())
    if kind is None:
        raise InputError(
            f"{path}: unsupported input {path.suffix or '(no extension)'}; give .txt, .jsonl "
            "(a `text` field per line) or .parquet (a `text` column)"
        )
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty")
    return kind


def pieces(path: Path) -> Iterator[Piece]:
    """The input's text, piece by piece (``kind_of`` checked it first)."""
    kind = kind_of(path)
    if kind == "txt":
        yield from _txt(path)
    elif kind == "jsonl":
        yield from _jsonl(path)
    else:
        yield from _parquet(path)


def _cut(block: bytes) -> int:
    """Where to end a piece inside ``block``: after its last newline, else before the
    last character's first byte (UTF-8 continuation bytes are 0b10xxxxxx)."""
    newline = block.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    i = len(block) - 1
    while i > 0 and block[i] & 0xC0 == 0x80:
        i -= 1
    return i if i > 0 else len(block)


def _decode(raw: bytes, path: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{path}: byte {offset + err.start} is not UTF-8 ({err.reason}); convert the file "
            "to UTF-8 first"
        ) from None


def _txt(path: Path) -> Iterator[Piece]:
    offset, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            block = carry + f.read(PIECE_BYTES)
            last = len(block) <= len(carry)  # nothing more was read: the file's end
            end = len(block) if last else _cut(block)
            piece, carry = block[:end], block[end:]
            if piece or last:
                yield Piece(_decode(piece, path, offset), ends_document=last, nbytes=len(piece))
            offset += len(piece)
            if last:
                return


def _jsonl(path: Path) -> Iterator[Piece]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                doc = json.loads(raw)
            except UnicodeDecodeError as err:
                raise InputError(f"{path}: line {number} is not UTF-8 ({err.reason})") from None
            except ValueError as err:
                raise InputError(f"{path}: line {number} is not JSON ({err})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise InputError(
                    f"{path}: line {number} must be a JSON object with a string `text` field"
                )
            yield Piece(doc["text"], ends_document=True, nbytes=len(raw))


def _parquet(path: Path) -> Iterator[Piece]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading parquet needs pip install 'diloco-hub[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise InputError(f"{path}: not a parquet file ({err})") from None
    names = pf.schema_arrow.names
    if "text" not in names:
        raise InputError(
            f"{path}: no `text` column (it has {', '.join(names) or 'none'}); rename the column "
            "holding the documents to `text`"
        )
    column = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(column) or pa.types.is_large_string(column)):
        raise InputError(f"{path}: the `text` column holds {column}, not strings")
    total, row = max(1, pf.metadata.num_rows), 0
    size = path.stat().st_size
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        texts = batch.column(0).to_pylist()
        for text in texts:
            if text is None:
                raise InputError(f"{path}: row {row} has no text (null); drop or fill it first")
            row += 1
            yield Piece(text, ends_document=True, nbytes=size // total)
