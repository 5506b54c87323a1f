"""The close's one-pass aggregate and step (``diloco.outer.chunked``) and the files it writes
piece by piece (``diloco.wire.tensorfile``), on real files, against whole-tensor references."""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco.checkpoint import (
    RESIDUAL_PREFIX,
    open_outer_state,
    params_entries,
    params_metadata,
    state_entries,
    state_metadata,
    write_params,
)
from diloco.config import AggregationSection, CompressionSection
from diloco.outer import chunked as outer_pass
from diloco.outer.chunked import Hyper, Outputs, Step, run_pass
from diloco.outer.exact import Terms
from diloco.outer.inspection import UploadInspector
from diloco.outer.robust import Source, SourceUnreadable, robust_aggregate
from diloco.outer.upload_file import UploadFile
from diloco.wire import delta as deltas
from diloco.wire.codec import Int8Codec
from diloco.wire.contribution import ContributionMeta, WireFormatError, encode_contribution
from diloco.wire.exchange import encode_delta
from diloco.wire.lowbit import LowBitCodec, SparseCodec
from diloco.wire.tensorfile import Entry, TensorFileError, TensorFileReader, TensorFileWriter
from tests.support.contribute import Reference, outer_reference, read_outer_state

BLOCK = 64
SHAPES = {"w": (33, 10), "b": (7,), "e": (3, 128)}  # blocks cut inside, short, whole
CODEC = {"kind": "int8", "block_size": BLOCK}
HYPER = Hyper(0.7, 0.9, True)


def upload_body(seed: int, order: list[str] | None = None) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    drawn = {n: torch.randn(s, generator=gen) * (1 + seed) for n, s in SHAPES.items()}
    delta = {n: drawn[n] for n in order or SHAPES}  # the same values, in the body's order
    encoded, codec, _ = encode_delta(delta, CompressionSection(kind="int8", block_size=BLOCK))
    meta = ContributionMeta("run_t", 1, 0, 100, 1, 3.0, codec)
    return b"".join(encode_contribution(meta, encoded))


def base_version(
    folder: Path, *, momentum: bool
) -> tuple[dict[str, torch.Tensor], Reference | None]:
    """θ (and, with ``momentum``, a state with momentum and residual) written as a close
    would find them."""
    gen = torch.Generator().manual_seed(99)
    theta = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    write_params(folder / "base.safetensors", theta, version=0)
    names = list(SHAPES)
    meta = state_metadata(version=0, names=names, hparams={}, metadata={})
    if not momentum:
        meta["outer_momentum"] = "false"
        with TensorFileWriter(folder / "base.state", [], meta, digest=False) as w:
            w.commit()
        return theta, None
    state = Reference(
        {},
        {n: torch.randn(s, generator=gen) * 0.1 for n, s in SHAPES.items()},
        {n: torch.randn(s, generator=gen) * 1e-3 for n, s in SHAPES.items()},
    )
    with TensorFileWriter(folder / "base.state", state_entries(SHAPES), meta) as w:
        for n in names:
            w.write("outer.momentum." + n, 0, state.momentum[n].reshape(-1))
            w.write(RESIDUAL_PREFIX + n, 0, state.residual[n].reshape(-1))
        w.commit()
    return theta, state


# the published delta's codecs: whole pieces of each land at their offsets
DELTA_CODECS = {
    "int8": Int8Codec(BLOCK),
    "int4": LowBitCodec(4, BLOCK),
    "int2": LowBitCodec(2, BLOCK),
    "sparse": SparseCodec(chunk=BLOCK, topk=8, bits=2),
}


def close(  # type: ignore[no-untyped-def]
    folder: Path,
    bodies: list[bytes],
    coefficients: list[float],
    hasher=None,
    codec: deltas.DeltaCodec = DELTA_CODECS["int8"],
):
    paths = []
    for i, body in enumerate(bodies):
        paths.append(folder / f"u{i}.bin")
        paths[-1].write_bytes(body)
    names = list(SHAPES)
    out = Outputs(
        TensorFileWriter(
            folder / "new.safetensors",
            params_entries(SHAPES),
            params_metadata(version=1, names=names),
            hasher=hasher,
        ),
        TensorFileWriter(folder / "new.state", state_entries(SHAPES), {}, digest=False),
        TensorFileWriter(
            folder / "new.delta",
            deltas.entries(SHAPES, codec),
            deltas.metadata(run_id="run_t", version=1, base_version=0, names=names, codec=codec),
        ),
    )
    uploads = [UploadFile(str(i), p, SHAPES, CODEC, hasher) for i, p in enumerate(paths)]
    terms = Terms.of(
        coefficients, [norm_of(b, damaged=1.0) for b in bodies], math.fsum(coefficients)
    )
    step = Step(
        HYPER,
        TensorFileReader(folder / "base.safetensors"),
        open_outer_state(folder / "base.state"),
        codec,
        out,
    )
    align = math.lcm(deltas.alignment(codec), BLOCK)
    result = run_pass(uploads, terms, SHAPES, align=align, step=step)
    if not result.finite:  # as the close does: a step that is not finite is not published
        out.abort()
        return result, None, None
    out.params.settle()
    sha, delta_sha = out.commit_delta()
    assert out.commit_rest() == sha
    return result, sha, delta_sha


@pytest.mark.parametrize("delta", list(DELTA_CODECS))
@pytest.mark.parametrize("momentum", [False, True], ids=["first step", "later step"])
def test_the_pass_publishes_exactly_the_whole_tensor_step(tmp_path, momentum, delta, monkeypatch):
    # Prepare: a base version, three uploads, the plain mean; the pass cut in pieces of a
    # block, so that every tensor but the short one is published piece by piece
    theta, state = base_version(tmp_path, momentum=momentum)
    bodies = [upload_body(seed) for seed in range(3)]
    coefficients = [0.5, 0.3, 0.2]
    monkeypatch.setattr(outer_pass, "CHUNK_ELEMENTS", BLOCK)

    # Execute
    result, sha, delta_sha = close(tmp_path, bodies, coefficients, codec=DELTA_CODECS[delta])

    # Assert: the files hold the reference step, bit for bit
    sources = [
        Source(str(i), w, norm_of(b), lambda b=b: [b])
        for i, (b, w) in enumerate(zip(bodies, coefficients, strict=True))
    ]
    mean = robust_aggregate(
        sources, shapes=SHAPES, codec=CODEC, policy=AggregationSection(method="mean")
    )
    want = outer_reference(
        theta, mean.delta, hyper=(HYPER.lr, HYPER.momentum, HYPER.nesterov),
        codec=DELTA_CODECS[delta], state=state,
    )  # fmt: skip
    params = load_file(tmp_path / "new.safetensors")
    got_state = read_outer_state(tmp_path / "new.state")
    for n in SHAPES:
        assert torch.equal(params[n], want.params[n]), n
        assert torch.equal(got_state.momentum[n], want.momentum[n]), n
        assert torch.equal(got_state.residual[n], want.residual[n]), n
    assert sha == hashlib.sha256((tmp_path / "new.safetensors").read_bytes()).hexdigest()
    assert delta_sha == hashlib.sha256((tmp_path / "new.delta").read_bytes()).hexdigest()
    # the delta applied to θ gives the published parameters, bit for bit
    rebuilt = {n: t.clone() for n, t in theta.items()}
    deltas.apply_delta(rebuilt, deltas.read_delta(tmp_path / "new.delta", SHAPES))
    assert all(torch.equal(rebuilt[n], params[n]) for n in SHAPES)
    # the dot products with the sum, for the cosines
    for i, s in enumerate(sources):
        assert result.dots[s.id] == pytest.approx(_dot(bodies[i], mean.delta), rel=1e-5)
    assert result.finite and result.change_sq > 0


def _decoded(body: bytes) -> dict[str, torch.Tensor]:
    from diloco.wire.codec import codec_from_description
    from diloco.wire.contribution import decode_contribution

    _, encoded = decode_contribution(body, SHAPES, codec=CODEC)
    decode = codec_from_description(CODEC).decode
    return {n: decode(e) for n, e in encoded.items()}


def _dot(body: bytes, v: dict[str, torch.Tensor]) -> float:
    return sum(
        float(torch.dot(x.reshape(-1).double(), v[n].reshape(-1).double()))
        for n, x in _decoded(body).items()
    )


def norm_of(body: bytes, *, damaged: float | None = None) -> float:
    """‖Δ‖ of an upload, as the inspector measures it at ingest; ``damaged`` for a body that
    does not decode (the pass refuses it, whatever its norm)."""
    try:
        return math.sqrt(_dot(body, _decoded(body)))
    except WireFormatError:
        if damaged is None:
            raise
        return damaged


@pytest.mark.parametrize("delta", list(DELTA_CODECS))
def test_the_chunk_size_and_a_hashing_thread_change_no_byte(tmp_path, monkeypatch, delta):
    bodies = [upload_body(seed) for seed in range(2)]
    outs = []
    for chunk, threaded in ((BLOCK, False), (1 << 20, True)):
        folder = tmp_path / f"{chunk}"
        folder.mkdir()
        base_version(folder, momentum=True)
        monkeypatch.setattr(outer_pass, "CHUNK_ELEMENTS", chunk)
        with ThreadPoolExecutor(1) as hasher:
            _, sha, delta_sha = close(
                folder, bodies, [0.5, 0.5], hasher if threaded else None, DELTA_CODECS[delta]
            )
        outs.append((sha, delta_sha, (folder / "new.state").read_bytes()))
    assert outs[0] == outs[1]


def test_an_upload_with_its_tensors_in_another_order_is_summed_and_verified_alike(tmp_path):
    base_version(tmp_path, momentum=False)
    ordered = tmp_path / "a"
    ordered.mkdir()
    base_version(ordered, momentum=False)
    reversed_body = upload_body(0, order=list(reversed(SHAPES)))
    _, sha_reversed, _ = close(tmp_path, [upload_body(1), reversed_body], [0.5, 0.5])
    _, sha_ordered, _ = close(ordered, [upload_body(1), upload_body(0)], [0.5, 0.5])
    assert sha_reversed == sha_ordered


def test_the_pass_publishes_the_same_bytes_whatever_the_uploads_order(tmp_path):
    # the sum is exact (diloco.outer.exact): uploads of very different sizes and weights,
    # added in every order, give one version, bit for bit
    bodies = [upload_body(seed) for seed in range(3)]
    bodies.append(upload_body(7))  # 8x the first one's values
    weights = [0.1, 3.0, 0.7, 1.3]
    seen = set()
    for k, order in enumerate(([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1])):
        folder = tmp_path / str(k)
        folder.mkdir()
        base_version(folder, momentum=True)
        _, sha, delta_sha = close(folder, [bodies[i] for i in order], [weights[i] for i in order])
        seen.add((sha, delta_sha, (folder / "new.state").read_bytes()))
    assert len(seen) == 1


@pytest.mark.parametrize("damage", ["trailer", "data", "truncated", "missing"])
def test_a_stored_upload_damaged_on_disk_is_refused_by_name(tmp_path, damage):
    base_version(tmp_path, momentum=False)
    bad = bytearray(upload_body(1))
    if damage == "trailer":
        bad[-1] ^= 1
    elif damage == "data":
        bad[len(bad) // 2] ^= 1
    elif damage == "truncated":
        del bad[-100:]
    with pytest.raises(SourceUnreadable) as err:
        if damage == "missing":
            UploadFile("gone", tmp_path / "absent.bin", SHAPES, CODEC)
        else:
            close(tmp_path, [upload_body(0), bytes(bad)], [0.5, 0.5])
    assert err.value.source_id == ("gone" if damage == "missing" else "1")
    assert ("cannot be read" if damage == "missing" else "damaged") in err.value.reason
    assert not (tmp_path / "new.safetensors").exists()  # nothing published


def test_a_non_finite_step_is_reported_and_writes_nothing(tmp_path):
    base_version(tmp_path, momentum=False)

    result, sha, _ = close(tmp_path, [upload_body(0)], [float("inf")])

    assert not result.finite and sha is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base.safetensors",
        "base.state",
        "u0.bin",
    ]


def test_the_tensor_file_writer_takes_pieces_in_any_order(tmp_path):
    entries = [
        Entry("a", torch.float32, (5, 3)),
        Entry("q", torch.int8, (7,)),
        Entry("z", torch.float32, (4,)),
    ]
    a, q, z = torch.randn(15), torch.randint(-127, 127, (7,), dtype=torch.int8), torch.randn(4)
    with TensorFileWriter(tmp_path / "f.safetensors", entries, {"k": "v"}) as w:
        w.write("z", 2, z[2:])
        w.write("q", 0, q)
        w.write("a", 6, a[6:])
        w.write("a", 0, a[:6])
        w.write("z", 0, z[:2])
        sha = w.commit()
    loaded = load_file(tmp_path / "f.safetensors")
    assert torch.equal(loaded["a"], a.view(5, 3)) and torch.equal(loaded["q"], q)
    assert torch.equal(loaded["z"], z)
    assert sha == hashlib.sha256((tmp_path / "f.safetensors").read_bytes()).hexdigest()
    with TensorFileReader(tmp_path / "f.safetensors") as r:
        assert r.metadata == {"k": "v"} and torch.equal(r.tensor("a"), a.view(5, 3))
        with pytest.raises(ValueError):
            r.read_into("a", 14, torch.empty(2))  # past the end
    raw = (tmp_path / "f.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(raw[:-1])
    with pytest.raises(TensorFileError, match="truncated"):
        TensorFileReader(tmp_path / "short.safetensors")


def test_a_digest_only_writer_takes_the_sha256_of_the_file_and_writes_nothing(tmp_path):
    entries = [Entry("a", torch.float32, (6,)), Entry("b", torch.float32, (3,))]
    a, b = torch.randn(6), torch.randn(3)
    with TensorFileWriter(tmp_path / "stored", entries, {"k": "v"}) as w:
        for name, t in (("a", a), ("b", b)):
            w.write(name, 0, t)
        want = w.commit()

    digest = TensorFileWriter(tmp_path / "digest", entries, {"k": "v"}, store=False)
    digest.write("a", 0, a[:4])
    digest.write("a", 4, a[4:])
    digest.write("b", 0, b)
    assert digest.commit() == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stored"]  # no file, no temp

    out_of_order = TensorFileWriter(tmp_path / "digest", entries, {}, store=False)
    with pytest.raises(ValueError, match="in order"):
        out_of_order.write("b", 0, b)  # its bytes come after a's, which are not hashed yet
    out_of_order.abort()
    with pytest.raises(ValueError, match="must take the digest"):
        TensorFileWriter(tmp_path / "x", entries, {}, store=False, digest=False)


def test_an_aborted_writer_leaves_nothing(tmp_path):
    w = TensorFileWriter(tmp_path / "f.safetensors", [Entry("a", torch.float32, (4,))], {})
    w.write("a", 0, torch.ones(4))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_the_inspectors_norm_is_what_the_pass_clips_by(tmp_path):
    # the pass's coefficients come from the norm measured at ingest: the same Δ
    body = upload_body(3)
    from diloco.wire.contribution import decode_contribution

    _, encoded = decode_contribution(body, SHAPES, codec=CODEC)
    inspector = UploadInspector(CODEC)
    for n, e in encoded.items():
        inspector.add(n, e)
    base_version(tmp_path, momentum=False)
    result, _, _ = close(tmp_path, [body], [1.0])
    assert result.g_sq == pytest.approx(inspector.norm**2, rel=1e-5)
