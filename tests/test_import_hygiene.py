"""What importing costs: the protocol and the commands that do not train load no torch, the
serve command is there only with the server, and the volunteer's project holds no server.

Each check runs in a fresh interpreter (this one has torch loaded long ago) and reads
``sys.modules`` there.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from client.cli.support import _TORCH_BOUND_ERRORS
from server.downloads.volunteer_project import VOLUNTEER_PACKAGES, volunteer_pyproject

REPO = Path(__file__).resolve().parents[1]

# run `diloco ARGS` for each ARGS in one interpreter (a start costs more than a command),
# with the modules named in BLOCKED absent, and say after each command which of the heavy
# modules are loaded by then; a marker line on both streams separates the commands
CLI_PROBE = """
import json, sys
blocked, commands = json.loads(sys.argv[1])
for name in blocked:
    sys.modules[name] = None  # `import name` now fails as if it were not installed
HEAVY = ("torch", "fastapi", "sqlalchemy", "server")
from client.cli.main import app
for args in commands:
    try:
        app(args, prog_name="diloco")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    else:
        code = 0
    sys.stdout.flush()
    loaded = [m for m in HEAVY if sys.modules.get(m) is not None]
    print(MARK, file=sys.stdout, flush=True)
    print(MARK + json.dumps({"status": code, "loaded": loaded}), file=sys.stderr, flush=True)
""".replace("MARK", repr("@@probe@@"))


@dataclass
class Ran:
    status: int
    out: str  # stdout and stderr
    loaded: list[str]  # the heavy modules loaded once the command (and those before) ran


def python(code: str, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DILOCO_HOME": str(home), "COLUMNS": "100"}
    for name in ("DILOCO_SERVER", "DILOCO_CONFIG_DIR", "DILOCO_CACHE_DIR"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120, check=False,
    )  # fmt: skip


def diloco(*commands: list[str], home: Path, blocked: tuple[str, ...] = ()) -> list[Ran]:
    """Run the commands one after the other in one fresh interpreter."""
    proc = python(CLI_PROBE, json.dumps([blocked, commands]), home=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = proc.stdout.split("@@probe@@\n")
    errs = proc.stderr.split("@@probe@@")  # [err 0, meta 0 \n err 1, meta 1 \n err 2, ...]
    ran = []
    for i in range(len(commands)):
        err = errs[i].partition("\n")[2] if i else errs[0]
        meta = json.loads(errs[i + 1].partition("\n")[0])
        ran.append(Ran(meta["status"], outs[i] + err, meta["loaded"]))
    return ran


def test_importing_every_module_of_the_protocol_loads_no_torch(tmp_path):
    code = """
import importlib, json, pkgutil, sys
import diloco.protocol
names = [m.name for m in pkgutil.walk_packages(diloco.protocol.__path__, "diloco.protocol.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "torch": "torch" in sys.modules}))
"""
    proc = python(code, home=tmp_path)

    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert {"diloco.protocol.rules", "diloco.protocol.messages"} <= set(found["modules"])
    assert found["torch"] is False


NO_TRAINING = [
    ["--help"],
    ["--version"],
    ["version"],
    ["run", "list", "--help"],
    ["run", "create", "--help"],
    ["run", "rounds", "--help"],
    ["me", "--help"],
    ["register", "--help"],
    ["doctor", "--help"],
    ["join", "--help"],
    ["simulate", "--help"],
    ["data", "--help"],
    ["serve", "--help"],
    ["me", "http://127.0.0.1:9"],  # not registered there: exit 2 before anything is sent
]


def test_the_commands_that_do_not_train_import_no_torch(tmp_path):
    ran = diloco(*NO_TRAINING, home=tmp_path)

    for args, r in zip(NO_TRAINING, ran, strict=True):
        assert r.status == (2 if args[-1].startswith("http") else 0), (args, r.out)
        assert "torch" not in r.loaded, f"diloco {' '.join(args)} imported torch"
    assert "not registered on http://127.0.0.1:9" in ran[-1].out
    assert ran[1].out.strip() == ran[2].out.strip() != ""  # --version and version agree


def test_a_config_is_validated_without_torch(tmp_path):
    """run create reads and checks the config, model shapes included, before it sends it."""
    config = tmp_path / "bad.toml"
    config.write_text('name = "x"\n[model]\nn_embd = 100\nn_head = 3\n[data]\npath = "x.txt"\n')
    create = ["run", "create", str(config), "--server", "http://127.0.0.1:9", "--admin-token", "t"]

    [r] = diloco(create, home=tmp_path)

    assert r.status == 2 and "n_head" in r.out, r.out
    assert "torch" not in r.loaded


def lists_serve(help_text: str) -> bool:
    return any(line.strip("│ ").startswith("serve ") for line in help_text.splitlines())


def test_serve_is_listed_where_the_server_is_installed(tmp_path):
    [r] = diloco(["--help"], home=tmp_path)

    assert r.status == 0 and lists_serve(r.out), r.out
    assert not {"server", "fastapi", "sqlalchemy"} & set(r.loaded)  # found, not imported


@pytest.mark.parametrize("missing", ["server", "fastapi", "sqlalchemy"])
def test_serve_without_the_server_extra_says_how_to_install_it(tmp_path, missing):
    listing, serve = diloco(
        ["--help"], ["serve", "--data-dir", str(tmp_path)], home=tmp_path, blocked=(missing,)
    )

    assert not lists_serve(listing.out), listing.out
    assert serve.status == 2, serve.out
    assert "Traceback" not in serve.out
    [line] = serve.out.strip().splitlines()
    assert line.startswith("error: diloco serve needs the server extra")
    assert missing in line and "pip install '.[server]'" in line


def test_the_exit_codes_name_error_classes_that_exist():
    """cli_support maps errors of torch-bound modules by name: the names must be real."""
    for module, name in (pair for pairs in _TORCH_BOUND_ERRORS.values() for pair in pairs):
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, Exception), (module, name)


def test_the_volunteer_project_is_the_checkout_less_the_server():
    checkout = tomllib.loads((REPO / "pyproject.toml").read_text())
    volunteer = tomllib.loads(volunteer_pyproject((REPO / "pyproject.toml").read_text()))

    packages = volunteer["tool"]["setuptools"]["packages"]
    assert {"client", "diloco", "diloco.protocol"} <= set(packages)
    assert all(p.split(".")[0] in VOLUNTEER_PACKAGES for p in packages), packages
    assert set(packages) == {
        p for p in checkout["tool"]["setuptools"]["packages"] if p.split(".")[0] != "server"
    } - {"migrations", "migrations.versions"}
    mine, theirs = volunteer["project"], checkout["project"]
    for key in ("name", "version", "dependencies", "scripts", "requires-python", "license"):
        assert mine[key] == theirs[key], key
    assert set(mine["optional-dependencies"]) == set(theirs["optional-dependencies"]) - {
        "server",
        "dev",
    }
    assert volunteer["build-system"] == checkout["build-system"]
