"""A published version's parameters and outer state, rebuilt from its stored uploads when
its closer died before committing them (``diloco.outer.rebuild``, used by
``server.rounds.full_files``): the very bytes the close wrote, or nothing committed.

A folded round (``diloco.outer.fold``) is the hard case: its close starts from a running sum
the rebuilding process does not have; the rebuild reads every kept upload again with the
round's plan, and the exact sum gives the same bits. The crash tests
(``tests/test_close_crashes.py``) rebuild an unfolded round on a live server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.outer.close import CloseInputs, VersionPaths, folding
from diloco.outer.rebuild import RebuildMismatch, rebuild
from tests.test_fold import HISTORY, close, fold, round_  # noqa: F401 - round_ is a fixture
from tests.test_one_close import RUN


def _rebuild_inputs(round_, kept_ids: list[str], out: Path) -> CloseInputs:  # noqa: F811
    cfg, versions, uploads, _plan = round_
    out.mkdir()
    return CloseInputs(
        RUN, 2, cfg, versions.latest.params, versions.latest.state,
        [u for u in uploads if u.id in kept_ids], list(HISTORY), 1,
        VersionPaths(out / "p", out / "s", out / "d"), check_seed=11,
        fold=folding(cfg, HISTORY),
    )  # fmt: skip


def test_a_folded_version_is_rebuilt_bit_for_bit_without_its_running_sum(
    tmp_path,
    round_,  # noqa: F811
):
    # Prepare: the close as a server runs it, every upload folded on arrival (the zero one
    # left out by the checks); the recipe: the kept uploads, in order
    folder = tmp_path / "fold"
    fold(round_, folder, [0, 1, 2, 3, 4, 5])
    closed, published = close(tmp_path, "published", round_, folder)
    kept = [u.id for u in round_[2] if u.id not in closed.excluded]
    assert kept == ["c0", "c1", "c2", "c3", "c4"] and closed.folded == 5
    assert closed.params_sha256 is not None and closed.delta_sha256 is not None

    # Execute: the rebuild in another folder, from the stored uploads only
    inputs = _rebuild_inputs(round_, kept, tmp_path / "rebuilt")
    out = rebuild(inputs, params_sha256=closed.params_sha256, delta_sha256=closed.delta_sha256)
    assert out.commit_rest() == closed.params_sha256

    # Assert: the parameters and the outer state, bit for bit; the delta it computed was only
    # checked against the published one's sha256, never committed
    assert {p.name: p.read_bytes() for p in (inputs.out.params, inputs.out.state)} == {
        "p": published["p"],
        "s": published["s"],
    }
    assert sorted(p.name for p in (tmp_path / "rebuilt").iterdir()) == ["p", "s"]


def test_a_rebuild_that_does_not_give_the_published_bytes_commits_nothing(
    tmp_path,
    round_,  # noqa: F811
):
    # Prepare: a published version, and a recipe that lost one of its uploads
    closed, _ = close(tmp_path, "published", round_, None)
    assert closed.params_sha256 is not None and closed.delta_sha256 is not None
    inputs = _rebuild_inputs(round_, ["c0", "c1", "c2", "c3"], tmp_path / "rebuilt")

    # Execute
    with pytest.raises(RebuildMismatch, match="nothing was committed"):
        rebuild(inputs, params_sha256=closed.params_sha256, delta_sha256=closed.delta_sha256)

    # Assert: no parameters, no state, no delta, no temp file left
    assert list((tmp_path / "rebuilt").iterdir()) == []
