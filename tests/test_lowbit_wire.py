"""The packed codecs (diloco.wire.lowbit) on the wire: a whole body round trip, its exact
size, a refusal for every malformed frame, and the parts of the server that do not read
them yet saying so rather than misreading them."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.config import ModelSection
from diloco.model.architectures import build_model
from diloco.outer import chunked
from diloco.outer.exact import Terms, weighted_sum
from diloco.outer.inspection import UploadInspector
from diloco.outer.upload_file import UploadFile
from diloco.wire.codec import EncodedTensor, codec_from_description
from diloco.wire.contribution import (
    ContributionDecoder,
    ContributionMeta,
    WireFormatError,
    contribution_nbytes,
    decode_contribution,
    encode_contribution,
)
from diloco.wire.lowbit import LowBitCodec, SparseCodec

CODECS = [SparseCodec(), LowBitCodec(4), LowBitCodec(2), SparseCodec(chunk=256, topk=8, bits=3)]


def meta_for(codec) -> ContributionMeta:
    return ContributionMeta(
        run_id="run_x", round=3, base_version=2, tokens=4096, inner_steps=10, loss=3.5,
        codec=codec.describe(),
    )  # fmt: skip


def delta_of(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}


SHAPES = {"wte": (300, 64), "h.0.attn": (64, 192), "ln.bias": (64,), "empty": (0,)}


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: str(c.describe()))
def test_a_packed_body_round_trips_with_its_exact_size(codec) -> None:
    encoded = {n: codec.encode(t) for n, t in delta_of(SHAPES).items()}
    meta = meta_for(codec)
    body = b"".join(encode_contribution(meta, encoded, chunk_size=777))

    got_meta, got = decode_contribution(body, SHAPES, codec=codec.describe())

    assert len(body) == contribution_nbytes(meta, encoded)
    assert got_meta == meta
    for name, e in encoded.items():
        assert torch.equal(got[name].data, e.data) and torch.equal(got[name].scales, e.scales)
        assert torch.equal(codec.decode(got[name]), codec.decode(e))


def test_a_sparse_upload_of_a_demo_model_is_under_four_hundredths_of_a_byte_per_parameter():
    model = build_model(ModelSection(n_layer=2, n_head=4, n_embd=128, block_size=128))
    params = {n: p.detach() for n, p in model.named_parameters()}
    n_params = sum(p.numel() for p in params.values())
    codec = SparseCodec()
    encoded = {n: codec.encode(p * 1e-3) for n, p in params.items()}

    nbytes = contribution_nbytes(meta_for(codec), encoded)

    assert 300_000 < n_params < 1_000_000
    assert nbytes / n_params <= 0.04, (nbytes, n_params)


def body_with(codec, mutate) -> bytes:
    """A one-tensor body whose encoded tensor ``mutate`` has changed (data or scales)."""
    e = codec.encode(torch.randn(1000, generator=torch.Generator().manual_seed(1)))
    e = mutate(e)
    return b"".join(encode_contribution(meta_for(codec), {"w": e}))


def set_byte(e: EncodedTensor, at: int, value: int) -> EncodedTensor:
    data = e.data.clone()
    data[at] = value
    return EncodedTensor(e.shape, data, e.scales)


def with_scale(e: EncodedTensor, value: float) -> EncodedTensor:
    scales = e.scales.clone()
    scales[0] = value
    return EncodedTensor(e.shape, e.data, scales)


SPARSE = SparseCodec(chunk=256, topk=8, bits=2)  # 8 fields of 10 bits: 10 bytes a chunk


@pytest.mark.parametrize(
    ("codec", "mutate", "message"),
    [
        # chunk 0's first field: index 255 (the low 8 bits of byte 0), so the next is smaller
        (SPARSE, lambda e: set_byte(e, 0, 0xFF), "do not increase"),
        # the short last chunk (1000 = 3 x 256 + 232): an index of 232 or more is past it
        (SPARSE, lambda e: set_byte(e, 30, 0xFF), "past its chunk of 232"),
        (SPARSE, lambda e: with_scale(e, math.nan), "non-finite value"),
        (SPARSE, lambda e: with_scale(e, -1.0), "negative scales"),
        (SPARSE, lambda e: with_scale(e, 1e9), "not finite in \\[0, 10000"),
        (LowBitCodec(4, 128), lambda e: set_byte(e, 0, 0xFF), "out of range"),
        (LowBitCodec(2, 128), lambda e: set_byte(e, 0, 0xFF), "out of range"),
    ],
)
def test_a_malformed_packed_frame_is_a_wire_format_error_naming_the_tensor(
    codec, mutate, message
) -> None:
    body = body_with(codec, mutate)
    with pytest.raises(WireFormatError, match=f"tensor 'w'.*{message}"):
        decode_contribution(body, {"w": (1000,)}, codec=codec.describe())


@pytest.mark.parametrize("codec", [SPARSE, LowBitCodec(4, 128)], ids=["sparse", "int4"])
def test_a_packed_frame_of_the_wrong_size_is_never_sent_nor_read(codec) -> None:
    # the header does not say a frame's length: the codec and the shape do
    with pytest.raises(WireFormatError, match=r"data bytes but codec .* needs"):
        body_with(codec, lambda e: EncodedTensor(e.shape, e.data[:-1], e.scales))
    good = body_with(codec, lambda e: e)
    with pytest.raises(WireFormatError, match="truncated"):
        decode_contribution(good[:-40], {"w": (1000,)})


@pytest.mark.parametrize(
    ("description", "message"),
    [
        ({"kind": "sparse", "chunk": 4096, "topk": 64}, "needs exactly the keys"),
        ({"kind": "sparse", "chunk": 4096, "topk": 64, "bits": 2, "x": 1}, "needs exactly"),
        ({"kind": "sparse", "chunk": 4096, "topk": 64, "bits": True}, "must be integers"),
        ({"kind": "sparse", "chunk": 4096, "topk": 5000, "bits": 2}, "topk must be in"),
        ({"kind": "int4", "block_size": 0}, "block_size must be an integer >= 1"),
        ({"kind": "int2", "block_size": "64"}, "must be integers"),
        ({"kind": "int3"}, "unknown codec kind"),
    ],
)
def test_packed_codec_descriptions_are_strict(description, message) -> None:
    with pytest.raises(ValueError, match=message):
        codec_from_description(description)


@pytest.mark.parametrize("codec", CODECS[:3], ids=["sparse", "int4", "int2"])
def test_the_servers_inspection_measures_a_packed_upload_as_it_streams(codec) -> None:
    encoded = {n: codec.encode(t) for n, t in delta_of(SHAPES, seed=2).items()}
    body = b"".join(encode_contribution(meta_for(codec), encoded))
    streamed = UploadInspector(codec.describe())
    decoder = ContributionDecoder(SHAPES, codec=codec.describe(), sink=streamed)
    for at in range(0, len(body), 333):  # pieces cut anywhere, inside records too
        decoder.feed(body[at : at + 333])
    decoder.finish()
    whole = UploadInspector(codec.describe())
    for name, e in encoded.items():
        whole.add(name, e)

    expected = math.sqrt(
        sum(float(codec.decode(e).double().pow(2).sum()) for e in encoded.values())
    )
    assert streamed.norm == pytest.approx(expected, rel=1e-12)
    assert (whole.norm, whole.payload_sha256) == (streamed.norm, streamed.payload_sha256)


def test_the_servers_inspection_refuses_a_malformed_packed_frame_as_it_streams() -> None:
    body = body_with(SPARSE, lambda e: set_byte(e, 0, 0xFF))  # indices out of order
    decoder = ContributionDecoder(sink=UploadInspector(SPARSE.describe()))
    with pytest.raises(WireFormatError, match=r"tensor 'w'.*do not increase"):
        decoder.feed(body)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: str(c.describe()))
@pytest.mark.parametrize("pass_chunk", [300, 4096], ids=["unaligned chunks", "one chunk"])
def test_the_close_sums_packed_uploads_range_by_range_as_the_whole_tensors_would(
    codec, pass_chunk, tmp_path, monkeypatch
) -> None:
    # pass chunks of 300 values cut sparse chunks and packed bytes: ranges overlap and the
    # trailer is checked by hashing the file again
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", pass_chunk)
    shapes = {n: s for n, s in SHAPES.items()}
    coefficients = [0.5, 0.3, 0.2]
    uploads, decoded = [], []
    for i in range(3):
        encoded = {n: codec.encode(t) for n, t in delta_of(shapes, seed=10 + i).items()}
        path = tmp_path / f"u{i}.bin"
        path.write_bytes(b"".join(encode_contribution(meta_for(codec), encoded)))
        uploads.append(UploadFile(f"con_{i}", path, shapes, codec.describe()))
        decoded.append({n: codec.decode(e) for n, e in encoded.items()})

    norms = [math.sqrt(sum(float(t.double().square().sum()) for t in d.values())) for d in decoded]
    terms = Terms.of(coefficients, norms, math.fsum(coefficients))
    result = chunked.run_pass(uploads, terms, shapes, align=100, keep=True)

    for name in shapes:
        g = weighted_sum([d[name] for d in decoded], terms)
        assert torch.equal(result.kept[name], g), name
    for u in uploads:
        u.close()
