"""The ``diloco`` command as a user runs it: a real subprocess, real files, exit codes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import in_process

REPO = Path(__file__).resolve().parents[1]


def diloco(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def torch_sees_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def write_config(tmp_path: Path, corpus: Path, extra: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(
        f"""name = "cli"
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
[data]
path = "{corpus.name}"
val_fraction = 0.1
[inner]
steps = 2
batch_size = 4
[rounds]
max_rounds = 2
quorum = 1
[compression]
block_size = 256
{extra}"""
    )
    return path


def test_simulate_writes_the_result_json_and_a_plot(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    out, png = tmp_path / "r.json", tmp_path / "r.png"

    proc = diloco(
        "simulate",
        str(config),
        "--workers",
        "2",
        "--out",
        str(out),
        "--plot",
        str(png),
        "--seed",
        "4",
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {"final_eval_loss", "bytes_up_per_worker", "bytes_down_per_worker", "rounds"} <= set(
        result
    )
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    assert all({"round", "tokens", "eval_loss"} <= set(r) for r in result["rounds"])
    assert result["seed"] == 4 and result["workers"] == 2
    assert json.loads(proc.stdout)["final_eval_loss"] == pytest.approx(
        result["final_eval_loss"], abs=1e-5
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round    2" in proc.stderr


def test_options_override_the_config_and_read_environment_variables(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    out = tmp_path / "r.json"

    proc = diloco(
        "simulate",
        str(config),
        "-H",
        "3",
        "--compression",
        "none",
        "--out",
        str(out),
        env={"DILOCO_WORKERS": "3", "DILOCO_ROUNDS": "1", "DILOCO_MODE": "ddp"},
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["mode"], result["workers"], result["inner_steps"]) == ("ddp", 3, 3)
    assert result["rounds"][-1]["tokens"] == 3 * 3 * 4 * 32


def test_plot_command_draws_several_results(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    paths = []
    for mode in ("single", "diloco"):
        paths.append(tmp_path / f"{mode}.json")
        assert (
            diloco(
                "simulate", str(config), "--mode", mode, "--out", str(paths[-1]), "--quiet"
            ).returncode
            == 0
        )

    proc = diloco("plot", *map(str, paths), "--out", str(tmp_path / "both.png"))

    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "both.png").stat().st_size > 1000


def test_unknown_config_key_exits_2_naming_the_key(tmp_path, corpus):
    config = write_config(tmp_path, corpus, extra="[outer]\nmomentom = 0.5\n")

    proc = diloco("simulate", str(config))

    assert proc.returncode == 2
    assert "outer.momentom: unknown key" in proc.stderr


def test_invalid_override_exits_2_naming_the_key(tmp_path, corpus):
    config = write_config(tmp_path, corpus)

    proc = diloco("simulate", str(config), "--outer-momentum", "0")

    assert proc.returncode == 2
    assert "outer.nesterov" in proc.stderr


def test_bad_mode_and_drop_probability_exit_2(tmp_path, corpus):
    config = write_config(tmp_path, corpus)

    bad_mode = diloco("simulate", str(config), "--mode", "fsdp")
    assert bad_mode.returncode == 2 and "fsdp" in bad_mode.stderr
    proc = in_process("simulate", str(config), "--drop-prob", "1.5")
    assert proc.returncode == 2 and "--drop-prob" in proc.stderr
    for device in ("tpu", "not-a-device"):
        proc = in_process("simulate", str(config), "--device", device)
        assert (
            proc.returncode == 2
            and f"--device must be one of auto, cpu, cuda, mps or cuda:N, not {device!r}"
            in (proc.stderr)
        )


@pytest.mark.skipif(torch_sees_cuda(), reason="this machine has a CUDA device")
def test_a_cuda_device_where_torch_sees_none_exits_2(tmp_path, corpus):
    proc = diloco("simulate", str(write_config(tmp_path, corpus)), "--device", "cuda")

    assert proc.returncode == 2 and "torch sees no CUDA GPU" in proc.stderr


def test_missing_data_file_exits_3(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    corpus.unlink()

    proc = diloco("simulate", str(config))

    assert proc.returncode == 3
    assert "corpus.txt" in proc.stderr


def test_corpus_too_small_for_the_shards_exits_3(tmp_path):
    tiny = tmp_path / "corpus.txt"
    tiny.write_text("to be or not to be " * 20)
    config = write_config(tmp_path, tiny)

    proc = diloco("simulate", str(config), "--workers", "16")

    assert proc.returncode == 3
    assert "cannot give 16 shards at least one window" in proc.stderr


@pytest.mark.cpu_bound
def test_convergence_bench_pipeline_runs_end_to_end_in_quick_mode(tmp_path, corpus):
    # the real benchmark takes ~40 min; --quick runs every arm on a toy model
    proc = subprocess.run(
        [
            sys.executable,
            "bench/convergence.py",
            "--quick",
            "--data",
            str(corpus),
            "--work-dir",
            str(tmp_path / "bench"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
    )

    assert proc.returncode == 0, proc.stderr
    doc = (tmp_path / "bench" / "benchmarks.md").read_text()
    assert "| DiLoCo H=5 int8, 30% dropped |" in doc
    assert "## Acceptance checks" in doc
    assert len(list((tmp_path / "bench").glob("k2_*_seed[01].json"))) == 2 * 6


def test_simulate_protocol_mode_prints_each_round_and_writes_the_json(tmp_path, corpus):
    # quorum 1, deadline 30 s; volunteers take 10, 10, 20 and 40 s: the slowest misses
    # round 1 (closed at its deadline, 30 s), and its upload at 40 s is refused (the run
    # takes no late work)
    config = write_config(tmp_path, corpus)
    text = config.read_text().replace("quorum = 1\n", "quorum = 1\nmax_staleness = 0\n")
    config.write_text("seed = 7\n" + text)  # the run seed, when --seed is absent
    out = tmp_path / "protocol.json"

    proc = diloco(
        "simulate",
        str(config),
        "--mode",
        "protocol",
        "--speeds",
        "1,1,0.5,0.25",
        "--step-s",
        "5",
        "--timeout-s",
        "30",
        "--out",
        str(out),
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["mode"], result["workers"], result["seed"]) == ("protocol", 4, 7)
    rounds = result["rounds"]
    assert [(r["round"], r["close_code"], r["closed_at_s"]) for r in rounds] == [
        (1, "deadline_quorum", 30.0),
        (2, "deadline_quorum", 60.0),
    ]
    assert result["protocol"]["refused"] == {"round_closed": 1}
    assert "deadline_quorum: deadline passed with quorum: 3 accepted, quorum 1" in proc.stderr
    assert "round    2" in proc.stderr
    # 80 of the 140 volunteer-seconds reached a step (the slowest: 40 s refused, 20 in flight)
    assert json.loads(proc.stdout)["goodput"] == round(80 / 140, 4)


def test_simulate_protocol_options_that_do_not_fit_exit_2(tmp_path, corpus):
    config = write_config(tmp_path, corpus)

    # one real process (its exit status), the rest in this one: they stop before any work
    negative = diloco("simulate", str(config), "--mode", "protocol", "--speeds", "-1,1")
    assert negative.returncode == 2
    assert "speeds: must all be positive numbers, got [-1.0, 1.0]" in negative.stderr
    mismatch = in_process(
        "simulate", str(config), "--mode", "protocol", "--speeds", "1,1", "--workers", "3"
    )
    assert mismatch.returncode == 2 and "speeds: 2 given for 3 volunteers" in mismatch.stderr
    elsewhere = in_process("simulate", str(config), "--speeds", "1,1")
    assert elsewhere.returncode == 2 and "apply to --mode protocol only" in elsewhere.stderr
    for link, message in [
        ("20", "--link takes UP/DOWN[/LATENCY_MS]"),
        ("20/fast", "--link takes UP/DOWN[/LATENCY_MS]"),
        ("0/100", "links: up_mbps must be a positive number"),
        ("20/100/-5", "links: latency_s must be 0 or more seconds"),
    ]:
        bad = in_process("simulate", str(config), "--mode", "protocol", "--link", link)
        assert bad.returncode == 2 and message in bad.stderr, (link, bad.stderr)
    no_link = in_process("simulate", str(config), "--mode", "protocol", "--link-as-params", "1e9")
    assert no_link.returncode == 2 and "give --link too" in no_link.stderr
    link_elsewhere = in_process("simulate", str(config), "--link", "20/100")
    assert link_elsewhere.returncode == 2 and "--link apply to --mode protocol only" in (
        link_elsewhere.stderr
    )


def test_simulate_delta_downloads_report_their_bytes(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    out = tmp_path / "r.json"

    proc = diloco(
        "simulate", str(config), "--workers", "2", "--out", str(out),
        env={"DILOCO_DOWNLOADS": "delta"},
    )  # fmt: skip
    elsewhere = diloco("simulate", str(config), "--mode", "ddp", "--downloads", "delta")
    unknown = diloco("simulate", str(config), "--downloads", "int4")

    assert proc.returncode == 0, proc.stderr
    summary, result = json.loads(proc.stdout), json.loads(out.read_text())
    assert summary["downloads"] == result["downloads"] == "delta"
    assert summary["delta_bytes"] == result["delta"]["delta_bytes"]
    assert result["delta"]["delta_bytes"] < result["delta"]["checkpoint_bytes"] / 3
    assert elsewhere.returncode == 2 and "applies to --mode diloco and protocol" in elsewhere.stderr
    assert unknown.returncode == 2 and "--downloads must be full or delta" in unknown.stderr


@pytest.mark.slow
@pytest.mark.cpu_bound
def test_convergence_bench_runs_the_llama_bpe_path_in_quick_mode(tmp_path, corpus):
    # the real run takes ~25 min: --quick prepares a BPE dataset and runs every arm on a toy
    proc = subprocess.run(
        [sys.executable, "bench/convergence.py", "--arch", "llama", "--quick", "--data",
         str(corpus), "--work-dir", str(tmp_path / "bench")],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    doc = (tmp_path / "bench" / "benchmarks.md").read_text()
    assert "## Convergence on the real path: Llama + BPE" in doc
    # a table for each K (--quick: 2 and 3), each seed's figure beside the mean
    assert "K = 2:" in doc and "K = 3:" in doc and "| DiLoCo H=5 int8 | " in doc
    # the limits and their verdicts, for every K
    for k in (2, 3):
        assert f"| {k} | recovers >= 65% of the single-ddp gap |" in doc
        assert f"| {k} | every seed ends below its lone worker (the worst seed's loss" in doc
    # single, ddp and DiLoCo int8, for each K and each of two seeds
    assert len(list((tmp_path / "bench").glob("k[23]_*_seed[01].json"))) == 2 * 3 * 2


@pytest.mark.slow
@pytest.mark.cpu_bound
def test_first_round_bench_compares_the_three_starts_in_quick_mode(tmp_path, corpus):
    proc = subprocess.run(
        [sys.executable, "bench/first_round.py", "--quick", "--data", str(corpus),
         "--work-dir", str(tmp_path / "bench")],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    doc = (tmp_path / "bench" / "benchmarks.md").read_text()
    for start in ("nesterov", "warmup 3", "average"):
        assert f"| demo | {start} |" in doc and f"| hot | {start} |" in doc
    # examples/demo.toml itself over seeds (--quick: two), its worst round and the verdict
    assert "### The demo config over many seeds" in doc
    assert re.search(r"Worst ratio over 2 seeds: \*\*\d\.\d{3}\*\* \(limit <= 1", doc)
