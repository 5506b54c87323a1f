"""A round summed as its uploads arrive (``diloco.outer.fold``) publishes the very bits of a
close that reads every upload again: whatever order they were folded in, whichever of them
the close leaves out, and whatever state a crash left the running sum in."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from diloco.model.architectures import build_model
from diloco.outer.attempt import open_base
from diloco.outer.close import Closed, CloseInputs, Folding, Upload, VersionPaths, close_round
from diloco.outer.fold import Arrival, FoldPlan, FoldState, folded_ids
from diloco.outer.robust import SourceUnreadable
from diloco.simulate.server import Standings, open_round
from diloco.simulate.versions import Versions
from diloco.train import load_parameters_file, load_version_files, parameters_of
from server.rounds.fold_sums import Folds
from server.rounds.folding import FoldProcess
from tests.test_one_close import RUN, body, config, honest_deltas, initial_params

HISTORY = [0.9, 1.0, 1.1]  # norms of the run's last aggregated uploads (≈ the honest ones)


@pytest.fixture
def round_(tmp_path):
    """Round 2 of a clipped-mean run: five honest uploads of norm ≈ 1, one of them twice as
    long (clipped to the history's median), and a zero upload the checks leave out."""
    cfg = config()
    params = initial_params(cfg)
    versions = Versions(cfg, params, run_id=RUN)
    standings = Standings()
    deltas = honest_deltas(params, 5, seed=7)
    scale = 1.0 / float(torch.cat([t.reshape(-1) for t in deltas[0].values()]).norm())
    deltas = [{k: t * scale for k, t in d.items()} for d in deltas]
    deltas[3] = {k: 2 * t for k, t in deltas[3].items()}
    deltas.append({k: torch.zeros_like(t) for k, t in deltas[0].items()})
    uploads = []
    for i, delta in enumerate(deltas):
        chunks = body(cfg, delta, 2)
        path = tmp_path / f"u{i}.bin"
        path.write_bytes(b"".join(chunks))
        admitted = open_round(cfg, 2, standings).admit(f"c{i}", f"v{i}", chunks)
        assert hasattr(admitted, "source")
        uploads.append(Upload(f"c{i}", path, admitted.source.weight, admitted.source.norm))
    plan = FoldPlan.of_run(cfg, HISTORY)
    assert plan is not None
    yield cfg, versions, uploads, plan
    versions.cleanup()


def close_inputs(out: Path, round_, folder: Path | None) -> CloseInputs:
    """The round's close, its version written into ``out`` (made here)."""
    cfg, versions, uploads, plan = round_
    out.mkdir()
    return CloseInputs(
        RUN, 2, cfg, versions.latest.params, versions.latest.state, uploads, HISTORY, 1,
        VersionPaths(out / "p", out / "s", out / "d"), check_seed=11, fold=Folding(plan, folder),
    )  # fmt: skip


def close(tmp_path: Path, name: str, round_, folder: Path | None) -> tuple[Closed, dict]:
    inputs = close_inputs(tmp_path / name, round_, folder)
    closed = close_round(inputs, evaluate=lambda p, d: 1.0, base_judge_loss=1.0)
    assert closed.committed and closed.pending is not None
    closed.pending.write().commit_rest()  # the server commits them after publishing
    paths = inputs.out
    return closed, {p.name: p.read_bytes() for p in (paths.params, paths.state, paths.delta)}


def fold(
    round_, folder: Path, order: list[int], batch: int = 1, process: FoldProcess | None = None
) -> FoldState:
    """Fold the uploads ``order`` names as the server does on arrival, ``batch`` at a time
    (one pass over the sum each), here or in ``process``."""
    cfg, versions, uploads, plan = round_
    inputs = CloseInputs(
        RUN, 2, cfg, versions.latest.params, versions.latest.state, uploads, HISTORY, 1,
        VersionPaths(folder, folder, folder),
    )  # fmt: skip
    base = open_base(inputs)
    base.close()
    state = FoldState(folder, base.shapes)
    arrivals = [
        Arrival(u.id, u.path, plan.factor(u.weight, u.norm)) for u in (uploads[i] for i in order)
    ]
    for at in range(0, len(arrivals), batch):
        if process is None:
            state.fold(plan, [11], arrivals[at : at + batch], base.upload_codec)
        else:
            process.fold(
                folder, base.shapes, plan, [11], arrivals[at : at + batch], base.upload_codec
            )
    return state


def test_a_folded_round_publishes_the_bits_of_one_read_again_in_any_order(tmp_path, round_):
    # Prepare: the reference reads every upload at the close
    want, want_files = close(tmp_path, "reference", round_, None)
    assert want.excluded.keys() == {"c5"} and want.exclusion_codes["c5"] == "zero_update"
    assert want.shares["c3"].clip < 1.0  # clipped against the history, not the round

    orders = (([0, 1, 2, 3, 4, 5], 1), ([5, 3, 1], 1), ([4, 2, 0, 5], 1), ([3, 0, 5, 1, 4], 3))
    for k, (order, batch) in enumerate(orders):
        # Execute: some uploads folded as they arrived, one by one or several in one pass
        # (the zero one among them: the close takes it out again), the rest added by the close
        folder = tmp_path / f"fold{k}"
        fold(round_, folder, order, batch)
        got, files = close(tmp_path, f"folded{k}", round_, folder)

        # Assert: the same files, checks and shares, bit for bit
        assert files == want_files, order
        assert got.excluded == want.excluded and got.checks == want.checks
        assert got.shares == want.shares and got.update_norm == want.update_norm


def test_the_close_does_not_read_the_folded_uploads_again(tmp_path, round_):
    # the five honest uploads folded, then their blobs gone: only the sum can give them
    want, want_files = close(tmp_path, "reference", round_, None)
    _, _, uploads, _ = round_
    folder = tmp_path / "fold"
    fold(round_, folder, [0, 1, 2, 3, 4])
    for u in uploads[:5]:
        u.path.unlink()

    got, files = close(tmp_path, "folded", round_, folder)

    assert files == want_files and got.checks == want.checks


def test_the_close_writes_the_delta_alone_and_its_second_pass_the_rest_bit_for_bit(
    tmp_path, round_
):
    # Prepare: the reference close (every upload read, its files written by both passes),
    # and the judge a server runs, which records what it was given
    _, want_files = close(tmp_path, "reference", round_, None)
    cfg, versions, _, _ = round_
    folder = tmp_path / "fold"
    fold(round_, folder, [0, 1, 2])
    out = tmp_path / "closed"
    inputs = close_inputs(out, round_, folder)
    paths = inputs.out
    judged: list[dict[str, torch.Tensor]] = []

    def judge(params: Path, delta: Path | None) -> float:
        model = build_model(cfg.model)
        load_version_files(model, params, delta)
        judged.append({n: t.detach().clone() for n, t in parameters_of(model).items()})
        return 1.0

    # Execute: the close, up to what it publishes
    closed = close_round(inputs, evaluate=judge)

    # Assert: only the delta is on disk, the published one; the parameters' sha256 is known
    assert closed.committed and closed.pending is not None
    assert [p.name for p in out.iterdir()] == ["d"] and paths.delta.read_bytes() == want_files["d"]
    assert closed.params_sha256 == hashlib.sha256(want_files["p"]).hexdigest()

    # Execute: the second pass, as the server's closer runs it after publishing
    assert closed.pending.write().commit_rest() == closed.params_sha256

    # Assert: the reference's files, bit for bit; the judge measured the step it published
    assert {p.name: p.read_bytes() for p in (paths.params, paths.state, paths.delta)} == want_files
    assert len(judged) == 2  # the base, then the step (base + the published delta)
    model = build_model(cfg.model)
    load_parameters_file(model, paths.params)
    assert all(torch.equal(judged[1][n], t) for n, t in parameters_of(model).items())
    load_parameters_file(model, versions.latest.params)
    assert all(torch.equal(judged[0][n], t) for n, t in parameters_of(model).items())


def test_a_sum_a_crash_cut_short_is_not_used(tmp_path, round_):
    _want, want_files = close(tmp_path, "reference", round_, None)
    _cfg, _versions, uploads, plan = round_
    folder = tmp_path / "fold"
    state = fold(round_, folder, [0, 1])

    # a fold that died half-way: the sum changed, its upload not yet recorded
    meta = (folder / "meta.json").read_text()
    (folder / "meta.json").write_text(meta.replace('"pending": null', '"pending": "c2"'))
    with open(folder / "sum.f64", "r+b") as f:
        f.write(b"\x00" * 64)
    assert state.usable(plan, [11]) is None
    _, files = close(tmp_path, "after-crash", round_, folder)
    assert files == want_files

    # a damaged upload met while folding leaves the state pending, never half-used
    damaged = tmp_path / "damaged"
    state = fold(round_, damaged, [0])
    raw = bytearray(uploads[1].path.read_bytes())
    raw[len(raw) // 2] ^= 1
    uploads[1].path.write_bytes(bytes(raw))
    with pytest.raises(SourceUnreadable):
        fold(round_, damaged, [1])
    assert state.usable(plan, [11]) is None

    # in a pass of several, the damaged one is named (the server leaves it to the close)
    with pytest.raises(SourceUnreadable) as raised:
        fold(round_, tmp_path / "batch", [0, 1, 2], batch=3)
    assert raised.value.source_id == "c1"


def test_a_child_process_folds_the_same_bits_and_is_replaced_when_it_dies(tmp_path, round_):
    # Prepare: the reference, and the server's fold process
    _want, want_files = close(tmp_path, "reference", round_, None)
    _cfg, _versions, uploads, _plan = round_
    folder = tmp_path / "fold"
    ours = {c.pid for c in multiprocessing.active_children()}
    process = FoldProcess()
    try:
        # Execute: a pass in the child; the child killed; a pass; a pass in a new child
        fold(round_, folder, [0, 1], batch=2, process=process)
        (child,) = [c for c in multiprocessing.active_children() if c.pid not in ours]
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        with pytest.raises(RuntimeError, match="the fold process died"):
            fold(round_, folder, [2, 3], batch=2, process=process)
        fold(round_, folder, [2, 3], batch=2, process=process)

        # Assert: the sum holds the four, and the close publishes the reference's bits
        assert folded_ids(folder) == ["c0", "c1", "c2", "c3"]
        _, files = close(tmp_path, "folded", round_, folder)
        assert files == want_files

        # a damaged upload is named across the process boundary
        raw = bytearray(uploads[4].path.read_bytes())
        raw[len(raw) // 2] ^= 1
        uploads[4].path.write_bytes(bytes(raw))
        with pytest.raises(SourceUnreadable) as raised:
            fold(round_, tmp_path / "damaged", [0, 4], batch=2, process=process)
        assert raised.value.source_id == "c4"
    finally:
        process.shutdown()


def test_a_sum_of_another_plan_or_sampling_is_not_used(tmp_path, round_):
    _cfg, _versions, _uploads, plan = round_
    folder = tmp_path / "fold"
    state = fold(round_, folder, [0, 1, 2])
    assert state.usable(plan, [11]) == ["c0", "c1", "c2"]
    assert state.usable(plan, [12]) is None  # another round's sampling
    other = FoldPlan(plan.limit * 2, plan.unit)
    assert state.usable(other, [11]) is None
    os.truncate(folder / "sum.f64", 8)
    assert state.usable(plan, [11]) is None


def test_only_clipped_rounds_with_history_are_folded():
    cfg = config()
    assert FoldPlan.of_run(cfg, HISTORY[:2]) is None  # fewer than reference_min
    assert FoldPlan.of_run(config(method="mean"), HISTORY) is None
    assert FoldPlan.of_run(config(method="centered_clip"), HISTORY) is None
    assert FoldPlan.of_run(config(fold=False), HISTORY) is None
    plan = FoldPlan.of_run(cfg, HISTORY)
    assert plan is not None and plan.limit == cfg.aggregation.clip_multiple * 1.0


def test_a_closed_rounds_sum_stays_while_its_lock_is_held(tmp_path):
    # the closer's second pass holds the round's lock while it reads the running sum
    folds = Folds(tmp_path)
    for index in (1, 2):
        folds.folder("run", index).mkdir(parents=True)
        (folds.folder("run", index) / "sum.f64").write_bytes(b"\0" * 8)
    with folds.lock("run", 1):
        folds.keep_only(set())  # both rounds closed: the second goes, the first waits
        assert folds.folder("run", 1).exists() and not folds.folder("run", 2).exists()
    folds.keep_only(set())
    assert not folds.folder("run", 1).exists()
