"""``diloco run track`` (``client.tracking``): a run's closed rounds written once into
TensorBoard event files and an offline W&B run, each read back with the tracker's own
reader (tensorboard's ``EventAccumulator``, ``wandb leet inspect --json``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client.http import ServerUnreachable
from client.tracking.follow import Tracker, follow
from client.tracking.points import Logged
from client.tracking.sinks import TensorBoardSink
from tests.conftest import server_run_config
from tests.support.cli import REPO, in_process
from tests.support.contribute import API, close_rounds, create_run, register


def tensorboard_points(logdir: Path) -> dict[str, list[tuple[int, Any]]]:
    """Every scalar (tag -> [(step, value)]) and text (tag -> [(step, text)]) in the event
    files under ``logdir``, as TensorBoard loads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    out: dict[str, list[tuple[int, Any]]] = {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]
    }
    for tag in tags["tensors"]:
        out[tag] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
    return out


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run, as ``wandb leet inspect --json`` reads its
    transaction log."""
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def track_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``diloco run track ARGS`` with W&B offline under ``tmp_path`` (no network)."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb-root"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
    }
    (tmp_path / "wandb-root").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "client.cli", "run", "track", *args],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=env, check=False,
    )  # fmt: skip


def test_a_run_is_followed_to_its_end_and_each_round_written_once(server, tmp_path):
    # Prepare: a run of two rounds, both closed (the run is completed)
    http = server.client()
    run_id = create_run(http, server_run_config(rounds={"quorum": 1, "max_rounds": 2}))["id"]
    close_rounds(http, register(http, "tracked"), run_id, 2)
    tb = tmp_path / "tb"

    # Execute: follow it until it ends (evals still pending are waited for)
    done = track_cli(
        tmp_path, run_id, "--server", server.url, "--tensorboard", str(tb),
        "--wandb", "diloco-test", "--poll-s", "0.5",
    )  # fmt: skip

    # Assert: one point per closed round, the step the tokens trained through it
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"run {run_id} is completed: 2 closed round(s) written" in done.stdout
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    steps = [rounds[0]["tokens"], rounds[0]["tokens"] + rounds[1]["tokens"]]
    nbytes = [
        sum(c["nbytes"] for c in http.get(f"{API}/runs/{run_id}/rounds/{i}/contributions")
            .json()["contributions"] if c["merged_into_round"] == i)
        for i in (1, 2)
    ]  # fmt: skip
    points = tensorboard_points(tb / run_id)
    evals = [r["eval_loss"] for r in rounds]
    assert None not in evals
    assert [s for s, _ in points["loss/eval"]] == steps
    assert [v for _, v in points["loss/eval"]] == pytest.approx(evals, rel=1e-6)
    assert [v for _, v in points["loss/train"]] == pytest.approx(
        [r["train_loss"] for r in rounds], rel=1e-6
    )
    assert points["round/index"] == [(steps[0], 1.0), (steps[1], 2.0)]
    assert [v for _, v in points["round/accepted"]] == [1.0, 1.0]
    assert [v for _, v in points["round/bytes_up"]] == nbytes and min(nbytes) > 0
    assert [v for _, v in points["round/update_norm"]] == pytest.approx(
        [r["update_norm"] for r in rounds], rel=1e-6
    )
    reasons = points["round/close_reason/text_summary"]
    assert [s for s, _ in reasons] == steps
    for (_, text), r in zip(reasons, rounds, strict=True):
        assert text == f"{r['close_code']}: {r['close_reason']}"

    [wandb_run] = (tmp_path / "wandb-root" / "wandb").glob("offline-run-*")
    history = wandb_history(wandb_run)
    closes = [h for h in history if "round/close_reason" in h]
    assert [(h["tokens"], h["round/index"]) for h in closes] == [(steps[0], 1), (steps[1], 2)]
    eval_rows = sorted((h["tokens"], h["loss/eval"]) for h in history if "loss/eval" in h)
    assert [s for s, _ in eval_rows] == steps
    assert [v for _, v in eval_rows] == pytest.approx(evals, rel=1e-6)

    # Execute again, as a restart: nothing new to write
    again = track_cli(
        tmp_path, run_id, "--server", server.url, "--tensorboard", str(tb),
        "--wandb", "diloco-test", "--once",
    )  # fmt: skip

    assert again.returncode == 0, again.stdout + again.stderr
    assert "round 1:" not in again.stdout and "round 2:" not in again.stdout
    assert tensorboard_points(tb / run_id) == points
    second = [d for d in (tmp_path / "wandb-root" / "wandb").glob("offline-run-*")]
    assert len(second) == 2
    [new_run] = [d for d in second if d != wandb_run]
    assert wandb_history(new_run) == []


class FakeRun:
    """The tracker's reads, answered from lists a test changes between passes."""

    def __init__(self) -> None:
        self.status = "active"
        self.listed: list[dict[str, Any]] = []
        self.failures = 0  # the next reads of the run that fail
        self.reads = 0

    def closed(self, index: int, tokens: int, eval_loss: float | None) -> None:
        self.listed.append(
            {"index": index, "state": "closed", "tokens": tokens, "accepted": 2, "late": 1,
             "train_loss": 3.0 - index / 10, "eval_loss": eval_loss, "update_norm": 0.5,
             "close_code": "quorum", "close_reason": "quorum reached"}
        )  # fmt: skip

    async def run(self, run_id: str) -> dict[str, Any]:
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise ServerUnreachable("connection refused")
        return {"id": run_id, "status": self.status}

    async def rounds(self, run_id: str) -> list[dict[str, Any]]:
        return [*self.listed, {"index": len(self.listed) + 1, "state": "open", "tokens": 5}]

    async def contributions(self, run_id: str, index: int) -> list[dict[str, Any]]:
        return [
            {"nbytes": 1000, "merged_into_round": index},
            {"nbytes": 7, "merged_into_round": index + 1},  # late work for the next step
        ]


def test_an_eval_loss_pending_at_the_close_is_written_later_once(tmp_path):
    fake, run = FakeRun(), {"id": "run_fake"}
    sink = TensorBoardSink(tmp_path, run)
    tracker = Tracker(fake, "run_fake", [sink])

    fake.closed(1, 100, eval_loss=None)  # closed, its version not evaluated yet
    first = asyncio.run(tracker.pass_once())
    fake.listed[0]["eval_loss"] = 2.5  # measured since
    fake.closed(2, 300, eval_loss=2.25)
    second = asyncio.run(tracker.pass_once())
    third = asyncio.run(tracker.pass_once())
    sink.close()

    assert (first.pending_evals, [p.index for p in first.written]) == ([1], [1])
    assert [p.index for p in second.written] == [2] and [p.index for p in second.evals] == [1]
    assert (third.written, third.evals, third.pending_evals) == ([], [], [])
    points = tensorboard_points(tmp_path / "run_fake")
    assert points["loss/eval"] == [(100, 2.5), (400, 2.25)]
    assert points["round/bytes_up"] == [(100, 1000.0), (400, 1000.0)]
    assert points["round/late"] == [(100, 1.0), (400, 1.0)]
    saved = Logged.load(tmp_path / "run_fake" / "diloco-track.json", "run_fake")
    assert (saved.rounds_through, saved.evals) == (2, {1, 2})

    # a restarted tracker (its state read back) writes nothing again
    restarted = TensorBoardSink(tmp_path, run)
    fourth = asyncio.run(Tracker(fake, "run_fake", [restarted]).pass_once())
    restarted.close()
    assert (fourth.written, fourth.evals) == ([], [])
    assert tensorboard_points(tmp_path / "run_fake") == points


def test_following_backs_off_on_failures_and_gives_up_on_a_missing_eval(tmp_path):
    fake = FakeRun()
    fake.closed(1, 100, eval_loss=None)  # never evaluated (say, not finite)
    fake.status = "completed"
    fake.failures = 2  # the server is down for two reads
    sink = TensorBoardSink(tmp_path, {"id": "run_fake"})
    said: list[str] = []

    options: dict[str, Any] = {
        "poll_s": 0.01,
        "eval_wait_s": 0.05,
        "give_up_s": 60.0,
        "echo": said.append,
    }
    summary = asyncio.run(follow(Tracker(fake, "run_fake", [sink]), once=False, **options))
    sink.close()

    assert (summary.status, summary.rounds, summary.missing_evals) == ("completed", 1, [1])
    assert sum("trying again" in line for line in said) == 2
    assert any(line.startswith("round 1: train 2.9000, eval pending") for line in said)
    assert tensorboard_points(tmp_path / "run_fake")["round/index"] == [(100, 1.0)]

    # with --once a failing server is an error at once
    fake.failures = 1
    sink = TensorBoardSink(tmp_path, {"id": "run_fake"})
    with pytest.raises(ServerUnreachable):
        asyncio.run(follow(Tracker(fake, "run_fake", [sink]), once=True, **options))
    sink.close()


class CancelledWhileClosing(FakeRun):
    """A run cancelled while its round 2 was being closed: the close still publishes."""

    async def rounds(self, run_id: str) -> list[dict[str, Any]]:
        if self.reads >= 3 and len(self.listed) == 1:
            self.closed(2, 50, eval_loss=2.0)
        tail = [{"index": 2, "state": "closing", "tokens": 0}] if len(self.listed) == 1 else []
        return [*self.listed, *tail]


def test_a_close_under_way_when_the_run_was_cancelled_is_waited_for(tmp_path):
    fake = CancelledWhileClosing()
    fake.closed(1, 100, eval_loss=2.5)
    fake.status = "cancelled"
    sink = TensorBoardSink(tmp_path, {"id": "run_fake"})

    summary = asyncio.run(
        follow(
            Tracker(fake, "run_fake", [sink]),
            poll_s=0.01,
            once=False,
            eval_wait_s=60,
            give_up_s=60,
            echo=lambda line: None,
        )
    )
    sink.close()

    assert (summary.status, summary.rounds, summary.missing_evals) == ("cancelled", 2, [])
    assert fake.reads == 3
    assert tensorboard_points(tmp_path / "run_fake")["loss/eval"] == [(100, 2.5), (150, 2.0)]


def test_a_state_file_of_another_run_is_refused(tmp_path):
    Logged(tmp_path / "diloco-track.json", "run_a", 3, {1}).save()

    from client.tracking.points import TrackError

    with pytest.raises(TrackError, match="records run run_a, not run_b"):
        Logged.load(tmp_path / "diloco-track.json", "run_b")


@pytest.mark.parametrize(("option", "module"), [("--tensorboard", "tensorboard"),
                                                ("--wandb", "wandb")])  # fmt: skip
def test_track_without_the_extra_says_how_to_install_it(monkeypatch, tmp_path, option, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails: not installed

    done = in_process("run", "track", "run_x", "--server", "http://127.0.0.1:9",
                      option, str(tmp_path))  # fmt: skip

    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line == (
        f"error: {option} needs the track extra, which this install lacks ({module} is "
        "missing): pip install 'diloco-hub[track]'"
    )


def test_track_needs_a_tracker():
    done = in_process("run", "track", "run_x", "--server", "http://127.0.0.1:9")

    assert done.returncode == 2 and "--tensorboard DIR and/or --wandb PROJECT" in done.stderr
