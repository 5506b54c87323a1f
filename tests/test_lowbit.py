"""diloco.wire.lowbit: the dense int4/int2 and the sparse top-k codecs, their bit layout,
error feedback, and a refusal for every malformed body."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.wire.codec import EncodedTensor, NonFiniteError
from diloco.wire.lowbit import (
    MAX_SCALE,
    LowBitCodec,
    SparseCodec,
    bytes_per_value,
    encode_with_feedback,
    pack_fields,
    unpack_fields,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 12, 14, 20])
def test_fields_pack_into_exactly_their_bits_and_back(width: int) -> None:
    fields = torch.randint(0, 2**width, (3, 13), generator=gen(width))
    packed = pack_fields(fields, width)
    assert packed.dtype == torch.uint8 and packed.shape == (3, math.ceil(13 * width / 8))
    back, pad_clear = unpack_fields(packed, 13, width)
    assert torch.equal(back, fields) and bool(pad_clear.all())


def test_the_first_field_is_in_the_lowest_bits() -> None:
    # 12-bit index 5, 2-bit code 3: 5 | 3 << 12 = 0x3005 -> bytes 0x05, 0x30
    assert pack_fields(torch.tensor([[5 | 3 << 12]]), 14).tolist() == [[0x05, 0x30]]


# ------------------------------------------------------------------------------ sparse


def test_sparse_keeps_the_topk_of_each_chunk_in_index_order_within_half_a_level() -> None:
    x = torch.randn(2 * 4096 + 1808, generator=gen())
    codec = SparseCodec()
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)

    assert encoded.data.numel() == codec.data_nbytes(x.numel()) == 3 * 112
    assert encoded.scales.numel() == 3
    for c, (start, stop) in enumerate([(0, 4096), (4096, 8192), (8192, x.numel())]):
        chunk, got = x[start:stop], decoded[start:stop]
        kept = set(chunk.abs().topk(64).indices.tolist())
        assert set(got.nonzero().flatten().tolist()) == kept
        step = float(encoded.scales[c])  # two bits: levels -1.5 s, -0.5 s, 0.5 s, 1.5 s
        assert float((got - chunk)[list(kept)].abs().max()) <= step / 2 + 1e-6
        assert math.isclose(float(got.abs().max()), float(chunk.abs().max()), rel_tol=1e-6)


def test_a_short_last_chunk_keeps_all_its_values_when_under_topk() -> None:
    x = torch.randn(4096 + 10, generator=gen(1))
    decoded = SparseCodec().decode(SparseCodec().encode(x))
    assert int((decoded[4096:] != 0).sum()) == 10
    assert torch.equal(decoded[4096:].sign(), x[4096:].sign())


def test_sparse_defaults_send_under_three_hundredths_of_a_byte_per_value() -> None:
    codec = SparseCodec()
    assert codec.describe() == {"kind": "sparse", "chunk": 4096, "topk": 64, "bits": 2}
    assert bytes_per_value(codec, 4096 * 1000) == pytest.approx((112 + 4) / 4096)
    assert bytes_per_value(codec, 4096 * 1000) < 0.03


def test_error_feedback_sends_the_whole_update_over_rounds() -> None:
    """A constant update sent every round, 8 values of each 256 at a time: what arrived plus
    the residual still held is the rounds' total, and the residual stops growing, so the
    share not yet sent falls as 1 / rounds."""
    codec = SparseCodec(chunk=256, topk=8)
    delta = torch.randn(1024, generator=gen(2))
    error, sent, norms = None, torch.zeros(1024), {}
    for rounds in range(1, 401):
        encoded, error = encode_with_feedback(codec, delta, error, decay=1.0)
        sent += codec.decode(encoded)
        norms[rounds] = float(error.norm())
    assert error is not None
    assert torch.allclose(sent + error, 400 * delta, rtol=1e-4, atol=1e-2)
    assert norms[400] < 1.1 * norms[100]
    assert norms[400] < 0.04 * float((400 * delta).norm())


def test_error_feedback_starts_from_zero_and_decays_what_it_carries() -> None:
    codec = SparseCodec(chunk=16, topk=2)
    delta = torch.randn(64, generator=gen(3))
    first, error = encode_with_feedback(codec, delta, None, decay=0.5)
    assert torch.equal(first.data, codec.encode(delta).data)
    second, _ = encode_with_feedback(codec, delta, error, decay=0.5)
    assert torch.equal(second.data, codec.encode(delta + 0.5 * error).data)


# ------------------------------------------------------------------------------ dense


@pytest.mark.parametrize(("bits", "levels"), [(4, 7), (2, 1)])
def test_low_bit_rounds_each_value_to_its_block_level(bits: int, levels: int) -> None:
    x = torch.randn(3 * 512 + 100, generator=gen(bits))
    codec = LowBitCodec(bits, block_size=512)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert encoded.data.numel() == math.ceil(x.numel() * bits / 8)
    assert codec.describe() == {"kind": f"int{bits}", "block_size": 512}
    for b in range(4):
        block = slice(512 * b, 512 * (b + 1))
        scale = float(x[block].abs().max()) / levels
        assert float(encoded.scales[b]) == pytest.approx(scale)
        assert float((decoded[block] - x[block]).abs().max()) <= scale / 2 + 1e-6
        assert len(set((decoded[block] / scale).round().tolist())) <= 2 * levels + 1


def test_int2_is_ternary_and_a_zero_block_stays_zero() -> None:
    x = torch.cat([torch.zeros(64), torch.tensor([3.0, -3.0, 0.5] * 20)])
    decoded = LowBitCodec(2, block_size=64).decode(LowBitCodec(2, block_size=64).encode(x))
    assert torch.equal(decoded[:64], torch.zeros(64))
    assert set(decoded[64:].tolist()) == {3.0, -3.0, 0.0}


# ------------------------------------------------------------------------ bad bodies


def sparse_body(fields: list[list[int]], scales: list[float], numel: int) -> EncodedTensor:
    codec = SparseCodec(chunk=16, topk=2, bits=2)
    data = pack_fields(torch.tensor(fields), codec.width).reshape(-1)
    return EncodedTensor((numel,), data, torch.tensor(scales, dtype=torch.float32))


def test_a_well_formed_hand_made_sparse_body_decodes() -> None:
    # chunk 0: index 1 code 3, index 9 code 0; chunk 1 (4 values): index 0 code 2, index 3 code 1
    body = sparse_body([[1 | 3 << 4, 9], [0 | 2 << 4, 3 | 1 << 4]], [2.0, 1.0], numel=20)
    decoded = SparseCodec(chunk=16, topk=2, bits=2).decode(body)
    expected = torch.zeros(20)
    expected[[1, 9, 16, 19]] = torch.tensor([3.0, -3.0, 0.5, -0.5])
    assert torch.equal(decoded, expected)


@pytest.mark.parametrize(
    ("fields", "scales", "match"),
    [
        ([[9, 1], [0, 3]], [1.0, 1.0], "do not increase"),
        ([[1, 1], [0, 3]], [1.0, 1.0], "do not increase"),
        ([[1, 9], [0, 4]], [1.0, 1.0], "past its chunk of 4"),
        ([[1, 9], [0, 3]], [float("nan"), 1.0], "not finite"),
        ([[1, 9], [0, 3]], [1.0, float("inf")], "not finite"),
        ([[1, 9], [0, 3]], [-1.0, 1.0], "not finite"),
        ([[1, 9], [0, 3]], [MAX_SCALE * 2, 1.0], "not finite"),
        ([[1, 9], [0, 3]], [1.0], "expects 2 float32 scales"),
    ],
)
def test_a_malformed_sparse_body_is_refused(fields, scales, match) -> None:
    with pytest.raises(ValueError, match=match):
        SparseCodec(chunk=16, topk=2, bits=2).decode(sparse_body(fields, scales, numel=20))


def test_a_sparse_body_of_the_wrong_size_or_with_pad_bits_set_is_refused() -> None:
    codec = SparseCodec(chunk=16, topk=3, bits=2)  # 3 fields of 6 bits: 18 bits, 6 of pad
    good = codec.encode(torch.randn(32, generator=gen(4)))
    codec.decode(good)
    for data in (good.data[:-1], torch.cat([good.data, good.data[:1]])):
        with pytest.raises(ValueError, match="expects 6 bytes"):
            codec.decode(EncodedTensor(good.shape, data, good.scales))
    padded = good.data.clone()
    padded[2] |= 0x80
    with pytest.raises(ValueError, match="pad bits"):
        codec.decode(EncodedTensor(good.shape, padded, good.scales))


def test_a_low_bit_code_out_of_range_or_bits_past_the_end_are_refused() -> None:
    codec = LowBitCodec(4, block_size=8)
    good = codec.encode(torch.randn(5, generator=gen(5)))
    bad_code = good.data.clone()
    bad_code[0] = 0xF0 | (bad_code[0] & 0x0F)  # value 1 gets code 15: past 2L = 14
    with pytest.raises(ValueError, match="out of range"):
        codec.decode(EncodedTensor(good.shape, bad_code, good.scales))
    past_end = good.data.clone()
    past_end[2] |= 0x10  # the high half of the third byte: a sixth value of five
    with pytest.raises(ValueError, match="past the last value"):
        codec.decode(EncodedTensor(good.shape, past_end, good.scales))
    with pytest.raises(ValueError, match="not finite"):
        codec.decode(EncodedTensor(good.shape, good.data, torch.tensor([math.nan])))
    with pytest.raises(ValueError, match="expects 3 bytes"):
        codec.decode(EncodedTensor(good.shape, good.data[:2], good.scales))


@pytest.mark.parametrize("codec", [SparseCodec(), LowBitCodec(4), LowBitCodec(2)])
def test_a_non_finite_update_is_never_encoded(codec) -> None:
    x = torch.randn(100, generator=gen(6))
    x[7] = math.inf
    with pytest.raises(NonFiniteError):
        codec.encode(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SparseCodec(chunk=1),
        lambda: SparseCodec(topk=0),
        lambda: SparseCodec(chunk=64, topk=65),
        lambda: SparseCodec(bits=5),
        lambda: LowBitCodec(3),
        lambda: LowBitCodec(4, block_size=0),
    ],
)
def test_settings_out_of_range_are_refused(make) -> None:
    with pytest.raises(ValueError):
        make()
