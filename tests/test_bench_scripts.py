"""The benchmark scripts still run (on toy sizes); their figures are read by people, not tests."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.corpora import EXCERPT

REPO = Path(__file__).resolve().parents[1]


def quick_table(script: str, work_dir: Path, doc: Path) -> dict[str, list[str]]:
    """``bench/SCRIPT --quick --jobs 2 --work-dir WORK_DIR`` (asserted to succeed), then
    the rows of the table it wrote to ``doc``: arm -> its cells after the arm's."""
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", "--quick", "--jobs", "2", "--work-dir",
         str(work_dir)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in doc.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| arm")
    }


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


def test_close_scoring_bench_prints_each_close_beside_its_limit():
    proc = subprocess.run(
        [sys.executable, "bench/close_scoring.py", "--sizes", "tiny", "--uploads", "3",
         "--windows", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for line in ("close, scoring off", "close, scoring in it", "close, scores on arrival"):
        assert line in out, out
    assert re.search(r"limit \d+\.\d+ s \(1\.25 x scoring off\): (met|NOT MET)", out), out
    assert re.search(r"^Goals: (met|NOT MET)$", out, re.MULTILINE), out


def test_load_bench_runs_a_round_with_tiny_load_and_no_errors(pg_admin_url, tmp_path):
    out = tmp_path / "load.json"

    proc = subprocess.run(
        [sys.executable, "bench/load.py", "--volunteers", "12", "--phase-s", "2",
         "--interval", "1", "--uploaders", "2", "--small-model",
         "--database-url", pg_admin_url, "--json", str(out)],
        capture_output=True, text=True, timeout=150, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== N = 12 volunteers" in proc.stdout
    assert "Goals:" in proc.stdout
    (result,) = json.loads(out.read_text())["results"]
    assert result["round_closed"]
    assert result["phases"]["idle"]["heartbeat"]["ok"] > 0
    errors = {
        f"{phase} {kind}": s["errors"]
        for phase, kinds in result["phases"].items()
        for kind, s in kinds.items()
        if isinstance(s, dict) and s["errors"]
    }
    assert errors == {}
    assert result["setup"]["join"]["n_errors"] == 0
    assert result["phases"]["upload"]["upload"]["ok"] == 2
    assert result["limits"]["asyncpg_update"]["count"] > 0
    # the volunteers follow the server's advice: 12 leases are far within the budget, so the
    # run's own 1 s, which the offered rate is worked out from
    assert result["advised_s"] == {"1": 12} and result["offered_per_s"] == 12.0
    assert result["phases"]["idle"]["healthz"]["ok"] > 0  # the load balancer's probes
    assert "/healthz p99 <= 100 ms" in proc.stdout


def test_arrivals_bench_folds_every_upload_of_a_round_as_it_arrives(pg_admin_url, tmp_path):
    out = tmp_path / "arrivals.json"

    proc = subprocess.run(
        [sys.executable, "bench/arrivals.py", "--volunteers", "12", "--spread-s", "3",
         "--round-s", "6", "--model", "small", "--database-url", pg_admin_url,
         "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["uploads"]["ok"] == result["uploads"]["count"] == 12
    assert result["close_after_last_s"] is not None  # round 2 closed: its version published
    # its full files durable after that, measured from the same last upload
    assert result["full_after_last_s"] >= result["close_after_last_s"] - 1.0
    assert result["server_peak_rss_mib"] >= result["server_idle_rss_mib"] * 0.5 > 0
    # round 2 folded on arrival (round 1 gave it a history): the close found uploads in the
    # sum (those still unfolded when the 12th closed it, it added itself)
    assert 1 <= result["metrics"]["diloco_close_folded_uploads_total"] <= 12
    folded = result["metrics"]["diloco_folded_uploads_total"]
    assert 1 <= folded <= 12 and result["metrics"]["diloco_fold_seconds_count"] <= folded
    assert result["children_cpu_s"] > 0  # the folds ran in the server's child process
    assert re.search(r"-> version published: \d+\.\d+ s \(limit 5 s\)", proc.stdout)
    assert result["server_errors"] == {}


def test_request_path_bench_prices_each_part_beside_the_unmatched_route(pg_admin_url, tmp_path):
    out = tmp_path / "path.json"

    proc = subprocess.run(
        [sys.executable, "bench/request_path.py", "--requests", "20",
         "--database-url", pg_admin_url, "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads(out.read_text())
    sql = "heartbeat SQL: the one statement (with acquire)"
    for part in ("unmatched route (404)", "GET /healthz", "heartbeat", "join, a new lease",
                 "middleware BodyTimeout", sql):  # fmt: skip
        assert parts[part]["cpu_us"] > 0, part
    assert "x unmatched" in proc.stdout


@pytest.mark.slow
@pytest.mark.cpu_bound
def test_attacks_bench_compares_an_attacker_with_the_attack_free_run(tmp_path):
    out = tmp_path / "attacks.json"

    proc = subprocess.run(
        [sys.executable, "bench/attacks.py", "--quick", "--jobs", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Goals" in proc.stdout and "NOT MET" not in proc.stdout
    results = json.loads(out.read_text())
    assert set(results) == {
        f"{method}/{attack}" for method in ("mean", "clipped_mean")
        for attack in ("none/0", "scaled100/1", "scaled100/2")
    }  # fmt: skip
    free = results["mean/none/0"]["final_eval_loss"]
    assert results["clipped_mean/scaled100/1"]["final_eval_loss"] <= free * 1.03


@pytest.mark.cpu_bound
def test_false_positives_bench_applies_the_quarantine_rule_to_honest_volunteers(tmp_path):
    out = tmp_path / "fp.json"

    proc = subprocess.run(
        [sys.executable, "bench/false_positives.py", "--workers", "4", "--rounds", "2",
         "--eval-windows", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Goal: no honest volunteer quarantined (4 volunteers, 2 rounds)" in proc.stdout
    results = json.loads(out.read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2] and results["quarantined"] == {}
    assert all(r["scored"] == 4 for r in results["rounds"])  # a round of up to 8: all scored


def test_audit_bench_tells_the_honest_lease_from_every_forgery():
    proc = subprocess.run(
        [sys.executable, "bench/audit.py", "--steps", "6"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = dict(
        (line[:26].strip(), line.split()[-1])
        for line in proc.stdout.splitlines()
        if line.endswith(("passes", "fails"))
    )
    assert verdicts["honest"] == "passes" and len(verdicts) == 8, proc.stdout
    assert [k for k, v in verdicts.items() if v == "passes"] == ["honest"], proc.stdout
    assert "every other kind fails: met" in proc.stdout


def test_own_alignment_bench_scores_both_kinds_of_work_and_puts_the_rule_to_them(tmp_path):
    proc = subprocess.run(
        [sys.executable, "bench/own_alignment.py", "--quick", "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in (tmp_path / "benchmarks.md").read_text().splitlines()
        if line.startswith(("| honest", "| other data"))
    }
    assert rows.keys() == {"honest", "other data"}
    assert all(cells[3].endswith("of 3") for cells in rows.values())  # three leases each
    mean, lowest, highest = (float(c) for c in rows["honest"][:3])
    assert lowest <= mean <= highest
    assert re.search(r"names the latter \d+% of the time \(\d+% within three", proc.stdout)


def test_hostile_bench_drops_every_stalled_connection_and_refuses_the_big_model(pg_admin_url):
    proc = subprocess.run(
        [sys.executable, "bench/hostile.py", "--quick", "--database-url", pg_admin_url],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip

    out = proc.stdout
    assert "stalled uploads still held" in out, out[-3000:] + proc.stderr[-3000:]
    missed = [line for line in out.splitlines() if line.endswith("MISSED")]
    # latency on a shared test machine is for people to read; everything else must hold
    assert [line for line in missed if " p99" not in line] == [], out
    assert proc.returncode == (1 if missed else 0), proc.stderr[-3000:]


def test_delta_downloads_bench_holds_its_limit_and_says_so_for_each_seed():
    proc = subprocess.run(
        [sys.executable, "bench/delta_downloads.py", "--quick", "--data", str(EXCERPT)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # | seed | full | delta | delta's x | difference | limit | holds |: the verdict, not the limit
    rows = re.findall(r"^\| (0|mean) \|.*\| ([+-]\d+\.\d+)% \| \+0\.2% \| (\w+) \|$",
                      proc.stdout, re.MULTILINE)  # fmt: skip
    assert [seed for seed, _, _ in rows] == ["0", "mean"], proc.stdout
    for _, difference, holds in rows:
        assert float(difference) <= 0.2 and holds == "yes", proc.stdout
    assert re.search(r"downloads [\d,]+ bytes \(delta\) instead of [\d,]+", proc.stdout)


def test_transport_bench_prints_every_figure_beside_its_limit(database_url):
    proc = subprocess.run(
        [sys.executable, "bench/transport.py", "--n-layer", "1", "--n-embd", "64",
         "--n-head", "4", "--uploads", "1", "--concurrent", "2", "--downloads", "1"],
        capture_output=True, text=True, timeout=180, cwd=REPO,
        env={**os.environ, "DILOCO_BENCH_DATABASE_URL": database_url},
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "x (b)" in out and "x (a)" in out  # ingest beside plain uvicorn and raw TCP
    goal = r"goal \(issue 29\): ingest >= 300 MB/s per upload .*: \d+ MB/s, (met|NOT met)"
    assert re.search(goal, out), out  # the figure beside the goal, whether met or not
    assert "2 concurrent uploads" in out and "peak" in out
    assert "(d) checkpoint download" in out


def test_server_round_bench_prints_every_stage_beside_its_limit(database_url):
    proc = subprocess.run(
        [sys.executable, "bench/server_round.py", "--sizes", "tiny", "--contributions", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "DILOCO_BENCH_DATABASE_URL": database_url},
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for stage in (
        "ingest, per upload",
        "aggregate + step",
        "critical path",
        "full files durable",
        "eval (after",
        "checkpoint download",
        "delta download",
        "peak RSS",
        "returning volunteer",
    ):
        assert f"| {stage}" in out, (stage, out)  # fmt: skip
    assert "bandwidth bound" in out and "raw TCP" in out and "% of bound" in out


def test_direct_transfers_bench_prints_both_modes_and_the_ratio(database_url):
    proc = subprocess.run(
        [sys.executable, "bench/direct_transfers.py", "--size", "tiny"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "DILOCO_BENCH_DATABASE_URL": database_url},
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "proxied round done" in out and "direct round done" in out
    assert "| proxied: server CPU-s | direct: server CPU-s |" in out
    for stage in ("join + download", "upload, in all", "close", "eval", "**whole round**"):
        assert f"| {stage}" in out, (stage, out)
    assert "ratio: direct / proxied server CPU-seconds per round = " in out
    assert "per volunteer: proxied " in out and "per round, whatever the volunteers" in out
    goal = r"goal \(issue 29\): direct costs the server less CPU than proxied at 8 volunteers: "
    assert re.search(goal + r".*, (met|NOT met); direct costs the server less ", out), out
    assert 'diloco_served_bytes_total{kind="checkpoint"}' in out
    assert "diloco_direct_upload_bytes_total" in out


@pytest.mark.slow
@pytest.mark.cpu_bound
def test_goodput_bench_runs_every_arm_and_sizing_wastes_less_than_before(tmp_path):
    rows = quick_table("goodput.py", tmp_path, tmp_path / "benchmarks.md")
    home, instant = "home links (20/100 Mb/s), int8, no overlap", "instant links (reference)"
    home_ahead, sparse, sparse_ahead = (
        "home links, int8, overlap 0.2",
        "home links, sparse, no overlap",
        "home links, sparse, overlap 0.2",
    )
    links = (home, home_ahead, sparse, sparse_ahead, instant)
    assert set(rows) == {
        "before", "sized", "sized + late", "sized + late, max 2H", "identical, H",
        "identical, rounds", *links,
    }  # fmt: skip
    linked = {arm: rows.pop(arm) for arm in links}
    goodput = {arm: float(cells[3].rstrip("%")) for arm, cells in rows.items()}
    assert goodput["sized + late"] >= goodput["before"]
    assert goodput["identical, H"] == 100.0  # nobody slow, nobody drops: nothing wasted
    # home links: a 1B model's bytes take longer than the round's compute; instant: no wait
    busy = {arm: float(cells[2].rstrip("%")) for arm, cells in linked.items()}
    on_link = {arm: float(cells[3].rstrip("%")) for arm, cells in linked.items()}
    assert busy[home] < 50.0 < on_link[home]
    assert busy[instant] >= 95.0 and on_link[instant] == 0.0
    # sparse bodies are ~30x smaller; training ahead fills part of the wait that is left
    assert busy[home] < busy[home_ahead] and busy[home] < busy[sparse] < busy[sparse_ahead]
    text = (tmp_path / "benchmarks.md").read_text()
    for arm in (home_ahead, sparse_ahead):
        assert re.search(rf"^- {re.escape(arm)}: busy \d+% \(goal >= 90%;", text, re.M), text


def test_the_gpu_convergence_script_runs_its_pipeline_where_its_options_are_overridden(
    tmp_path, corpus
):
    # no GPU here: the script's own options, then --device cpu --quick (the later ones win)
    out = tmp_path / "gpu"
    proc = subprocess.run(
        ["bash", "bench/gpu_convergence.sh", str(out), "--device", "cpu", "--quick",
         "--data", str(corpus)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = (out / "benchmarks.md").read_text()
    assert "## Convergence on the real path: Llama + BPE" in doc and "| DiLoCo H=5 int8 |" in doc
    assert "### Acceptance checks (computed by the script)" in (out / "convergence.log").read_text()


@pytest.mark.slow
@pytest.mark.cpu_bound
def test_compression_bench_prints_each_arm_with_its_real_bytes_and_the_limits(tmp_path):
    rows = quick_table("compression.py", tmp_path, tmp_path / "quick" / "benchmarks.md")
    doc = (tmp_path / "quick" / "benchmarks.md").read_text()
    k256 = "sparse, 256 of 4096, 2 bits, int8 downloads, plain step lr 3"
    k512 = "sparse, 512 of 4096, 4 bits, int8 downloads, plain step lr 3"
    k2048 = "sparse, 2048 of 4096, 2 bits, int8 downloads, Nesterov lr 0.7 / 0.9"
    assert set(rows) == {
        "int8 (the default)", "int4", "int2", "sparse (64 of 4096, 2 bits)",
        "sparse, int8 downloads", k256, k512, k2048, "int8, overlap 0.1", "sparse, overlap 0.1",
    }  # fmt: skip
    up = {arm: float(cells[3]) for arm, cells in rows.items()}
    # the sweep's best: more values, or more bits a value, than the default sparse uploads
    assert up["sparse (64 of 4096, 2 bits)"] < up[k256] < up[k512] < up[k2048]
    down = {arm: float(cells[4]) for arm, cells in rows.items()}
    # the bytes are the real encoded ones: each codec smaller than the one above it
    assert up["int8 (the default)"] > up["int4"] > up["int2"] > up["sparse (64 of 4096, 2 bits)"]
    assert down["sparse, int8 downloads"] == down["int8 (the default)"] > down["int4"]
    # int2 downloads int4 deltas, in its own smaller blocks (more scales)
    assert down["int8 (the default)"] > down["int2"] > down["int4"]
    assert down["int4"] > down["sparse (64 of 4096, 2 bits)"]
    assert "- int2: " in doc and "(limit +0.5%)" in doc and "(limit +1.5%)" in doc


def test_close_kernels_bench_prints_each_step_beside_its_bound_with_the_same_bits(tmp_path):
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "bench/close_kernels.py", "--sizes", "tiny", "--doc", str(doc)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| tiny |")]
    steps = [row.split(" | ")[1] for row in rows]
    assert "plain torch, 1 thread(s)" in steps and "fused, 1 thread(s)" in steps, steps
    assert all(" GB/s) | " in row and row.endswith("| yes |") for row in rows), rows
    assert "<!-- begin close-kernels -->" in doc.read_text()


def test_fold_close_bench_closes_a_folded_round_to_the_same_bytes_beside_its_bound(tmp_path):
    doc = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "bench/fold_close.py", "--sizes", "tiny", "--uploads", "3",
         "--doc", str(doc)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip

    # the script asserts the folded close published the bytes of the one that read all
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| fold, per upload (median of 2) |" in out
    assert "| close after the deadline, folded: to the delta published |" in out
    assert "bound 22 B/param" in out and "| second pass, after the publish:" in out
    assert "<!-- begin fold-close-3 -->" in doc.read_text()
