"""The one-line volunteer install: ``GET /install.sh``, the client wheel under ``/downloads/``,
``diloco register`` and a bare ``diloco join`` that finds its server in ``client.toml``.

The installer runs for real under ``sh`` (dash on Debian) against a real server: a fresh
virtual environment, torch from the pinned local wheel (``DILOCO_TORCH_SPEC``), the client
from the wheel the server built from these sources.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from server.downloads import wheel as wheel_mod
from server.downloads.router import UnsafePublicURL, render_install_script
from server.downloads.wheel import ClientWheel, WheelUnavailable
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API
from tests.support.live import ServerProcess, admin_headers, wait_for

REPO = Path(__file__).resolve().parents[1]
TORCH_SPEC = "torch==2.13.0"  # the CPU build, installed from a local file here (offline)
# the interpreter the test venv was made from: the pinned torch wheel is built for it
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
# pip's own cache of the real user, so that a run does not download numpy & co again
PIP_CACHE = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")


@dataclass
class Hub:
    server: ServerProcess
    data_dir: Path
    database_url: str

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def hub(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    from tests.support.pg import fresh_database

    with fresh_database(pg_admin_url) as url:
        data_dir = tmp_path_factory.mktemp("hub")
        proc = ServerProcess(data_dir=data_dir, database_url=url)
        try:
            yield Hub(proc.wait_ready(), data_dir, url)
        finally:
            proc.stop()


@pytest.fixture(scope="module")
def http(hub: Hub) -> Iterator[httpx.Client]:
    with hub.server.client(timeout=180) as client:
        yield client


@pytest.fixture
def volunteer_home(tmp_path: Path) -> Iterator[Path]:
    """A HOME for an installed volunteer, deleted afterwards (a venv with torch is ~1 GB)."""
    home = tmp_path / "home"
    home.mkdir()
    yield home
    shutil.rmtree(home, ignore_errors=True)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without DILOCO_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    return env | extra


def installer_env(home: Path, **extra: str) -> dict[str, str]:
    defaults = {
        "HOME": str(home),
        "DILOCO_HOME": str(home / ".diloco"),
        "DILOCO_TORCH_SPEC": TORCH_SPEC,
        "DILOCO_PYTHON": BASE_PYTHON,
        "PIP_CACHE_DIR": PIP_CACHE,
    }
    return clean_env(**(defaults | extra))


def run(
    args: list[str], *, env: dict[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def pipe_installer(
    url: str, home: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``curl -fsSL URL/install.sh | sh -s -- ARGS``, exactly as a volunteer types it."""
    command = 'curl -fsSL "$0/install.sh" | sh -s -- "$@"'
    env = installer_env(home, **(env or {}))
    return run(["sh", "-c", command, url, *args], env=env, timeout=timeout)


def saved_script(http: httpx.Client, tmp_path: Path) -> Path:
    r = http.get("/install.sh")
    assert r.status_code == 200, r.text
    path = tmp_path / "install.sh"
    path.write_text(r.text)
    return path


def diloco(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The repo's ``diloco`` with its files under ``home`` (as the launcher sets it)."""
    env = clean_env(HOME=str(home), DILOCO_HOME=str(home / ".diloco"))
    return run([sys.executable, "-m", "client.cli", *args], env=env, timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------- the acceptance test


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_installer_sets_up_a_volunteer_whose_bare_join_contributes_a_round(
    hub, http, volunteer_home
):
    # Prepare: a run small enough to train a round in seconds
    r = http.post(
        f"{API}/runs",
        data={"config": json.dumps(server_run_config(rounds={"quorum": 1, "max_rounds": 3}))},
        files={"data": ("corpus.txt", make_corpus(60_000).encode(), "text/plain")},
        headers=admin_headers(),
    )
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    home = volunteer_home
    diloco_home = home / ".diloco"

    # Execute: the one-liner
    started = time.monotonic()
    installed = pipe_installer(hub.url, home, "--name", "alice")
    install_s = time.monotonic() - started

    # Assert: a venv, a launcher, credentials and the client's defaults
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert (diloco_home / "venv" / "bin" / "python").exists()
    launcher = diloco_home / "bin" / "diloco"
    assert os.access(launcher, os.X_OK)
    creds = json.loads((diloco_home / "config" / "credentials.json").read_text())
    assert creds[hub.url]["name"] == "alice"
    toml = (diloco_home / "config" / "client.toml").read_text()
    assert f'server = "{hub.url}"' in toml and 'name = "alice"' in toml
    assert f"{launcher} join" in installed.stdout

    # Execute: the installed `diloco join`, no server argument: it comes from client.toml
    started = time.monotonic()
    join_env = clean_env(HOME=str(home), PIP_CACHE_DIR=PIP_CACHE)
    joined = run(
        [str(launcher), "join", "--max-rounds", "1", "--device", "cpu", "--threads", "1"],
        env=join_env,
        timeout=300,
    )
    join_s = time.monotonic() - started

    # Assert: the round was accepted, and alice is on the run's leaderboard
    assert joined.returncode == 0, joined.stdout + joined.stderr
    rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
    assert sum(r["accepted"] for r in rounds) >= 1, rounds
    board = http.get(f"{API}/contributors", params={"run": run_id}).json()["contributors"]
    assert [(c["name"], c["accepted"] >= 1) for c in board] == [("alice", True)], board

    # Execute: the installer again, to upgrade in place, and --start to contribute once more
    started = time.monotonic()
    one_round = {"DILOCO_MAX_ROUNDS": "1", "DILOCO_THREADS": "1", "DILOCO_QUIET": "1"}
    again = pipe_installer(hub.url, home, "--name", "alice", "--start", env=one_round)
    again_s = time.monotonic() - started

    # Assert: same identity, said so; the started join was accepted too
    assert again.returncode == 0, again.stdout + again.stderr
    assert "upgrading" in again.stdout
    assert f"already registered on {hub.url} as alice" in again.stdout
    assert json.loads((diloco_home / "config" / "credentials.json").read_text()) == creds
    board = http.get(f"{API}/contributors", params={"run": run_id}).json()["contributors"]
    assert [(c["name"], c["accepted"]) for c in board] == [("alice", 2)], board
    print(f"\ninstall {install_s:.0f} s, join {join_s:.0f} s, re-install + join {again_s:.0f} s")


# ---------------------------------------------------------------- the script, quickly


def test_the_script_is_served_with_the_server_url_and_parses_under_sh(hub, http, tmp_path):
    r = http.get("/install.sh")

    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/x-shellscript")
    assert r.headers["cache-control"] == "no-store"
    assert f"SERVER_URL='{hub.url}'" in r.text
    assert "@SERVER_URL@" not in r.text and "@VERSION@" not in r.text
    path = saved_script(http, tmp_path)
    checked = run(["sh", "-n", str(path)], env=clean_env(), timeout=30)
    assert checked.returncode == 0, checked.stderr


def test_an_unknown_option_exits_2_with_the_usage(http, tmp_path):
    script = saved_script(http, tmp_path)

    bogus = run(["sh", str(script), "--bogus"], env=installer_env(tmp_path), timeout=30)
    bad_device = run(
        ["sh", str(script), "--device", "gpu"], env=installer_env(tmp_path), timeout=30
    )
    helped = run(["sh", str(script), "--help"], env=installer_env(tmp_path), timeout=30)

    assert bogus.returncode == 2
    assert "unknown option: --bogus" in bogus.stderr and "usage:" in bogus.stderr
    assert bad_device.returncode == 2 and "--device must be" in bad_device.stderr
    assert helped.returncode == 0 and "--reuse-torch" in helped.stdout
    assert not (tmp_path / ".diloco").exists()


def test_a_python_that_does_not_exist_fails_with_a_clear_message(http, tmp_path):
    script = saved_script(http, tmp_path)

    out = run(
        ["sh", str(script), "--name", "x"],
        env=installer_env(tmp_path, DILOCO_PYTHON="/nonexistent"),
        timeout=30,
    )

    assert out.returncode == 1
    assert "DILOCO_PYTHON=/nonexistent is not a Python 3.11 or newer" in out.stderr
    assert not (tmp_path / ".diloco" / "venv").exists()


def test_without_a_usable_python_on_path_the_script_says_how_to_install_one(http, tmp_path):
    script = saved_script(http, tmp_path)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "curl").symlink_to("/usr/bin/curl")
    for name in ("python3", "python3.11"):  # there, but too old or broken
        (stubs / name).write_text("#!/bin/sh\nexit 1\n")
        (stubs / name).chmod(0o755)
    env = installer_env(tmp_path, PATH=str(stubs))
    del env["DILOCO_PYTHON"]

    out = run(["/bin/sh", str(script)], env=env, timeout=30)

    assert out.returncode == 1
    assert "no Python 3.11 or newer with venv found on PATH" in out.stderr
    assert "python3-venv" in out.stderr and "DILOCO_PYTHON" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reuse_torch_takes_the_torch_of_the_chosen_python(hub, http, volunteer_home):
    # Prepare: this test's own venv python, which has torch
    home = volunteer_home
    script = saved_script(http, home)
    env = installer_env(home, DILOCO_PYTHON=sys.executable)

    # Execute
    out = run(["sh", str(script), "--reuse-torch", "--name", "bob"], env=env, timeout=600)

    # Assert: no torch installed into the new venv, and the launcher works
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torch: reusing torch 2." in out.stdout
    venv = home / ".diloco" / "venv"
    assert not list(venv.glob("lib/python*/site-packages/torch"))
    version = run([str(home / ".diloco" / "bin" / "diloco"), "version"], env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.strip(), version.stderr


# ---------------------------------------------------------------- /downloads/


def served_wheel(http: httpx.Client) -> tuple[dict, bytes]:
    listing = http.get("/downloads/")
    assert listing.status_code == 200, listing.text
    [entry] = listing.json()["files"]
    r = http.get(f"/downloads/{entry['filename']}")
    assert r.status_code == 200
    return entry, r.content


def test_downloads_lists_the_wheel_with_the_sha256_of_its_bytes(hub, http):
    entry, body = served_wheel(http)

    assert entry["filename"].startswith("diloco_hub-") and entry["filename"].endswith(".whl")
    assert entry["sha256"] == hashlib.sha256(body).hexdigest()
    assert entry["nbytes"] == len(body)
    assert entry["url"] == f"{hub.url}/downloads/{entry['filename']}"
    checksum = http.get(f"/downloads/{entry['filename']}.sha256")
    assert checksum.status_code == 200
    assert checksum.text == f"{entry['sha256']}  {entry['filename']}\n"


def test_the_wheel_holds_the_client_the_algorithm_and_the_entry_point_and_no_server(http):
    _, body = served_wheel(http)

    with zipfile.ZipFile(io.BytesIO(body)) as z:
        names = set(z.namelist())
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = z.read(entry_points).decode()
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        extras = {
            line.split(":", 1)[1].strip()
            for line in z.read(metadata).decode().splitlines()
            if line.startswith("Provides-Extra:")
        }
    assert {"client/cli/main.py", "client/worker.py", "diloco/model/gpt.py"} <= names
    assert {"diloco/protocol/rules.py", "client/cli/serve.py"} <= names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"client", "diloco"}, tops  # no server/, migrations/ nor dashboard
    assert "server" not in extras and "dev" not in extras
    assert "diloco = client.cli.main:main" in scripts
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_a_range_request_on_the_wheel_gets_206(http):
    entry, body = served_wheel(http)

    r = http.get(f"/downloads/{entry['filename']}", headers={"Range": "bytes=10-109"})

    assert r.status_code == 206
    assert r.content == body[10:110]
    assert r.headers["etag"] == f'"{entry["sha256"]}"'
    assert r.headers["content-range"] == f"bytes 10-109/{len(body)}"


@pytest.mark.parametrize(
    "name", ["diloco_hub-9.9.9-py3-none-any.whl", "nope.tar.gz", "x.whl.sha256", "-rf.whl"]
)
def test_an_unknown_download_is_a_404_json_error(http, name):
    r = http.get(f"/downloads/{name}")

    assert r.status_code == 404
    assert r.json()["error"] == "not_found" and "/downloads/" in r.json()["detail"]


def test_an_odd_host_header_is_not_rendered_into_the_script(http):
    r = http.get("/install.sh", headers={"Host": "evil'x"})

    assert r.status_code == 500
    assert r.json()["error"] == "unsafe_public_url"
    assert "DILOCO_PUBLIC_URL" in r.json()["detail"]


@pytest.mark.parametrize(
    "url",
    ["http://a'b", "http://a b", "ftp://hub", "http://hub/$(id)", "http://hub/`id`", "hub:8000"],
)
def test_urls_unsafe_in_single_quotes_are_refused(url):
    with pytest.raises(UnsafePublicURL):
        render_install_script(url, "0.1.0")


def test_a_plain_url_and_odd_version_render(tmp_path):
    script = render_install_script("https://[::1]:8443/hub", "1.0'; rm -rf /")

    assert "SERVER_URL='https://[::1]:8443/hub'" in script
    assert "HUB_VERSION='unknown'" in script


def second_server(hub: Hub, **settings: str) -> ServerProcess:
    """Another server on the same database and data dir (as a replica would be)."""
    return ServerProcess(data_dir=hub.data_dir, database_url=hub.database_url, **settings)


def test_the_public_url_setting_is_used_and_a_restart_reuses_the_built_wheel(hub, http):
    served_wheel(http)  # the first server has built and cached the wheel
    public = "https://hub.example.org/diloco"
    proc = second_server(hub, public_url=public)
    try:
        with proc.wait_ready().client(timeout=180) as other:
            script = other.get("/install.sh").text
            listing = other.get("/downloads/").json()
        log = proc.output()
    finally:
        proc.stop()

    assert f"SERVER_URL='{public}'" in script
    assert listing["files"][0]["url"].startswith(f"{public}/downloads/diloco_hub-")
    assert "found in" in log and "building the client wheel" not in log, log[-2000:]


def test_an_unsafe_public_url_setting_is_refused_with_a_message_for_the_operator(hub):
    proc = second_server(hub, public_url="http://hub.example.org/'$(id)'")
    try:
        with proc.wait_ready().client() as other:
            r = other.get("/install.sh")
    finally:
        proc.stop()

    assert r.status_code == 500
    assert r.json()["error"] == "unsafe_public_url"
    assert r.json()["detail"].startswith("DILOCO_PUBLIC_URL=")


# ---------------------------------------------------------------- diloco register


def test_register_stores_a_token_and_the_defaults_then_recognises_it(hub, tmp_path):
    first = diloco(
        "register", hub.url, "--name", "bob", "--device", "cpu", "--run", "run_x", home=tmp_path
    )
    again = diloco("register", home=tmp_path)  # the server comes from client.toml

    assert first.returncode == 0, first.stderr
    assert f"registered on {hub.url} as bob" in first.stdout
    assert again.returncode == 0, again.stderr
    assert f"already registered on {hub.url} as bob" in again.stdout
    toml = (tmp_path / ".diloco" / "config" / "client.toml").read_text()
    assert 'device = "cpu"' in toml and 'run = "run_x"' in toml  # kept


def test_a_refused_stored_token_says_how_to_register_again(hub, tmp_path):
    config = tmp_path / ".diloco" / "config"
    config.mkdir(parents=True)
    entry = {"contributor_id": "ctr_000000000000", "name": "eve", "token": "ctr_bogus"}
    (config / "credentials.json").write_text(json.dumps({hub.url: entry}))

    out = diloco("register", hub.url, home=tmp_path)

    assert out.returncode == 4
    assert "was refused by the server" in out.stderr and "credentials.json" in out.stderr


def test_join_without_a_server_anywhere_exits_2_saying_where_to_put_one(tmp_path):
    out = diloco("join", "--max-rounds", "1", home=tmp_path)

    assert out.returncode == 2
    assert "no server given and none configured" in out.stderr


def test_a_broken_client_config_exits_2_naming_the_key(tmp_path):
    config = tmp_path / ".diloco" / "config"
    config.mkdir(parents=True)
    (config / "client.toml").write_text('device = "tpu"\n')

    out = diloco("register", "http://127.0.0.1:9", home=tmp_path)

    assert out.returncode == 2
    assert "client.toml: device must be one of" in out.stderr


# ---------------------------------------------------------------- where the wheel comes from


def fake_project(root: Path, version: str = "0.1.0") -> Path:
    """The smallest source tree that builds a diloco_hub wheel."""
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        f"""[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"
[project]
name = "diloco-hub"
version = "{version}"
[tool.setuptools]
packages = ["client"]
"""
    )
    (root / "README.md").write_text("fake\n")
    (root / "client").mkdir()
    (root / "client" / "__init__.py").write_text("")
    return root


def resolve(source: ClientWheel) -> wheel_mod.Wheel:
    return asyncio.run(source.wait(timeout=120))


def test_a_build_is_cached_by_source_hash_and_reused(tmp_path, monkeypatch):
    src = fake_project(tmp_path / "src")
    first = resolve(ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=None, source_root=src))

    def no_pip(*args: object) -> Path:
        raise AssertionError("rebuilt although the sources did not change")

    monkeypatch.setattr(ClientWheel, "_pip_wheel", no_pip)
    second = resolve(
        ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=None, source_root=src)
    )

    assert first == second
    assert first.path.parent.parent == tmp_path / "downloads"
    assert first.filename == "diloco_hub-0.1.0-py3-none-any.whl"
    assert not list((src).rglob("*.egg-info")) and not (src / "build").exists()


def test_a_failing_build_is_a_503_with_the_reason(tmp_path):
    src = fake_project(tmp_path / "src", version="not a version")
    source = ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=None, source_root=src)

    with pytest.raises(WheelUnavailable, match="building the client wheel failed") as err:
        resolve(source)
    assert err.value.status == 503 and err.value.code == "wheel_unavailable"


def test_a_prebuilt_wheel_of_another_version_is_refused(tmp_path):
    wheel = tmp_path / "diloco_hub-0.0.9-py3-none-any.whl"
    wheel.write_bytes(b"PK")
    source = ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=wheel, source_root=None)

    with pytest.raises(WheelUnavailable, match=r"is version 0\.0\.9 but this server is 0\.1\.0"):
        resolve(source)


def test_a_prebuilt_wheel_is_found_in_a_directory_by_version(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "diloco_hub-0.0.9-py3-none-any.whl").write_bytes(b"old")
    (wheels / "diloco_hub-0.1.0-py3-none-any.whl").write_bytes(b"new")
    source = ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=wheels, source_root=None)

    found = resolve(source)

    assert found.filename == "diloco_hub-0.1.0-py3-none-any.whl"
    assert found.sha256 == hashlib.sha256(b"new").hexdigest() and found.nbytes == 3


def test_an_installed_server_without_a_wheel_says_what_to_set(tmp_path):
    source = ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=None, source_root=None)

    with pytest.raises(WheelUnavailable, match="DILOCO_CLIENT_WHEEL"):
        resolve(source)


def test_the_checkout_is_found_as_the_source_tree():
    assert wheel_mod.find_source_root() == REPO


def test_a_slow_build_is_waited_for_then_reported_as_still_building(tmp_path, monkeypatch):
    src = fake_project(tmp_path / "src")

    def slow(self: ClientWheel, root: Path) -> wheel_mod.Wheel:
        time.sleep(1.5)
        raise wheel_mod._BuildError("too slow")

    monkeypatch.setattr(ClientWheel, "_build", slow)
    source = ClientWheel(data_dir=tmp_path, version="0.1.0", prebuilt=None, source_root=src)

    with pytest.raises(WheelUnavailable, match="still being built"):
        asyncio.run(source.wait(timeout=0.2))
    wait_for(lambda: source._done.is_set(), timeout=10, what="the build thread to finish")


def test_the_docker_image_builds_the_wheel_it_serves():
    text = (REPO / "Dockerfile").read_text()

    built = re.search(r"python -m server\.downloads\.wheel \. (\S+)", text)
    served = re.search(r"DILOCO_CLIENT_WHEEL=(\S+)", text)
    assert built and served and built.group(1) == served.group(1)
