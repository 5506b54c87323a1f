"""The contribution upload format: streaming round trips and every way a body is refused."""

from __future__ import annotations

import hashlib
import math
import pickle
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

from diloco.wire import header as wire_header
from diloco.wire.codec import EncodedTensor, Int8Codec, NoneCodec, NonFiniteError, make_codec
from diloco.wire.contribution import (
    MAGIC,
    ContributionDecoder,
    ContributionMeta,
    NonFiniteWireError,
    WireFormatError,
    contribution_nbytes,
    decode_contribution,
    encode_contribution,
)

BLOCK = 64
SHAPES = {"w": (37, 29), "b": (29,), "gain": (), "empty": (0,)}  # 1073 values: 17 blocks


def _contribution(kind: str = "int8") -> tuple[ContributionMeta, dict[str, EncodedTensor]]:
    codec = make_codec(kind, block_size=BLOCK)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: codec.encode(torch.randn(shape, generator=gen)) for name, shape in SHAPES.items()
    }
    meta = ContributionMeta(
        run_id="run-1", round=3, base_version=2, tokens=4096, inner_steps=50, loss=2.5,
        codec=codec.describe(),
    )  # fmt: skip
    return meta, tensors


def _body(kind: str = "int8") -> bytes:
    return b"".join(encode_contribution(*_contribution(kind)))


def _split(body: bytes) -> tuple[dict[str, Any], bytes]:
    """(header as a dict, frames) of a valid body, for forging variants of it."""
    (header_len,) = struct.unpack("<I", body[8:12])
    return msgpack.unpackb(body[12 : 12 + header_len]), body[12 + header_len : -32]


def _forge(header: dict[str, Any] | bytes, frames: bytes) -> bytes:
    """A body with a valid checksum around whatever header and frames a test wants."""
    raw = header if isinstance(header, bytes) else msgpack.packb(header)
    prefix = MAGIC + struct.pack("<I", len(raw)) + raw + frames
    return prefix + hashlib.sha256(prefix).digest()


def _assert_same(got: dict[str, EncodedTensor], sent: dict[str, EncodedTensor]) -> None:
    assert list(got) == list(sent)
    for name, t in sent.items():
        assert got[name].shape == t.shape
        assert torch.equal(got[name].data, t.data) and torch.equal(got[name].scales, t.scales)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("feed_size", [1, 7, 4096])
@pytest.mark.parametrize("kind", ["int8", "none"])
def test_round_trip_in_odd_sized_chunks_preserves_meta_and_tensors(
    kind: str, feed_size: int
) -> None:
    # Prepare
    meta, tensors = _contribution(kind)
    body = b"".join(encode_contribution(meta, tensors, chunk_size=1000))
    decoder = ContributionDecoder(SHAPES, codec=meta.codec, max_bytes=len(body))

    # Execute
    got: dict[str, EncodedTensor] = {}
    for i in range(0, len(body), feed_size):
        got.update(decoder.feed(body[i : i + feed_size]))
    decoder.finish()

    # Assert
    assert decoder.header is not None and decoder.header.meta == meta
    _assert_same(got, tensors)


@pytest.mark.parametrize("chunk_size", [1, 100, 1 << 20])
def test_chunks_respect_chunk_size_and_add_up_to_the_announced_size(chunk_size: int) -> None:
    # Prepare
    meta, tensors = _contribution()
    frames = sum(t.nbytes for t in tensors.values())

    # Execute
    chunks = list(encode_contribution(meta, tensors, chunk_size=chunk_size))

    # Assert
    assert max(len(c) for c in chunks) <= chunk_size
    assert sum(len(c) for c in chunks) == contribution_nbytes(meta, tensors)
    (header_len,) = struct.unpack("<I", b"".join(chunks)[8:12])
    assert contribution_nbytes(meta, tensors) == 8 + 4 + header_len + frames + 32


@pytest.mark.parametrize("kind", ["int8", "none"])
def test_the_specs_known_from_shapes_are_those_of_the_encoded_tensors(kind: str) -> None:
    # Prepare: what the server bounds an upload with, before anything is encoded
    meta, tensors = _contribution(kind)

    # Execute
    specs = wire_header.specs_for(make_codec(kind, block_size=BLOCK), SHAPES)

    # Assert
    assert specs == [wire_header.spec_of(name, t) for name, t in tensors.items()]
    header = len(wire_header.prefix_and_header(meta, specs))
    assert wire_header.body_bytes(header, specs) == contribution_nbytes(meta, tensors)


def test_decode_contribution_accepts_one_buffer() -> None:
    # Prepare
    meta, tensors = _contribution()

    # Execute
    got_meta, got = decode_contribution(b"".join(encode_contribution(meta, tensors)))

    # Assert
    assert got_meta == meta
    _assert_same(got, tensors)


def test_each_tensor_is_returned_as_soon_as_its_frames_arrive() -> None:
    # Prepare: cut the body right after the first tensor's scales
    meta, tensors = _contribution()
    body = b"".join(encode_contribution(meta, tensors))
    (header_len,) = struct.unpack("<I", body[8:12])
    end_of_w = 12 + header_len + tensors["w"].nbytes
    decoder = ContributionDecoder()

    # Execute
    first = decoder.feed(body[:end_of_w])
    rest = decoder.feed(body[end_of_w:])
    decoder.finish()

    # Assert: the empty tensor completes without bytes of its own, in header order
    assert [name for name, _ in first] == ["w"]
    assert [name for name, _ in rest] == ["b", "gain", "empty"]


# ---------------------------------------------------------------- truncation and corruption


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (lambda hl: 10, r"inside the prefix \(magic and header length\): got 10 of 12"),
        (lambda hl: 12 + hl // 2, "inside the header"),
        (lambda hl: 12 + hl + 5, "inside tensor 'w' data: got 5 of 1073"),
        (lambda hl: 12 + hl + 1073 + 3, "inside tensor 'w' scales: got 3 of 68"),
        (lambda hl: -5, "inside the sha256 trailer: got 27 of 32"),
    ],
    ids=["header-length", "header", "tensor-data", "tensor-scales", "trailer"],
)
def test_truncated_body_says_what_was_cut_short(where: Callable[[int], int], message: str) -> None:
    # Prepare
    body = _body()
    (header_len,) = struct.unpack("<I", body[8:12])
    decoder = ContributionDecoder()
    decoder.feed(body[: where(header_len)])

    # Execute / Assert
    with pytest.raises(WireFormatError, match=f"truncated {message}"):
        decoder.finish()


def _nudged(body: bytes) -> bytes:
    """``body`` with one int8 value nudged, staying inside [-127, 127]; its trailer kept."""
    out = bytearray(body)
    (header_len,) = struct.unpack("<I", out[8:12])
    at = 12 + header_len + 100
    value = struct.unpack("b", out[at : at + 1])[0]
    out[at : at + 1] = struct.pack("b", value - 1 if value > 0 else value + 1)
    return bytes(out)


def test_a_changed_byte_in_a_data_frame_fails_the_checksum() -> None:
    with pytest.raises(WireFormatError, match="checksum mismatch"):
        decode_contribution(_nudged(_body()))


def _decode_later(body: bytes, piece: int) -> ContributionDecoder:
    """``body`` fed in pieces to a ``digest_later`` decoder, each piece's digest work taken
    as it is fed and run afterwards, in order (as a server's hashing threads do)."""
    decoder = ContributionDecoder(SHAPES, codec=_contribution()[0].codec, digest_later=True)
    works = []
    for at in range(0, len(body), piece):
        decoder.feed(body[at : at + piece])
        works.append(decoder.digest_work())
    for work in works:
        decoder.digest(work)
    return decoder


@pytest.mark.parametrize("piece", [1, 100, 1 << 20])
def test_a_body_hashed_later_has_the_same_digest_and_its_trailer_checked_by_finish(
    piece: int,
) -> None:
    body = _body()

    decoder = _decode_later(body, piece)
    decoder.finish()

    assert decoder.body_sha256 == hashlib.sha256(body).hexdigest()


def test_a_changed_byte_hashed_later_fails_the_checksum_at_finish() -> None:
    decoder = _decode_later(_nudged(_body()), 4096)  # every byte fed: the trailer waits
    with pytest.raises(WireFormatError, match="checksum mismatch"):
        decoder.finish()
    assert decoder.body_sha256 is None
    with pytest.raises(WireFormatError, match="already rejected"):
        decoder.finish()


def test_wrong_magic_is_rejected_from_the_first_byte() -> None:
    # Prepare
    decoder = ContributionDecoder()

    # Execute / Assert
    with pytest.raises(WireFormatError, match="not the magic b'DILOCO-C'"):
        decoder.feed(b"{")
    with pytest.raises(WireFormatError, match="already rejected"):
        decoder.feed(b"DILOCO-C")


def test_bytes_after_the_trailer_are_rejected() -> None:
    with pytest.raises(WireFormatError, match="3 unexpected byte"):
        decode_contribution([_body(), b"abc"])


# ---------------------------------------------------------------- header validation


def _forged(edit: Callable[[dict[str, Any]], object]) -> bytes:
    header, frames = _split(_body())
    edit(header)
    return _forge(header, frames)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.update(format_version=2), r"unsupported format_version 2.*supports \[1\]"),
        (lambda h: h.pop("tokens"), "header is missing the key 'tokens'"),
        (lambda h: h.update(round="3"), "header key 'round' must be int, got str"),
        (lambda h: h.update(tokens=0), r"'tokens' must be 1\.\.9007199254740992, got 0"),
        (lambda h: h.update(tokens=(1 << 53) + 1), r"'tokens' must be 1\.\.9007199254740992"),
        (lambda h: h.update(tokens=(1 << 64) - 1), r"'tokens' must be 1\.\.9007199254740992"),
        (lambda h: h.update(inner_steps=1 << 31), r"'inner_steps' must be 1\.\.2147483647"),
        (lambda h: h.update(round=1 << 31), r"'round' must be 0\.\.2147483647"),
        (lambda h: h.update(base_version=-1), r"'base_version' must be 0\.\.2147483647"),
        (lambda h: h.update(loss=math.nan), "'loss' must be finite"),
        (lambda h: h.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda h: h["tensors"][0].pop("shape"), r"tensors\[0\] is missing the key 'shape'"),
        (lambda h: h["tensors"][0].update(dtype="float32"), "dtype float32 but codec 'int8'"),
        (lambda h: h["tensors"][0].update(n_scales=18), "declares 18 scales .* needs 17"),
        (lambda h: h["tensors"][1].update(name="w"), r"more than once: \['w'\]"),
        (lambda h: h.update(codec={"kind": "fp8"}), "header key 'codec' is invalid"),
    ],
    ids=[
        "future-version", "missing-key", "wrong-type", "no-tokens", "tokens-past-2^53",
        "tokens-uint64", "inner-steps-past-int32", "round-past-int32", "negative-base",
        "nan-loss", "unknown-key",
        "tensor-missing-key", "dtype-vs-codec", "n-scales-vs-codec", "duplicate-name",
        "unknown-codec",
    ],
)  # fmt: skip
def test_bad_headers_are_rejected_naming_the_problem(
    edit: Callable[[dict[str, Any]], object], message: str
) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode_contribution(_forged(edit))


def test_malformed_msgpack_header_is_rejected() -> None:
    # Prepare: 0xc1 is the one byte msgpack never uses
    body = _forge(b"\xc1\x00\x00", b"")

    # Execute / Assert
    with pytest.raises(WireFormatError, match="header is not valid msgpack"):
        decode_contribution(body)


def test_names_that_do_not_match_the_model_are_listed() -> None:
    # Prepare
    expected = {**{k: v for k, v in SHAPES.items() if k != "gain"}, "scale": ()}

    # Execute / Assert
    with pytest.raises(WireFormatError, match=r"missing \['scale'\], unexpected \['gain'\]"):
        decode_contribution(_body(), expected)


def test_a_shape_mismatch_names_the_tensor_and_both_shapes() -> None:
    # Prepare
    expected = {**SHAPES, "w": (29, 37)}

    # Execute / Assert
    with pytest.raises(WireFormatError, match=r"'w' has shape \[37, 29\], expected \[29, 37\]"):
        decode_contribution(_body(), expected)


def test_an_upload_with_another_codec_is_rejected() -> None:
    with pytest.raises(WireFormatError, match="but this run expects"):
        decode_contribution(_body(), codec=Int8Codec(block_size=4096).describe())


# ---------------------------------------------------------------- frame values and limits


def test_nan_in_a_float32_frame_is_rejected_naming_the_tensor() -> None:
    # Prepare: overwrite the 4th value of "w" and re-seal the checksum
    header, frames = _split(_body("none"))
    frames = frames[:12] + struct.pack("<f", math.nan) + frames[16:]

    # Execute / Assert
    with pytest.raises(NonFiniteWireError, match="tensor 'w' has 1 non-finite") as info:
        decode_contribution(_forge(header, frames))
    assert isinstance(info.value, WireFormatError) and isinstance(info.value, NonFiniteError)


def test_an_infinite_scale_is_rejected() -> None:
    # Prepare: the first scale of "w" follows its 1073 int8 values
    header, frames = _split(_body("int8"))
    frames = frames[:1073] + struct.pack("<f", math.inf) + frames[1077:]

    # Execute / Assert
    with pytest.raises(NonFiniteWireError, match=r"'w' has 1 non-finite value.* in its scales"):
        decode_contribution(_forge(header, frames))


def test_a_body_declaring_more_than_max_bytes_is_refused_before_its_frames() -> None:
    # Prepare
    body = _body()
    (header_len,) = struct.unpack("<I", body[8:12])
    decoder = ContributionDecoder(max_bytes=len(body) - 1)

    # Execute / Assert: refused as soon as the header is in, before any tensor memory
    with pytest.raises(WireFormatError, match=f"declares {len(body)} bytes, over the"):
        decoder.feed(body[: 12 + header_len])


def test_a_stream_longer_than_max_bytes_is_cut_off() -> None:
    with pytest.raises(WireFormatError, match="over the 100-byte limit"):
        decode_contribution(_body(), max_bytes=100)


def test_encoder_refuses_tensors_its_codec_could_not_have_produced() -> None:
    # Prepare: int8 tensors under a meta that claims the "none" codec
    meta, tensors = _contribution("int8")
    meta = ContributionMeta(**{**meta.__dict__, "codec": NoneCodec().describe()})

    # Execute / Assert: at call time, not on the first chunk
    with pytest.raises(WireFormatError, match="dtype int8 but codec 'none'"):
        encode_contribution(meta, tensors)


# ---------------------------------------------------------------- never pickle


def test_decoding_never_unpickles_nor_lets_msgpack_build_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: make any pickle use fail loudly, and record how msgpack is called
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    calls: list[dict[str, Any]] = []
    real_unpackb = msgpack.unpackb

    def spy(packed: bytes, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_unpackb(packed, **kwargs)

    monkeypatch.setattr(wire_header.msgpack, "unpackb", spy)
    meta, tensors = _contribution()

    # Execute
    got_meta, _ = decode_contribution(b"".join(encode_contribution(meta, tensors)))

    # Assert
    assert got_meta == meta
    assert calls and all(c.get("strict_map_key") and c.get("raw") is False for c in calls)
    hooks = {"ext_hook", "object_hook", "object_pairs_hook", "list_hook"}
    assert not any(hooks & set(c) for c in calls)


def test_an_ext_type_in_the_header_stays_inert_and_is_rejected() -> None:
    # Prepare
    body = _forged(lambda h: h.update(run_id=msgpack.ExtType(42, b"os.system")))

    # Execute / Assert
    with pytest.raises(WireFormatError, match="'run_id' must be str, got ExtType"):
        decode_contribution(body)
