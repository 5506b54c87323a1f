"""An upload inspected as it streams (diloco.outer.inspection.UploadInspector as a wire.FrameSink):
the same verdicts, norm and digest as decoding every tensor, without holding or
dequantising one, whatever pieces the body arrives in."""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import pytest
import torch

from diloco.outer.inspection import UploadInspector, int8_block_stats
from diloco.wire.codec import EncodedTensor, Int8Codec, make_codec
from diloco.wire.contribution import (
    ContributionDecoder,
    ContributionMeta,
    NonFiniteWireError,
    WireFormatError,
    decode_contribution,
    encode_contribution,
)
from diloco.wire.header import DIGEST_BYTES, PREFIX

BLOCK = 16
INT8 = {"kind": "int8", "block_size": BLOCK}
FP32 = {"kind": "none"}
SHAPES = {"a": (70,), "b": (9, 7), "empty": (0,), "c": (3,)}  # blocks cut short, one empty
FLT_MAX = float(np.finfo(np.float32).max)


def delta(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    d["a"][16:32] = 0.0  # an all-zero block: scale 0
    return d


def body(kind: str, seed: int = 1) -> bytes:
    codec_ = make_codec(kind, BLOCK)  # blocks below a run's minimum: exact by hand
    encoded = {n: codec_.encode(t) for n, t in delta(seed).items()}
    codec = codec_.describe()
    meta = ContributionMeta("run_x", 1, 0, 100, 5, 2.0, codec)
    return b"".join(encode_contribution(meta, encoded))


def data_offset(raw: bytes) -> int:
    """Where the first tensor's data frame starts."""
    _, header_len = PREFIX.unpack(raw[: PREFIX.size])
    return PREFIX.size + header_len


def tampered(raw: bytes, at: int, new: bytes) -> bytes:
    """``raw`` with ``new`` written at ``at`` and its trailer recomputed (a valid body)."""
    out = bytearray(raw[:-DIGEST_BYTES])
    out[at : at + len(new)] = new
    return bytes(out + hashlib.sha256(out).digest())


def streamed(raw: bytes, codec: dict, piece: int) -> tuple[UploadInspector, ContributionDecoder]:
    inspector = UploadInspector(codec)
    decoder = ContributionDecoder(SHAPES, codec=codec, sink=inspector)
    for at in range(0, len(raw), piece):
        assert decoder.feed(raw[at : at + piece]) == []  # no tensor is ever handed out
    decoder.finish()
    return inspector, decoder


def whole(raw: bytes, codec: dict) -> UploadInspector:
    _, encoded = decode_contribution(raw, SHAPES, codec=codec)
    inspector = UploadInspector(codec)
    for name, tensor in encoded.items():
        inspector.add(name, tensor)
    return inspector


def decoded_norm(raw: bytes, codec: dict) -> float:
    """The reference: every tensor dequantised to fp32, its squares summed in float64."""
    _, encoded = decode_contribution(raw, SHAPES, codec=codec)
    codec_ = Int8Codec(BLOCK) if codec["kind"] == "int8" else None
    total = 0.0
    for e in encoded.values():
        x = codec_.decode(e) if codec_ is not None else e.data
        total += float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
    return math.sqrt(total)


# ---------------------------------------------------------------- the pure pieces


def test_int8_block_stats_are_max_abs_and_sum_of_squares_per_block():
    q = np.array([1, -2, 3, -4, 5, 0, -127, 2], np.int8)

    absmax, qsq = int8_block_stats(memoryview(q), 4)
    tail_max, tail_sq = int8_block_stats(memoryview(q[:3]), 4)  # a shorter, last block

    assert absmax.tolist() == [4, 127]
    assert qsq.tolist() == [1 + 4 + 9 + 16, 25 + 0 + 16129 + 4]
    assert (tail_max.tolist(), tail_sq.tolist()) == ([3], [14])


def test_int8_block_stats_flag_minus_128_as_128():
    absmax, _ = int8_block_stats(memoryview(np.array([3, -128, 0, 1], np.int8)), 4)

    assert absmax.tolist() == [128]


@pytest.mark.parametrize("kind", ["int8", "none"])
def test_the_norm_without_decoding_equals_the_norm_of_the_decoded_tensors(kind):
    codec = INT8 if kind == "int8" else FP32
    raw = body(kind)

    inspector, _ = streamed(raw, codec, piece=1 << 16)

    assert inspector.norm == pytest.approx(decoded_norm(raw, codec), rel=1e-6)


def test_a_large_int8_tensor_norm_matches_the_decoded_one_to_float64_tolerance():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1_000_003, generator=gen) * torch.logspace(-6, 2, 1_000_003)
    e = Int8Codec(4096).encode(x)
    inspector = UploadInspector({"kind": "int8", "block_size": 4096})

    inspector.add("x", e)

    expected = float(torch.linalg.vector_norm(Int8Codec(4096).decode(e), dtype=torch.float64))
    assert inspector.norm == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("q", [1, 50, 126, 127])
@pytest.mark.parametrize("nudge", [-2, -1, 0, 1, 2])
def test_int8_finiteness_from_the_scales_matches_decoding_at_the_overflow_edge(q, nudge):
    # Prepare: one block whose largest |q| times its scale sits at float32's overflow edge
    edge = np.float32(FLT_MAX / q)
    scale = edge
    with np.errstate(over="ignore"):  # FLT_MAX's next is Inf: refused too
        for _ in range(abs(nudge)):
            scale = np.nextafter(scale, np.float32(np.inf if nudge > 0 else 0), dtype=np.float32)
    data = torch.tensor([q, -q // 2, 0, 1] * 4, dtype=torch.int8)
    e = EncodedTensor((16,), data, torch.tensor([scale], dtype=torch.float32))
    finite = bool(torch.isfinite(Int8Codec(BLOCK).decode(e)).all())
    inspector = UploadInspector(INT8)

    # Execute / Assert: refused as non-finite exactly when decoding overflows; a block that
    # decodes finite this close to the edge is refused too, for its norm (its squares
    # overflow float32)
    why = "past the 1e\\+15 an outer step can take" if finite else "decodes to non-finite values"
    with pytest.raises(NonFiniteWireError, match=f"'w'.* {why}|'w' {why}"):
        inspector.add("w", e)


@pytest.mark.parametrize("kind", ["int8", "none"])
@pytest.mark.parametrize(("norm", "refused"), [(0.99e15, False), (1.01e15, True)])
def test_an_upload_whose_norm_no_float32_step_can_take_is_refused(kind, norm, refused):
    # finite values, ‖x‖ measured in float64: past MAX_UPLOAD_NORM its squares would
    # overflow the close's float32 sums
    x = torch.full((4096,), norm / 64.0)  # ‖x‖ = norm
    codec = Int8Codec(4096) if kind == "int8" else make_codec("none")
    inspector = UploadInspector(codec.describe())

    if not refused:
        inspector.add("w", codec.encode(x))
        assert inspector.norm == pytest.approx(norm, rel=1e-3)
        return
    with pytest.raises(NonFiniteWireError, match=r"norm reaches 1\.01e\+15 here, past the 1e\+15"):
        inspector.add("w", codec.encode(x))


# ---------------------------------------------------------------- streamed bodies


@pytest.mark.parametrize("kind", ["int8", "none"])
@pytest.mark.parametrize("piece", [1, 3, 7, BLOCK + 1, 4096])
def test_a_body_in_any_pieces_is_measured_as_its_whole_tensors_are(kind, piece):
    codec = INT8 if kind == "int8" else FP32
    raw = body(kind)

    inspector, decoder = streamed(raw, codec, piece)

    reference = whole(raw, codec)
    # int8: sums per block, wherever the pieces cut; fp32: float64 partial sums per piece
    assert inspector.norm == pytest.approx(reference.norm, rel=0 if kind == "int8" else 1e-12)
    assert inspector.payload_sha256 == reference.payload_sha256
    assert decoder.body_sha256 == hashlib.sha256(raw).hexdigest()


def test_the_payload_digest_covers_names_data_and_scales_not_the_header():
    raw = body("int8")
    _, encoded = decode_contribution(raw, SHAPES, codec=INT8)
    by_hand = hashlib.sha256()
    for name, e in encoded.items():
        by_hand.update(name.encode() + e.data.numpy().tobytes() + e.scales.numpy().tobytes())

    inspector, _ = streamed(raw, INT8, piece=5)

    assert inspector.payload_sha256 == by_hand.hexdigest()


def test_a_streamed_int8_minus_128_is_refused_as_the_decoder_refuses_it():
    raw = tampered(body("int8"), data_offset(body("int8")) + 40, b"\x80")
    with pytest.raises(WireFormatError) as held:
        decode_contribution(raw, SHAPES, codec=INT8)

    with pytest.raises(WireFormatError) as streaming:
        streamed(raw, INT8, piece=7)

    assert (
        str(streaming.value)
        == str(held.value)
        == ("tensor 'a' has int8 value -128, outside [-127, 127]")
    )


def test_streamed_fp32_nans_are_counted_across_pieces_as_the_decoder_counts_them():
    nan = struct.pack("<f", float("nan"))
    raw = body("none")
    raw = tampered(tampered(raw, data_offset(raw) + 8, nan), data_offset(raw) + 200, nan)
    with pytest.raises(NonFiniteWireError) as held:
        decode_contribution(raw, SHAPES, codec=FP32)

    with pytest.raises(NonFiniteWireError) as streaming:
        streamed(raw, FP32, piece=3)

    assert str(streaming.value) == str(held.value)
    assert "'a' has 2 non-finite value(s) (NaN/Inf) in its data" in str(held.value)


def test_the_header_is_judged_before_any_tensor_byte_reaches_the_sink():
    seen: list[str] = []

    class Refuse(Exception):
        pass

    class Sink(UploadInspector):
        def begin(self, spec):  # type: ignore[no-untyped-def]
            seen.append(spec.name)
            super().begin(spec)

    def judge(header):  # type: ignore[no-untyped-def]
        raise Refuse(header.meta.run_id)

    decoder = ContributionDecoder(SHAPES, codec=INT8, on_header=judge, sink=Sink(INT8))

    with pytest.raises(Refuse, match="run_x"):
        decoder.feed(body("int8"))  # the whole body in one chunk
    assert seen == []


def test_a_payload_digested_later_in_batches_is_the_same_digest():
    raw = body("int8")
    later = UploadInspector(INT8, digest_later=True)
    decoder = ContributionDecoder(SHAPES, codec=INT8, sink=later)
    batches = []
    for at in range(0, len(raw), 50):
        decoder.feed(raw[at : at + 50])
        batches.append(later.digest_work())

    for work in batches:
        later.digest(work)

    assert later.payload_sha256 == streamed(raw, INT8, piece=50)[0].payload_sha256
