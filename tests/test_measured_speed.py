"""``diloco doctor``'s measured speed, kept for the first ``diloco join`` to report."""

from __future__ import annotations

import json

import pytest

from client.measured_speed import (
    MeasuredSpeed,
    SpeedRecordError,
    first_speed,
    load_speed,
    save_speed,
    speed_path,
)
from client.progress import Reporter

RUN = "run_0123456789ab"
CPU_FP32 = MeasuredSpeed(1234.5, "cpu", "fp32", 4, 16)


def test_a_saved_speed_reads_back_and_applies_to_its_device_and_precision_only(tmp_path):
    assert load_speed(RUN, tmp_path) is None  # no doctor ran

    path = save_speed(RUN, CPU_FP32, tmp_path)

    assert path == speed_path(RUN, tmp_path) and path.parent.name == RUN
    assert load_speed(RUN, tmp_path) == CPU_FP32
    assert CPU_FP32.applies_to("cpu", "fp32")
    assert not CPU_FP32.applies_to("cuda", "fp32") and not CPU_FP32.applies_to("cpu", "bf16")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "does not read"),
        (json.dumps({"tokens_per_s": 10.0}), "lacks a field"),
        (json.dumps({**CPU_FP32.__dict__, "micro_batch": "four"}), "bad one"),
        (json.dumps({**CPU_FP32.__dict__, "tokens_per_s": -1.0}), "out of range"),
        (json.dumps({**CPU_FP32.__dict__, "tokens_per_s": 1e12}), "out of range"),
        ('{"tokens_per_s": NaN, "device": "cpu", "precision": "fp32", "micro_batch": 1, '
         '"batch_size": 1}', "out of range"),
    ],
)  # fmt: skip
def test_a_speed_file_that_does_not_hold_a_measurement_is_an_error(tmp_path, content, message):
    path = speed_path(RUN, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(SpeedRecordError, match=message):
        load_speed(RUN, tmp_path)


def test_the_first_join_reports_the_doctors_speed_when_it_was_measured_the_same_way(
    tmp_path, capsys
):
    say = Reporter(quiet=False, bar=False)

    def first() -> float | None:  # what a worker on this machine's CPU, in fp32, reports
        return first_speed(RUN, tmp_path, "cpu", "fp32", say)

    assert first() is None  # nothing saved: the nominal H

    save_speed(RUN, CPU_FP32, tmp_path)
    assert first() == 1234.5
    assert "first join reports diloco doctor's 1,234 tokens/s (cpu fp32)" in capsys.readouterr().err

    save_speed(RUN, MeasuredSpeed(9e5, "cuda", "bf16", 8, 16), tmp_path)
    assert first() is None  # another device's figure says nothing of ours

    speed_path(RUN, tmp_path).write_text("{")
    assert first() is None
    assert "not reporting diloco doctor's speed" in capsys.readouterr().err
