"""Attackers in the simulator (``SimOptions.attacks``, ``bench/attacks.py``): an attack that
begins at a later round (an account that earned its standing first), the attacks on how the
work is trained (``attacks.TRAINING``), and what the server would audit: the round's
suspect and the uploads its secret draws."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from diloco.protocol.audit import audit_share, drawn
from diloco.protocol.reputation import standing
from diloco.simulate.run import SimOptions, simulate
from tests.conftest import make_corpus, tiny_config

WORKERS = 5
ATTACKER = "worker-4"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("attacks") / "corpus.txt"
    path.write_text(make_corpus(40_000))
    return path


@pytest.fixture(scope="module")
def free(corpus: Path):
    """The attack-free run, once for the module's tests."""
    return run(corpus, None)


def run(corpus: Path, attack: str | None, start: int = 1):
    cfg = tiny_config(corpus, rounds={"max_rounds": 3, "quorum": 1})
    attacks = {WORKERS - 1: attack} if attack else {}
    opts = SimOptions(workers=WORKERS, seed=0, eval_windows=4, attacks=attacks, attack_from=start)
    return cfg, simulate(cfg, opts)  # type: ignore[arg-type]


def test_an_attack_from_round_two_leaves_round_one_honest_and_is_left_out_after(corpus, free):
    _, attacked = run(corpus, "zeros", start=2)

    first, *later = attacked.rounds
    assert first.eval_loss == free[1].rounds[0].eval_loss and first.checks["failed"] == {}
    for r in later:
        assert r.checks["failed"] == {f"{ATTACKER}@{r.round}": "zero_update"}
        assert r.suspect != f"{ATTACKER}@{r.round}"  # left out: no step took it to suspect


@pytest.mark.parametrize("attack", ["stale_base", "other_data"])
def test_training_attacks_send_real_work_of_their_own(corpus, free, attack):
    _, attacked = run(corpus, attack, start=2)

    # round 1 honest by all; from round 2 the attacker's work is its own (another base or
    # other batches), trained and sent as any volunteer's: no cheap check can tell
    assert attacked.rounds[0].eval_loss == free[1].rounds[0].eval_loss
    assert attacked.final_eval_loss != free[1].final_eval_loss
    for r in attacked.rounds:
        assert r.accepted == WORKERS and r.refused == 0
        assert f"{ATTACKER}@{r.round}" not in r.checks["failed"]
        assert r.checks["scored"] == WORKERS  # scored on the windows it was dealt


def test_each_round_records_the_uploads_its_secret_draws_as_the_server_would(free):
    cfg, result = free

    for r in result.rounds:  # the draw the server's upload transaction makes, by standing
        secret = random.Random(f"{cfg.seed}/{r.round}").getrandbits(62)  # Versions.check_seed
        taken = r.round - 1  # every honest upload of this tiny run was taken by each step
        share = audit_share(cfg.audit.fraction, standing(taken, 0), newcomers=True)
        expected = [f"worker-{i}@{r.round}" for i in range(WORKERS)
                    if drawn(secret, f"worker-{i}", share)]  # fmt: skip
        assert r.drawn == expected
        assert r.suspect is None or r.suspect.endswith(f"@{r.round}")
    # new accounts: each upload drawn with probability 8/9 in round 1
    assert audit_share(cfg.audit.fraction, standing(0, 0), newcomers=True) == pytest.approx(8 / 9)
    assert len(result.rounds[0].drawn) >= 3
