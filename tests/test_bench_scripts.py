"""The benchmark scripts still run (on toy sizes); their figures are read by people, not tests."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_codec_wire_bench_prints_a_rate_for_every_stage():
    proc = subprocess.run(
        [sys.executable, "bench/codec_wire.py", "--params", "40000", "--tensors", "4",
         "--repeat", "1", "--chunk", "4096"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    rates = [line for line in proc.stdout.splitlines() if line.endswith("MB/s")]
    assert [r.split("  ")[1].strip() for r in rates] == [
        "int8 encode (fp32 in)", "int8 decode (fp32 out)", "wire encode (body)",
        "wire decode (body)",
    ]  # fmt: skip
