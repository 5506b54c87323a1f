"""``diloco`` processes forked from a preloaded parent: what the tests' ``diloco serve`` and
``diloco join`` processes cost to start.

A fresh ``python -m client.cli serve`` spends ~2.3 CPU-seconds importing torch, FastAPI,
SQLAlchemy and the server before it does anything, and the suite starts ~100 of them on a
2-core machine: a fifth of its CPU. Each test process keeps one *zygote* instead, a child
that has imported all that once (and runs nothing: no torch op, no event loop, no thread);
a process is a ``fork`` of it that then does what ``python -m client.cli ARGS`` does after
its imports: the environment, working directory, file-size limit and output file it was
given, ``sys.argv``, the CLI's ``main()``, the interpreter's exit (non-daemon threads
joined, ``atexit`` handlers run, the exit status or the killing signal). It is a real
process with a PID of its own that the tests signal and kill as before; only its parent is
the zygote, which reaps it and writes its exit status into a file the handle reads.

``DILOCO_TEST_FORK=0`` starts every process with a fresh interpreter instead (to rule this
out when something only fails here)."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

# what `diloco serve` and `diloco join` import before their first request or step;
# torch._dynamo comes with the first AdamW step (~1 CPU-second)
PRELOAD = ["torch", "torch._dynamo", "client.cli.main", "server.main", "client.worker"]
CLI_MAIN = str(Path(__file__).resolve().parents[2] / "client" / "cli" / "__main__.py")


def enabled() -> bool:
    return os.environ.get("DILOCO_TEST_FORK", "1") != "0"


# ----------------------------------------------------------------------- the test's side


class ForkedPopen:
    """What ``subprocess.Popen`` offers for a process the zygote forked: ``pid``,
    ``returncode`` (negative: the signal that killed it), ``poll``, ``wait``,
    ``send_signal``."""

    def __init__(self, pid: int, status_file: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status_file = status_file

    def poll(self) -> int | None:
        if self.returncode is None and self._status_file.exists():
            self.returncode = int(self._status_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["diloco", str(self.pid)], timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Zygote:
    """The test process's zygote, started on first use (its imports take a few seconds)."""

    _instance: Zygote | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.status_dir = Path(tempfile.mkdtemp(prefix="diloco-zygote-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", str(self.status_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self._in: IO[str] = self.proc.stdin
        self._out: IO[str] = self.proc.stdout
        if self._out.readline().strip() != "ready":
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")

    @classmethod
    def get(cls) -> Zygote:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
                atexit.register(cls._instance.close)
            return cls._instance

    def close(self) -> None:
        """End of the test process: the zygote exits once its last child has."""
        with contextlib.suppress(OSError):
            self._in.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
            shutil.rmtree(self.status_dir, ignore_errors=True)

    def spawn(
        self, args: list[str], *, env: dict[str, str], log: Path, max_file_bytes: int | None
    ) -> ForkedPopen:
        """``python -m client.cli ARGS`` with ``env``, output appended to ``log``."""
        request = dict(args=args, env=env, log=str(log), cwd=os.getcwd(), fsize=max_file_bytes)
        with self._lock:
            self._in.write(json.dumps(request) + "\n")
            self._in.flush()
            reply = self._out.readline()
        if not reply:
            raise RuntimeError(f"the test zygote exited ({self.proc.wait()})")
        pid = int(json.loads(reply)["pid"])
        return ForkedPopen(pid, self.status_dir / str(pid))


# --------------------------------------------------------------------- the zygote's side


def _reap(status_dir: Path, *, block: bool) -> None:
    """Write each exited child's status to STATUS_DIR/PID; with ``block``, until none is left."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = (
            -os.WTERMSIG(wait_status)
            if os.WIFSIGNALED(wait_status)
            else os.WEXITSTATUS(wait_status)
        )
        partial = status_dir / f".{pid}"
        partial.write_text(str(status))
        partial.rename(status_dir / str(pid))


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m client.cli ARGS``; never returns."""
    status = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        # as the interpreter sets them up for a file: stdout block-buffered, stderr by line
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
        sys.stderr = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
            line_buffering=True,
            errors="backslashreplace",
        )
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request["fsize"] is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
        sys.argv = [CLI_MAIN, *request["args"]]
        from client.cli.main import main

        try:
            main()
            status = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                status = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                status = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            status = 1
        # the interpreter's own exit: wait for non-daemon threads, then atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def serve(status_dir: Path) -> None:
    """Read one JSON request per line from stdin, fork a process for each, write its PID;
    reap the exited ones. Ends when stdin closes (the test process is gone)."""
    for name in PRELOAD:
        __import__(name)
    print("ready", flush=True)
    pending = ""
    while True:
        _reap(status_dir, block=False)
        readable, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not readable:
            continue
        chunk = os.read(sys.stdin.fileno(), 1 << 16).decode()
        if not chunk:
            break
        pending += chunk
        while "\n" in pending:
            line, pending = pending.split("\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            print(json.dumps({"pid": pid}), flush=True)
    _reap(status_dir, block=True)  # the test process is gone: no child stays a zombie


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
