"""The tests' forked ``diloco`` processes (tests/support/zygote.py) behave as a fresh
``python -m client.cli`` does: same output, exit status, environment and working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.cli.support import ExitStatus
from tests.support import zygote
from tests.support.live import CLI, Proc


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter_does(
    fork: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_TEST_FORK", fork)
    monkeypatch.chdir(tmp_path)
    version = Proc([*CLI, "--version"], log=tmp_path / "version.log", env={})
    bad = Proc([*CLI, "serve", "--bogus"], log=tmp_path / "bad.log", env={})
    # the server comes from the environment it was given
    unreachable = {"DILOCO_SERVER": "http://127.0.0.1:9"}
    refused = Proc([*CLI, "run", "list"], log=tmp_path / "list.log", env=unreachable)
    # relative paths are the caller's working directory's
    (tmp_path / "c.txt").write_text("to be or not to be " * 1000)
    prepare = [*CLI, "data", "prepare", "c.txt", "--out", "ds", "--quiet"]
    prepared = Proc(prepare, log=tmp_path / "prepare.log", env={})

    assert isinstance(version.popen, zygote.ForkedPopen) == (fork == "1")
    assert version.popen.wait(timeout=60) == 0
    assert bad.popen.wait(timeout=60) == 2
    assert refused.popen.wait(timeout=60) == ExitStatus.UNREACHABLE
    assert prepared.popen.wait(timeout=60) == 0, prepared.output()
    assert version.output().strip() == "0.1.0"
    assert "No such option: --bogus" in bad.output()
    assert "cannot connect to http://127.0.0.1:9" in refused.output()
    assert (tmp_path / "ds" / "manifest.json").exists()
