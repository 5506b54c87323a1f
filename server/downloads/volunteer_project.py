"""The volunteer's project: what the wheel under ``/downloads/`` is built from.

A volunteer needs the client and the algorithm, never the server, its migrations or the
dashboard. The checkout's ``pyproject.toml`` lists every package (a server installs them
all); the volunteer's is derived from it here, so that the name, version, dependencies and
entry point are written once: the same ``[project]`` less the extras that only make sense
with the server (``server``, ``dev``), and only the packages under ``client`` and
``diloco``. ``stage`` lays such a source tree out for ``pip wheel``.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

VOLUNTEER_PACKAGES = ("client", "diloco")  # top-level packages the volunteer wheel holds
SERVER_ONLY_EXTRAS = ("server", "dev")
TOP_FILES = ("pyproject.toml", "README.md")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.py[co]", "*.egg-info", ".*")


def _is_volunteer_package(name: str) -> bool:
    return name.split(".")[0] in VOLUNTEER_PACKAGES


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's string escapes are TOML's basic-string escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML spelling here for {type(value).__name__}")


def _toml_table(name: str, table: dict[str, Any]) -> list[str]:
    """``[name]`` with its values, then its sub-tables (``[name.key]``), recursively."""
    lines = [f"[{name}]"]
    lines += [
        f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)
    ]
    for key, sub in table.items():
        if isinstance(sub, dict):
            lines += ["", *_toml_table(f"{name}.{json.dumps(key)}", sub)]
    return lines


def volunteer_pyproject(checkout_pyproject: str) -> str:
    """The checkout's ``pyproject.toml`` text, restricted to what a volunteer installs."""
    doc = tomllib.loads(checkout_pyproject)
    project = dict(doc["project"])
    extras = project.get("optional-dependencies")
    if isinstance(extras, dict):
        project["optional-dependencies"] = {
            k: v for k, v in extras.items() if k not in SERVER_ONLY_EXTRAS
        }
    found = doc.get("tool", {}).get("setuptools", {})
    setuptools: dict[str, Any] = {
        "packages": [p for p in found.get("packages", []) if _is_volunteer_package(p)]
    }
    for key in ("package-dir", "package-data"):
        kept = {k: v for k, v in found.get(key, {}).items() if _is_volunteer_package(k)}
        if kept:
            setuptools[key] = kept
    tables = [
        _toml_table("build-system", doc["build-system"]),
        _toml_table("project", project),
        _toml_table("tool.setuptools", setuptools),
    ]
    return "\n\n".join("\n".join(t) for t in tables) + "\n"


def stage(root: Path, dest: Path) -> None:
    """Copy the volunteer's sources from the checkout ``root`` into the empty ``dest``, with
    the derived ``pyproject.toml``."""
    for name in TOP_FILES:
        shutil.copy2(root / name, dest / name)
    (dest / "pyproject.toml").write_text(
        volunteer_pyproject((root / "pyproject.toml").read_text(encoding="utf-8")),
        encoding="utf-8",
    )
    for name in VOLUNTEER_PACKAGES:
        if (root / name).is_dir():
            shutil.copytree(root / name, dest / name, ignore=_IGNORE)
