"""`diloco data prepare`: every input kind, shard boundaries, the manifest's checksums, the
tokenizers, and bad input named clearly."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco.data.inputs import InputError
from diloco.data.manifest import ManifestError, dataset_id, parse_manifest, read_manifest
from diloco.data.prepare import PrepareError, PrepareOptions, open_tokens, prepare, verify
from diloco.data.tokenizer import TokenizerError, byte_tokenizer, load_file, train_bpe
from tests.support.corpora import TINYSHAKESPEARE

REPO = Path(__file__).resolve().parents[1]
DOCS = ["First document: ROMEO and JULIET.\n", "Deuxième — ünïcödé ✓ 日本語", "", "third\n\n"]
SMALL = PrepareOptions(shard_tokens=16, val_block=8, val_every=5, val_tokens=16)


def stream_of(out: Path) -> np.ndarray:
    """The token stream back: val blocks and shard tokens re-interleaved by the split rule."""
    m = read_manifest(out)
    train = np.concatenate([open_tokens(out / s.file, m.dtype) for s in m.shards])
    val = np.asarray(open_tokens(out / "val.bin", m.dtype))
    return train, val


def expected_stream(docs: list[str], eod: int) -> list[int]:
    tok = byte_tokenizer()
    return [i for d in docs for i in [*tok.encode(d), eod]]


def interleave(train: np.ndarray, val: np.ndarray, opts: PrepareOptions) -> list[int]:
    out, t, v, block = [], 0, 0, 0
    while t < train.size or v < val.size:
        to_val = block % opts.val_every == 0 and v < opts.val_tokens and v < val.size
        src, n = (val, v) if to_val else (train, t)
        take = src[n : n + opts.val_block]
        out += take.tolist()
        if to_val:
            v += take.size
        else:
            t += take.size
        block += 1
    return out


def test_byte_tokenizer_ids_are_the_bytes_and_decode_round_trips():
    tok = byte_tokenizer()
    text = "héllo wörld\n\n ROMEO: 日本 \x00\x7f"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    assert byte_tokenizer(eod=False).vocab_size == 256


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_every_input_kind_gives_its_documents_each_followed_by_the_eod_token(tmp_path, kind):
    if kind == "txt":
        inputs = []
        for i, doc in enumerate(DOCS):
            (path := tmp_path / f"doc{i}.txt").write_text(doc or " ", encoding="utf-8")
            inputs.append(path)
        docs = [d or " " for d in DOCS]
    elif kind == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n\n" for i, d in
                                enumerate(DOCS)), encoding="utf-8")  # fmt: skip
        inputs, docs = [path], DOCS
    else:
        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"id": list(range(4)), "text": DOCS}), path, row_group_size=2)
        inputs, docs = [path], DOCS
    out = tmp_path / "ds"

    summary = prepare(inputs, out, SMALL)

    m = summary.manifest
    assert m.documents == 4 and m.tokenizer.kind == "bytes" and m.dtype == "uint16"
    assert [s.kind for s in m.sources] == [kind] * len(inputs)
    train, val = stream_of(out)
    assert interleave(train, val, SMALL) == expected_stream(docs, eod=256)


def test_shards_hold_exactly_shard_tokens_but_the_last_and_checksums_match(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcdefghij" * 50, encoding="utf-8")  # 500 bytes + EOD = 501 tokens
    out = tmp_path / "ds"

    m = prepare([corpus], out, SMALL).manifest

    assert all(s.tokens == 16 for s in m.shards[:-1]) and 0 < m.shards[-1].tokens <= 16
    assert m.val.tokens == 16  # capped: blocks 0 and 5 of 8 tokens
    assert m.train_tokens + m.val.tokens == 501
    for entry in [*m.shards, m.val]:
        raw = (out / entry.file).read_bytes()
        assert len(raw) == entry.nbytes == 2 * entry.tokens
        assert hashlib.sha256(raw).hexdigest() == entry.sha256
    tokenizer = (out / "tokenizer.json").read_bytes()
    assert hashlib.sha256(tokenizer).hexdigest() == m.tokenizer.sha256
    assert parse_manifest((out / "manifest.json").read_bytes()) == m
    assert dataset_id(m).startswith("ds_") and verify(out) == m


def test_verify_names_a_changed_file(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x" * 300, encoding="utf-8")
    out = tmp_path / "ds"
    prepare([corpus], out, SMALL)
    shard = out / "shard-00002.bin"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))

    with pytest.raises(ManifestError, match=r"shard-00002.bin: its sha256 is not the manifest's"):
        verify(out)


def test_a_bpe_trained_here_compresses_shakespeare_and_its_file_loads_again(tmp_path):
    corpus = TINYSHAKESPEARE
    out = tmp_path / "ds"

    m = prepare([corpus], out, PrepareOptions(tokenizer="train:512")).manifest

    total = m.train_tokens + m.val.tokens
    assert m.tokenizer.kind == "bpe" and m.tokenizer.vocab_size == 512
    assert total < 0.6 * corpus.stat().st_size  # BPE: well under a token per byte
    again = load_file(out / "tokenizer.json")
    assert again.eod_id == m.tokenizer.eod_id and again.vocab_size == 512
    # the same corpus and vocabulary train the same tokenizer: the same dataset id
    m2 = prepare([corpus], tmp_path / "ds2", PrepareOptions(tokenizer="train:512")).manifest
    assert dataset_id(m2) == dataset_id(m)


def test_a_given_tokenizer_needs_an_end_of_document_token(tmp_path):
    tok = train_bpe(iter(["some text to learn merges from"] * 10), 300)
    raw = json.loads(tok.to_json())
    raw["added_tokens"] = []  # no special tokens at all
    raw["model"]["vocab"].pop("<|endoftext|>")
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(raw), encoding="utf-8")

    with pytest.raises(TokenizerError, match="name its end-of-document token with --eod-token"):
        load_file(path)
    assert load_file(path, eod_token="a").eod_id == raw["model"]["vocab"]["a"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", b"", r"empty.txt: the file is empty"),
        ("bad.txt", b"good text\n\xff\xfe bad", r"bad.txt: byte 10 is not UTF-8"),
        ("bad.jsonl", b'{"text": "a"}\n[1, 2]\n', r"bad.jsonl: line 2 must be a JSON object"),
        ("bad2.jsonl", b'{"text": "a"}\n{"text": \n', r"bad2.jsonl: line 2 is not JSON"),
        ("bad3.jsonl", b'{"body": "a"}\n', r"line 1 must be a JSON object with a string `text`"),
        ("notes.md", b"# hi", r"notes.md: unsupported input .md"),
    ],
)
def test_bad_input_is_named_with_where(tmp_path, name, content, message):
    (path := tmp_path / name).write_bytes(content)
    with pytest.raises(InputError, match=message):
        prepare([path], tmp_path / "ds", SMALL)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_parquet_without_a_text_column_lists_its_columns(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a", "b"], "n": [1, 2]}), path)
    with pytest.raises(InputError, match=r"no `text` column \(it has body, n\)"):
        prepare([path], tmp_path / "ds", SMALL)


def test_a_corpus_too_small_for_training_tokens_and_a_full_out_dir_are_refused(tmp_path):
    (tiny := tmp_path / "t.txt").write_text("abc", encoding="utf-8")
    with pytest.raises(PrepareError, match=r"is all validation.*pass a smaller --val-block"):
        prepare([tiny], tmp_path / "ds", SMALL)  # 4 tokens: one block, held out
    (big := tmp_path / "b.txt").write_text("abc" * 100, encoding="utf-8")
    (full := tmp_path / "full").mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(PrepareError, match="is not empty; pass --force"):
        prepare([big], full, SMALL)


def test_the_cli_prepares_verifies_and_exits_3_on_bad_data(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(50)))
    cli = [sys.executable, "-m", "client.cli", "data"]

    ok = subprocess.run([*cli, "prepare", str(corpus), "--out", str(tmp_path / "ds"),
                         "--shard-tokens", "1000", "--val-block", "500", "--quiet"],
                        capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    checked = subprocess.run([*cli, "verify", str(tmp_path / "ds"), "--quiet"],
                             capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    (tmp_path / "bad.txt").write_bytes(b"\xff")
    bad = subprocess.run([*cli, "prepare", str(tmp_path / "bad.txt"), "--out",
                          str(tmp_path / "ds2")], capture_output=True, text=True, timeout=120,
                         cwd=REPO)  # fmt: skip

    assert ok.returncode == 0, ok.stderr
    m = read_manifest(tmp_path / "ds")
    assert ok.stdout.split()[0] == dataset_id(m) and "50 documents" in ok.stderr
    assert checked.returncode == 0 and "every file matches" in checked.stdout
    assert bad.returncode == 3 and "byte 0 is not UTF-8" in bad.stderr
