"""The fault injector that the crash tests arm: parsing, counting, failing and dying."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diloco.faults import FaultInjector, InjectedFault


def test_an_unarmed_injector_never_fires() -> None:
    faults = FaultInjector.parse("")

    for _ in range(3):
        faults.hit("close.write")

    assert faults.hits("close.write") == 0  # unarmed: not even counted


def test_fail_fires_from_the_nth_hit_the_given_number_of_times() -> None:
    faults = FaultInjector.parse("close.aggregate=fail@2*2")
    fired = []

    for _ in range(5):
        try:
            faults.hit("close.aggregate")
            fired.append(False)
        except InjectedFault as err:
            fired.append(True)
            assert "close.aggregate" in str(err)
        faults.hit("close.step")  # other points pass

    assert fired == [False, True, True, False, False]


def test_the_fluent_form_arms_the_same_as_the_spec() -> None:
    faults = FaultInjector().fail_at("close.step", times=1)

    with pytest.raises(InjectedFault):
        faults.hit("close.step")
    faults.hit("close.step")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("close.wrte=fail", "unknown"),
        ("close.write=explode", "expected point=fail|die"),
        ("close.write", "expected point=fail|die"),
        ("close.write=fail@0", "count from 1"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_problem(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FaultInjector.parse(spec)


def test_die_kills_the_process_with_sigkill_and_says_where() -> None:
    code = (
        "from diloco.faults import FaultInjector\n"
        "f = FaultInjector.parse('close.write=die@2')\n"
        "f.hit('close.write')\n"
        "print('survived the first hit', flush=True)\n"
        "f.hit('close.write')\n"
        "print('survived the second hit', flush=True)\n"
    )

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == -9, done
    assert done.stdout == "survived the first hit\n"
    assert "fault injected: dying at close.write (hit 2)" in done.stderr
