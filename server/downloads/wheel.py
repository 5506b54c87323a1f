"""The client wheel the server hands to volunteers: the server's own code and version, less
the server (``server.downloads.volunteer_project``: the client and the algorithm only).

Where it comes from, the first that applies:

1. ``DILOCO_CLIENT_WHEEL``: a prebuilt ``diloco_hub-<version>-*.whl``, or a directory
   holding one (the Docker image builds one). Another version than the server's is refused.
2. The source tree the server runs from (a checkout: a ``pyproject.toml`` of diloco-hub
   next to the ``server`` package). The volunteer's files are copied to a temp dir (the tree
   is never written to), hashed, and built with ``pip wheel --no-deps --no-build-isolation``; the
   wheel is kept under ``<data_dir>/downloads/<sha256 of the sources>/`` so a restart with
   unchanged sources serves it at once.
3. Neither: unavailable, and the answer says what the operator can set.

Nothing is built until the first request for the installer or a download (most servers
never serve one, and a build costs seconds of CPU); the build runs in a thread and
requests wait for it, for a bounded time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from diloco.atomic import atomic_write, fsync_dir
from diloco.protocol.messages import ErrorCode
from server.downloads import volunteer_project
from server.http.errors import HubError

log = logging.getLogger("diloco.server.downloads")

# part of the cache key: change it when the build changes (v2: the volunteer's packages only)
BUILD_RECIPE = b"pip-wheel-v2"
BUILD_TIMEOUT_S = 300.0
RETRY_FAILED_AFTER_S = 60.0  # a failed build is tried again by a request after this long
KEEP_CACHED = 3  # source hashes whose wheels are kept under <data_dir>/downloads/
_HEX64 = re.compile(r"[0-9a-f]{64}")


class WheelUnavailable(HubError):
    status = 503
    code = ErrorCode.WHEEL_UNAVAILABLE


class _BuildError(Exception):
    """Why there is no wheel: a sentence for the answer (pip's output goes to the log)."""


@dataclass(frozen=True)
class Wheel:
    path: Path
    sha256: str
    nbytes: int

    @property
    def filename(self) -> str:
        return self.path.name

    @classmethod
    def of(cls, path: Path) -> Wheel:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return cls(path=path, sha256=digest.hexdigest(), nbytes=path.stat().st_size)


def find_source_root() -> Path | None:
    """The checkout the server runs from, or None when it runs from an installed package."""
    root = Path(__file__).resolve().parents[2]
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    name = project.get("project", {}).get("name") if isinstance(project, dict) else None
    return root if name == "diloco-hub" else None


def tree_sha256(root: Path) -> str:
    """One hash over every file under ``root``: relative path, size and bytes, in order."""
    digest = hashlib.sha256(BUILD_RECIPE)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix().encode()
        digest.update(b"%s\0%d\0" % (rel, path.stat().st_size))
        digest.update(path.read_bytes())
    return digest.hexdigest()


def wheel_version(filename: str) -> str:
    """``diloco_hub-0.1.0-py3-none-any.whl`` → ``0.1.0``."""
    parts = filename.removesuffix(".whl").split("-")
    return parts[1] if len(parts) >= 3 else ""


class ClientWheel:
    """The wheel to serve, built at most once per source state; thread-safe."""

    def __init__(
        self, *, data_dir: Path, version: str, prebuilt: Path | None, source_root: Path | None
    ) -> None:
        self.cache_root = data_dir / "downloads"
        self.version = version
        self.prebuilt = prebuilt
        self.source_root = source_root
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._wheel: Wheel | None = None
        self._error: str | None = None
        self._failed_at = 0.0

    def start(self) -> None:
        """Start resolving the wheel in a thread unless it is ready, underway, or failed
        less than ``RETRY_FAILED_AFTER_S`` ago."""
        with self._lock:
            if self._wheel is not None or (self._thread and self._thread.is_alive()):
                return
            if self._error and time.monotonic() - self._failed_at < RETRY_FAILED_AFTER_S:
                return
            self._error = None
            self._done.clear()
            self._thread = threading.Thread(target=self._run, name="client-wheel", daemon=True)
            self._thread.start()

    async def wait(self, timeout: float) -> Wheel:
        """The wheel, once resolved; ``WheelUnavailable`` with the reason otherwise."""
        self.start()
        deadline = time.monotonic() + timeout
        while not self._done.is_set():
            if time.monotonic() > deadline:
                raise WheelUnavailable(
                    f"the client wheel is still being built after {timeout:.0f} s; retry in a "
                    "minute (the server log says how the build is going)",
                    retry_after_s=30,
                )
            await asyncio.sleep(0.1)
        with self._lock:
            if self._wheel is not None:
                return self._wheel
            raise WheelUnavailable(self._error or "the client wheel is not available")

    def _run(self) -> None:
        try:
            wheel = self._resolve()
        except _BuildError as err:
            with self._lock:
                self._error, self._failed_at = str(err), time.monotonic()
        except Exception as err:  # a bug or an odd filesystem: say so rather than hang
            log.exception("resolving the client wheel failed")
            with self._lock:
                self._error = f"the client wheel could not be prepared: {err!r}"
                self._failed_at = time.monotonic()
        else:
            with self._lock:
                self._wheel = wheel
            log.info("serving the client wheel %s (sha256 %s)", wheel.filename, wheel.sha256)
        finally:
            self._done.set()

    # ---------------------------------------------------------------- where it comes from

    def _resolve(self) -> Wheel:
        if self.prebuilt is not None:
            return self._prebuilt(self.prebuilt)
        if self.source_root is None:
            raise _BuildError(
                "this server runs from an installed package, not a source checkout, so it "
                "cannot build the client wheel; the operator should set DILOCO_CLIENT_WHEEL to "
                f"a diloco_hub-{self.version}-py3-none-any.whl (python -m server.downloads.wheel "
                "CHECKOUT DIR builds one)"
            )
        return self._build(self.source_root)

    def _prebuilt(self, path: Path) -> Wheel:
        if path.is_dir():
            found = sorted(path.glob(f"diloco_hub-{self.version}-*.whl"))
            if not found:
                raise _BuildError(
                    f"DILOCO_CLIENT_WHEEL={path} holds no diloco_hub-{self.version}-*.whl; the "
                    "operator should build one there (python -m server.downloads.wheel "
                    "CHECKOUT DIR)"
                )
            path = found[0]
        name = path.name
        if not (name.startswith("diloco_hub-") and name.endswith(".whl")) or not path.is_file():
            raise _BuildError(
                f"DILOCO_CLIENT_WHEEL={path} is not a diloco_hub-*.whl file; the operator "
                "should point it at the wheel built from this server's sources"
            )
        if wheel_version(name) != self.version:
            raise _BuildError(
                f"DILOCO_CLIENT_WHEEL={path} is version {wheel_version(name)} but this server "
                f"is {self.version}; the operator should point it at the matching wheel"
            )
        return Wheel.of(path)

    def _build(self, root: Path) -> Wheel:
        with tempfile.TemporaryDirectory(prefix="diloco-wheel-") as tmp:
            src, out = Path(tmp) / "src", Path(tmp) / "out"
            src.mkdir()
            volunteer_project.stage(root, src)
            digest = tree_sha256(src)
            cache = self.cache_root / digest
            cached = sorted(cache.glob("diloco_hub-*.whl")) if cache.is_dir() else []
            if cached:
                log.info("client wheel for sources %s… found in %s", digest[:12], cache)
                return Wheel.of(cached[0])
            log.info("building the client wheel from %s (sources %s…)", root, digest[:12])
            built = self._pip_wheel(src, out)
            return Wheel.of(self._publish(built, cache))

    def _pip_wheel(self, src: Path, out: Path) -> Path:
        args = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        args += ["--no-input", "-w", str(out), str(src)]
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        started = time.monotonic()
        try:
            proc = subprocess.run(
                args,
                cwd=src,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise _BuildError(
                f"building the client wheel took more than {BUILD_TIMEOUT_S:.0f} s and was "
                "stopped; the operator should build one (python -m server.downloads.wheel "
                "CHECKOUT DIR) and set "
                "DILOCO_CLIENT_WHEEL"
            ) from None
        output = (proc.stdout + proc.stderr).strip()
        wheels = sorted(out.glob("diloco_hub-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            log.error("pip wheel failed (exit %s):\n%s", proc.returncode, output)
            last = output.splitlines()[-1] if output else "no output"
            raise _BuildError(
                f"building the client wheel failed (pip exit {proc.returncode}: {last}); the "
                "server log has pip's output. The server needs pip, setuptools>=77 and wheel "
                "(pip install 'diloco-hub[server]'), or DILOCO_CLIENT_WHEEL set to a built wheel"
            )
        log.info("built %s in %.1f s", wheels[0].name, time.monotonic() - started)
        if wheel_version(wheels[0].name) != self.version:
            log.warning(
                "the sources say version %s but the server runs as %s; serving the sources' "
                "wheel (reinstall the server to make them agree)",
                wheel_version(wheels[0].name),
                self.version,
            )
        return wheels[0]

    def _publish(self, built: Path, cache: Path) -> Path:
        """Move the wheel into ``cache`` atomically: a directory rename, so another server
        on the same data dir sees either nothing or the whole wheel."""
        self.cache_root.mkdir(parents=True, exist_ok=True)
        staging = self.cache_root / f".staging-{secrets.token_hex(6)}"
        staging.mkdir()
        try:
            with open(built, "rb") as src, atomic_write(staging / built.name) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            try:
                os.rename(staging, cache)
            except OSError:
                if not any(cache.glob("diloco_hub-*.whl")):
                    raise
                # another process published the same sources first: serve theirs
            else:
                fsync_dir(self.cache_root)  # the rename itself survives a crash
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._prune(keep=cache)
        return cache / built.name

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``KEEP_CACHED`` source hashes' wheels (and always ``keep``)."""
        dirs = [d for d in self.cache_root.iterdir() if d.is_dir() and _HEX64.fullmatch(d.name)]
        dirs.sort(key=lambda d: d.stat().st_mtime, reverse=True)
        for old in dirs[KEEP_CACHED:]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``python -m server.downloads.wheel CHECKOUT OUT_DIR``: build the volunteer wheel that
    ``DILOCO_CLIENT_WHEEL`` can name (the Docker image does this once)."""
    if len(argv) != 2:
        print("usage: python -m server.downloads.wheel CHECKOUT OUT_DIR", file=sys.stderr)
        return 2
    root, out = Path(argv[0]).resolve(), Path(argv[1])
    version = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    with tempfile.TemporaryDirectory(prefix="diloco-wheel-") as tmp:
        source = ClientWheel(
            data_dir=Path(tmp), version=version["version"], prebuilt=None, source_root=root
        )
        try:
            built = source._build(root)
        except _BuildError as err:
            print(err, file=sys.stderr)
            return 1
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built.path, out / built.filename)
    print(out / built.filename)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
