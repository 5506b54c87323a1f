"""Round-trip tests for the pseudo-gradient codecs, with the error bound they promise."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.wire.codec import (
    EncodedTensor,
    Int8Codec,
    NoneCodec,
    NonFiniteError,
    codec_from_description,
    make_codec,
    relative_l2_error,
)


def _gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_int8_round_trip_of_gaussian_data_is_within_one_and_a_half_percent() -> None:
    # Prepare
    original = _gaussian(1_000_000) * 1e-3  # pseudo-gradients are small; scale must not matter
    codec = Int8Codec(block_size=4096)

    # Execute
    decoded = codec.decode(codec.encode(original))

    # Assert: error is ~1% for Gaussian blocks (step absmax/127, absmax ≈ 4.5σ)
    assert decoded.dtype == torch.float32
    assert relative_l2_error(original, decoded) <= 0.015


def test_relative_l2_error_matches_a_hand_computed_value() -> None:
    # Prepare
    original = torch.tensor([3.0, 4.0])
    decoded = torch.tensor([3.0, 3.0])

    # Execute
    err = relative_l2_error(original, decoded)

    # Assert: ‖(0, 1)‖ / ‖(3, 4)‖ = 1 / 5
    assert err == pytest.approx(0.2)


def test_all_zero_tensor_decodes_to_exact_zeros_without_nan() -> None:
    # Prepare
    codec = Int8Codec(block_size=8)
    original = torch.zeros(3, 7)

    # Execute
    encoded = codec.encode(original)
    decoded = codec.decode(encoded)

    # Assert
    assert torch.equal(encoded.scales, torch.zeros(codec.n_blocks(21)))
    assert torch.equal(decoded, original)


def test_an_all_zero_block_decodes_to_exact_zeros_beside_nonzero_blocks() -> None:
    # Prepare: block 1 of 3 is all zeros
    codec = Int8Codec(block_size=4)
    original = torch.tensor([1.0, -2.0, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 3.0, -1.0])

    # Execute
    encoded = codec.encode(original)
    decoded = codec.decode(encoded)

    # Assert
    assert encoded.scales[1].item() == 0.0
    assert torch.equal(decoded[4:8], torch.zeros(4))
    assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("blocks", [1, 3, 40])
def test_an_all_zero_blocks_scale_is_plus_zero_whatever_its_zeros_signs_and_neighbours(
    blocks: int,
) -> None:
    # Prepare: block 0 is all -0, block 1 (when there) -0 and +0 in turn, the rest random
    t = torch.randn(blocks * 64, generator=torch.Generator().manual_seed(0))
    t[:64] = -0.0
    t[64:128:2], t[65:128:2] = -0.0, 0.0

    # Execute
    e = Int8Codec(64).encode(t)

    # Assert: +0, not -0 (which decodes to -0 and adds to θ = -0 as -0, not +0)
    zero_blocks = 1 if blocks == 1 else 2
    assert not torch.signbit(e.scales[:zero_blocks]).any()
    assert not torch.signbit(Int8Codec(64).decode(e)[: 64 * zero_blocks]).any()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("codec", [Int8Codec(4), NoneCodec()], ids=["int8", "none"])
def test_non_finite_values_are_rejected_with_their_count(
    codec: Int8Codec | NoneCodec, bad: float
) -> None:
    # Prepare
    original = torch.ones(10)
    original[3] = bad
    original[7] = bad

    # Execute / Assert
    with pytest.raises(NonFiniteError, match="2 non-finite"):
        codec.encode(original)


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (4096,), (5, 1000), (3, 3, 3)], ids=str)
def test_shapes_are_preserved_including_scalars_empties_and_partial_last_blocks(
    shape: tuple[int, ...],
) -> None:
    # Prepare
    codec = Int8Codec(block_size=4096)
    original = _gaussian(*shape)
    numel = math.prod(shape)

    # Execute
    encoded = codec.encode(original)
    decoded = codec.decode(encoded)

    # Assert
    assert encoded.shape == shape and encoded.numel == numel
    assert encoded.data.shape == (numel,) and encoded.data.is_contiguous()
    assert encoded.scales.shape == (-(-numel // 4096),)
    assert decoded.shape == original.shape
    assert relative_l2_error(original, decoded) <= 0.015


def test_each_blocks_absmax_value_survives_the_round_trip() -> None:
    # Prepare: 5 blocks of 100, the last one short (numel not a multiple of the block)
    codec = Int8Codec(block_size=100)
    original = _gaussian(437)
    blocks = [original[i : i + 100] for i in range(0, 437, 100)]
    peak_index = [i * 100 + int(b.abs().argmax()) for i, b in enumerate(blocks)]

    # Execute
    encoded = codec.encode(original)
    decoded = codec.decode(encoded)

    # Assert: the peak quantizes to ±127 and decodes to itself (up to fp32 rounding)
    assert encoded.scales.numel() == 5
    assert encoded.data[peak_index].abs().tolist() == [127] * 5
    torch.testing.assert_close(decoded[peak_index], original[peak_index], rtol=1e-6, atol=0)


def test_int8_values_stay_within_the_symmetric_range() -> None:
    # Prepare: heavy tails and a lone outlier per block
    codec = Int8Codec(block_size=64)
    original = _gaussian(4000) ** 3
    original[::64] *= 1000

    # Execute
    encoded = codec.encode(original)

    # Assert
    assert encoded.data.dtype == torch.int8
    assert int(encoded.data.min()) >= -127 and int(encoded.data.max()) <= 127


def test_none_codec_round_trip_is_exact_and_does_not_alias_the_input() -> None:
    # Prepare
    codec = NoneCodec()
    original = _gaussian(3, 5)
    kept = original.clone()

    # Execute
    encoded = codec.encode(original)
    original.zero_()  # a later in-place update must not reach the encoded copy
    decoded = codec.decode(encoded)

    # Assert
    assert encoded.scales.numel() == 0 and encoded.nbytes == 15 * 4
    assert torch.equal(decoded, kept)


def test_int8_costs_one_byte_per_value_plus_four_per_block() -> None:
    # Prepare
    codec = Int8Codec(block_size=4096)
    numel = 100_000
    expected = numel * 1 + 4 * math.ceil(numel / 4096)

    # Execute
    encoded = codec.encode(_gaussian(numel))

    # Assert: ~3.97x smaller than fp32
    assert encoded.nbytes == expected
    assert encoded.nbytes / (4 * numel) < 0.26


def test_decode_rejects_scales_that_do_not_fit_the_block_size() -> None:
    # Prepare
    encoded = Int8Codec(block_size=4).encode(torch.ones(10))
    wrong = EncodedTensor(encoded.shape, encoded.data, encoded.scales[:2])

    # Execute / Assert
    with pytest.raises(ValueError, match="expects 3 scales"):
        Int8Codec(block_size=4).decode(wrong)


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_below_one_is_rejected(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        Int8Codec(block_size)


def test_codecs_are_rebuilt_from_their_description() -> None:
    # Prepare
    codecs = [make_codec("int8", block_size=256), make_codec("none")]

    # Execute
    rebuilt = [codec_from_description(c.describe()) for c in codecs]

    # Assert
    assert [c.describe() for c in rebuilt] == [
        {"kind": "int8", "block_size": 256},
        {"kind": "none"},
    ]


@pytest.mark.parametrize(
    ("description", "message"),
    [
        ({"kind": "fp8"}, "unknown codec kind 'fp8'; known kinds: int8, none"),
        ({"kind": "int8"}, "missing 'block_size'"),
        ({"kind": "int8", "block_size": 64, "x": 1}, r"unknown key\(s\): \['x'\]"),
        ({"kind": "int8", "block_size": True}, "block_size must be an integer"),
        ([], "must be a map"),
    ],
)
def test_bad_codec_descriptions_are_rejected_by_name(description: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        codec_from_description(description)
