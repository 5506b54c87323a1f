"""Checked uploads and robust aggregation (diloco.outer.robust; its in-memory aggregate is the
reference the close's chunked pass is held to), and diloco.simulate.attacks: small synthetic Δs
through the real codec and wire format, expected values computed by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.config import AggregationSection
from diloco.outer.inspection import UploadInspector
from diloco.outer.robust import (
    Source,
    SourceUnreadable,
    reference_norm,
    robust_aggregate,
)
from diloco.simulate.attacks import hostile_body
from diloco.wire.codec import make_codec
from diloco.wire.contribution import (
    ContributionMeta,
    NonFiniteWireError,
    decode_contribution,
    encode_contribution,
)

SHAPES = {"a": (64,), "b": (8, 8)}
KIND, BLOCK = "none", 16  # fp32: the hand computations below are exact to float rounding
CODEC = {"kind": "none"}


def delta(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * scale for n, s in SHAPES.items()}


def body(d: dict[str, torch.Tensor], tokens: int = 100, kind: str = KIND) -> bytes:
    codec_ = make_codec(kind, BLOCK)  # blocks below a run's minimum: exact by hand
    encoded = {n: codec_.encode(t) for n, t in d.items()}
    codec = codec_.describe()
    meta = ContributionMeta("run_x", 1, 0, tokens, 5, 2.0, codec)
    return b"".join(encode_contribution(meta, encoded))


def norm(d: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in d.values()))


def source(i: str, d: dict[str, torch.Tensor], weight: float = 100.0) -> Source:
    b = body(d)
    return Source(i, weight, norm(d), lambda: [b])


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- inspection


def inspect(raw: bytes, codec: dict = CODEC) -> UploadInspector:
    _, encoded = decode_contribution(raw, SHAPES, codec=codec)
    inspector = UploadInspector(codec)
    for name, tensor in encoded.items():
        inspector.add(name, tensor)
    return inspector


def test_the_inspector_measures_the_decoded_norm_and_digests_the_payload_not_the_header():
    d = delta(1)
    again = body(d, tokens=999)  # same tensors, another header

    first, second = inspect(body(d)), inspect(again)

    assert first.norm == pytest.approx(norm(d), rel=1e-9)
    assert first.payload_sha256 == second.payload_sha256
    assert inspect(body(delta(2))).payload_sha256 != first.payload_sha256


def test_finite_but_huge_int8_scales_are_refused_once_decoded():
    raw = hostile_body(
        "huge_scales",
        delta(1),
        ContributionMeta("run_x", 1, 0, 100, 5, 2.0, {}),
        kind="int8",
        block_size=BLOCK,
    )
    codec = {"kind": "int8", "block_size": BLOCK}
    _, encoded = decode_contribution(raw, SHAPES, codec=codec)  # every frame passes the wire
    inspector = UploadInspector(codec)

    with pytest.raises(NonFiniteWireError, match="decodes to non-finite values"):
        for name, tensor in encoded.items():
            inspector.add(name, tensor)


# ---------------------------------------------------------------- aggregation

MEAN = AggregationSection(method="mean")
CLIPPED = AggregationSection(method="clipped_mean", clip_multiple=2.0, reference_min=3)


def test_mean_is_the_token_weighted_mean():
    d1, d2 = delta(1), delta(2)

    agg = robust_aggregate(
        [source("1", d1, 100), source("2", d2, 300)], shapes=SHAPES, codec=CODEC, policy=MEAN
    )

    close(agg.delta, {n: (100 * d1[n] + 300 * d2[n]) / 400 for n in SHAPES})
    assert agg.reference_norm is None and {s.clip for s in agg.shares.values()} == {1.0}


def test_clipped_mean_bounds_a_long_contribution_to_a_multiple_of_the_median_norm():
    honest = [delta(i) for i in range(3)]
    long = {n: t * 100 for n, t in delta(9).items()}
    sources = [source(str(i), d) for i, d in enumerate(honest)] + [source("x", long)]
    median = sorted(norm(d) for d in [*honest, long])[1:3]

    agg = robust_aggregate(sources, shapes=SHAPES, codec=CODEC, policy=CLIPPED)

    r = (median[0] + median[1]) / 2  # the median of four norms
    c = 2.0 * r / norm(long)
    assert agg.reference_norm == pytest.approx(r)
    assert agg.shares["x"].clip == pytest.approx(c)
    assert all(agg.shares[str(i)].clip == 1.0 for i in range(3))
    close(agg.delta, {n: (sum(d[n] for d in honest) + c * long[n]) / 4 for n in SHAPES})
    assert norm(agg.delta) < 1.5 * max(norm(d) for d in honest)


def test_a_round_with_few_contributions_takes_its_reference_from_the_runs_history():
    long = delta(1, scale=10.0)

    with_history = robust_aggregate(
        [source("x", long)], shapes=SHAPES, codec=CODEC, policy=CLIPPED, history=[8.0, 8.0, 8.0]
    )
    without = robust_aggregate([source("x", long)], shapes=SHAPES, codec=CODEC, policy=CLIPPED)

    assert with_history.reference_norm == 8.0
    assert norm(with_history.delta) == pytest.approx(16.0, rel=1e-5)
    assert without.reference_norm is None and norm(without.delta) == pytest.approx(norm(long))
    assert reference_norm([1.0], [], CLIPPED) is None
    assert reference_norm([1.0, 2.0, 9.0], [100.0], CLIPPED) == 2.0  # enough of its own


def test_centered_clip_pulls_an_outlier_direction_towards_the_others():
    honest = [delta(1), {n: t * 1.1 for n, t in delta(1).items()}, delta(2)]
    flipped = {n: -t for n, t in delta(1).items()}
    sources = [source(str(i), d) for i, d in enumerate([*honest, flipped])]
    policy = AggregationSection(method="centered_clip", clip_multiple=2.0, reference_min=3)

    cclip = robust_aggregate(sources, shapes=SHAPES, codec=CODEC, policy=policy)
    clipped = robust_aggregate(sources, shapes=SHAPES, codec=CODEC, policy=CLIPPED)

    # by hand: v the clipped mean (nothing is clipped here), τ the median distance, one step
    v = clipped.delta
    dist = {s.id: clipped.shares[s.id].distance for s in sources}
    tau = sorted(dist.values())[1:3]
    tau_m = (tau[0] + tau[1]) / 2
    pull = {i: min(1.0, tau_m / dist[i]) for i in dist}
    deltas = dict(zip((s.id for s in sources), [*honest, flipped], strict=True))
    expected = {
        n: v[n] + sum(pull[i] * (d[n] - v[n]) for i, d in deltas.items()) / 4 for n in SHAPES
    }
    close(cclip.delta, expected)
    assert cclip.shares["3"].clip < 1.0 and cclip.shares["3"].cosine < 0
    assert norm(cclip.delta) > norm(clipped.delta)  # the flip pulls less against the others


def test_an_unreadable_source_is_named_by_its_id():
    good = source("ok", delta(1))
    damaged_bytes = bytearray(body(delta(2)))
    damaged_bytes[-1] ^= 0xFF  # the trailer digest
    damaged = Source("bad", 100.0, 1.0, lambda: [bytes(damaged_bytes)])

    def missing() -> list[bytes]:
        raise FileNotFoundError(2, "No such file or directory")

    with pytest.raises(SourceUnreadable) as bad:
        robust_aggregate([good, damaged], shapes=SHAPES, codec=CODEC, policy=MEAN)
    with pytest.raises(SourceUnreadable, match="cannot be read: No such file") as gone:
        robust_aggregate(
            [good, Source("gone", 1.0, 1.0, missing)], shapes=SHAPES, codec=CODEC, policy=MEAN
        )

    assert bad.value.source_id == "bad" and "damaged" in bad.value.reason
    assert gone.value.source_id == "gone"
