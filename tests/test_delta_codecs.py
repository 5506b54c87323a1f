"""Published deltas in every download codec (``[compression] download``): the file format,
the bit-exact rebuild a returning volunteer makes, the strict reading, and the config keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from diloco.config import CompressionSection
from diloco.wire import delta as deltas
from diloco.wire.codec import Int8Codec
from diloco.wire.exchange import delta_codec_for
from diloco.wire.lowbit import LowBitCodec, SparseCodec
from diloco.wire.tensorfile import TensorFileWriter

SHAPES = {"w": (70, 130), "b": (9,), "e": (4, 4096)}
CODECS = {
    "int8": Int8Codec(256),
    "int4": LowBitCodec(4, 256),
    "int2": LowBitCodec(2, 256),
    "sparse": SparseCodec(chunk=4096, topk=256, bits=2),
}


def _theta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _publish(path: Path, codec: deltas.DeltaCodec, seed: int = 1) -> dict[str, torch.Tensor]:
    """A delta of a random change written as the close writes it; the decoded changes."""
    gen = torch.Generator().manual_seed(seed)
    encoded, changes = {}, {}
    for n, s in SHAPES.items():
        encoded[n], change = deltas.publish_change(1e-3 * torch.randn(s, generator=gen), codec)
        changes[n] = change.view(s)
    deltas.write_delta(path, encoded, run_id="r", version=3, base_version=2, codec=codec)
    return changes


@pytest.mark.parametrize("kind", list(CODECS))
def test_a_delta_in_each_codec_rebuilds_the_published_parameters_bit_for_bit(tmp_path, kind):
    codec = CODECS[kind]
    changes = _publish(tmp_path / "d", codec)
    theta = _theta(0)
    want = {n: t + changes[n] for n, t in theta.items()}

    delta = deltas.read_delta(tmp_path / "d", SHAPES)
    deltas.apply_delta(theta, delta)

    assert (delta.version, delta.base_version) == (3, 2)
    assert delta.codec.describe() == codec.describe()
    assert all(torch.equal(theta[n], want[n]) for n in SHAPES)
    # the close's judge applies it a tensor at a time, from the file: the same bits
    flat = {n: t.reshape(-1).clone() for n, t in _theta(0).items()}
    deltas.apply_delta_file(flat, tmp_path / "d")
    assert all(torch.equal(flat[n].view(SHAPES[n]), want[n]) for n in SHAPES)
    numel = sum(math.prod(s) for s in SHAPES.values())
    per_param = (tmp_path / "d").stat().st_size / numel
    # the file's weight a parameter, headers included: what a returning volunteer downloads
    assert per_param <= {"int8": 1.1, "int4": 0.6, "int2": 0.35, "sparse": 0.2}[kind]


def test_a_sparse_delta_moves_only_its_top_k_values_of_each_chunk(tmp_path):
    changes = _publish(tmp_path / "d", SparseCodec(chunk=4096, topk=64, bits=2))
    moved = int(sum(int((c != 0).sum()) for c in changes.values()))
    chunks = sum(-(-math.prod(s) // 4096) for s in SHAPES.values())
    # every chunk keeps 64 values (the short ones all of theirs when fewer): b has 9
    assert moved == 64 * (chunks - 1) + 9


def test_a_format_1_int8_delta_is_still_read(tmp_path):
    # Prepare: the format before the download codec was chosen: int8, "block_size" metadata
    codec = CODECS["int8"]
    changes = _publish(tmp_path / "d", codec)
    delta = deltas.read_delta(tmp_path / "d", SHAPES)
    meta = deltas.metadata(run_id="r", version=3, base_version=2, names=list(SHAPES), codec=codec)
    meta = {k: v for k, v in meta.items() if k != "codec"}
    meta |= {"format_version": "1", "block_size": "256"}
    with TensorFileWriter(tmp_path / "v1", deltas.entries(SHAPES, codec), meta) as out:
        for n, e in delta.tensors.items():
            out.write(deltas.SCALES + n, 0, e.scales)
            out.write(deltas.DATA + n, 0, e.data)
        out.commit()
    theta = _theta(0)
    want = {n: t + changes[n] for n, t in theta.items()}

    deltas.apply_delta(theta, deltas.read_delta(tmp_path / "v1", SHAPES))

    assert all(torch.equal(theta[n], want[n]) for n in SHAPES)


def _rewrite_metadata(src: Path, dest: Path, **changes: str) -> None:
    delta = deltas.read_delta(src, SHAPES)
    meta = (
        deltas.metadata(
            run_id="r", version=3, base_version=2, names=list(SHAPES), codec=delta.codec
        )
        | changes
    )
    with TensorFileWriter(dest, deltas.entries(SHAPES, delta.codec), meta) as out:
        for n, e in delta.tensors.items():
            out.write(deltas.SCALES + n, 0, e.scales)
            out.write(deltas.DATA + n, 0, e.data)
        out.commit()


@pytest.mark.parametrize(
    "codec",
    [
        json.dumps({"kind": "none"}),
        json.dumps({"kind": "int3", "block_size": 256}),
        json.dumps({"kind": "sparse", "chunk": 4096, "topk": 256}),
        "not json",
    ],
    ids=["fp32", "unknown kind", "missing key", "not json"],
)
def test_a_delta_naming_a_codec_it_cannot_be_in_is_refused(tmp_path, codec):
    _publish(tmp_path / "d", CODECS["sparse"])
    _rewrite_metadata(tmp_path / "d", tmp_path / "bad", codec=codec)

    with pytest.raises(deltas.DeltaError, match="malformed metadata"):
        deltas.read_delta(tmp_path / "bad", SHAPES)


def test_a_delta_whose_codec_does_not_fit_its_tensors_is_refused(tmp_path):
    _publish(tmp_path / "d", CODECS["sparse"])
    other = json.dumps(SparseCodec(chunk=4096, topk=128, bits=2).describe())
    _rewrite_metadata(tmp_path / "d", tmp_path / "bad", codec=other)

    with pytest.raises(deltas.DeltaError, match="do not fit"):
        deltas.read_delta(tmp_path / "bad", SHAPES)
    flat = {n: t.reshape(-1) for n, t in _theta(0).items()}
    with pytest.raises(deltas.DeltaError, match="do not fit"):
        deltas.apply_delta_file(flat, tmp_path / "bad")
    assert all(torch.equal(flat[n].view(SHAPES[n]), t) for n, t in _theta(0).items())


@pytest.mark.parametrize("kind", ["int2", "sparse"])
def test_packed_codes_that_do_not_decode_are_a_delta_error_not_a_rebuild(tmp_path, kind):
    _publish(tmp_path / "d", CODECS[kind])
    delta = deltas.read_delta(tmp_path / "d", SHAPES)
    data = delta.tensors["e"].data
    # int2: code 3 is never produced; sparse: the first index becomes 4095, the last one
    data[:2] = 0xFF

    with pytest.raises(deltas.DeltaError, match="'e' does not decode"):
        deltas.apply_delta(_theta(0), delta)


@pytest.mark.parametrize(
    ("given", "download", "download_topk"),
    [
        ({}, "int8", 512),
        ({"kind": "none"}, "int8", 512),
        ({"kind": "int4"}, "int4", 512),
        ({"kind": "int2"}, "int4", 512),  # int2 deltas cost int2 uploads 7% more loss
        ({"kind": "sparse"}, "sparse", 512),  # 8 x the uploads' 64 of 4096
        ({"kind": "sparse", "topk": 32}, "sparse", 256),
        # 8 x 64 is more than the chunk: at most the chunk, and a sparse delta of more than
        # half of it would cost more bytes than int8
        ({"kind": "sparse", "chunk": 256, "topk": 64}, "int8", 256),
        ({"kind": "sparse", "chunk": 256, "topk": 64, "download": "sparse"}, "sparse", 256),
        ({"kind": "sparse", "download": "int2", "download_topk": 100}, "int2", 100),
        ({"kind": "int8", "download": "sparse"}, "sparse", 512),
    ],
)
def test_the_download_codec_follows_the_upload_kind_unless_given(given, download, download_topk):
    section = CompressionSection(**given)

    assert (section.download_kind, section.download_k) == (download, download_topk)
    codec = delta_codec_for(section)
    assert codec.kind == download
    if download == "sparse":
        assert isinstance(codec, SparseCodec) and codec.topk == download_topk
    # what a run records: the choice written in, the same codec
    pinned = section.pinned()
    assert (pinned.download, pinned.download_topk) == (download, download_topk)
    assert delta_codec_for(pinned).describe() == codec.describe()


@pytest.mark.parametrize(
    "given",
    [{"download": "none"}, {"download_topk": 5000}, {"chunk": 256, "download_topk": 257}],
)
def test_a_download_codec_that_cannot_be_is_refused(given):
    with pytest.raises(ValueError, match="download"):
        CompressionSection(**given)
