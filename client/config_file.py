"""The volunteer's defaults: ``client.toml`` in the config dir (``credentials.config_dir()``).

Written by ``diloco register`` (and so by the installer), read by ``diloco join`` when its
arguments are not given. Command-line flags and ``DILOCO_*`` variables always win::

    server = "http://hub.example.org:8000"   # normalised like every server URL
    name = "alice"                           # registration name (first use only)
    device = "cuda"                          # auto | cpu | cuda | mps
    run = "run_0123456789ab"                 # which run to join (default: the newest active)

Every key is optional; unknown keys and wrong types are refused, naming the file and key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from client.credentials import ServerURLError, config_dir, normalize_server_url
from diloco.atomic import atomic_write_text

CLIENT_CONFIG_FILE = "client.toml"
DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass(frozen=True)
class ClientConfig:
    server: str | None = None  # normalised with credentials.normalize_server_url
    name: str | None = None
    device: str | None = None  # auto | cpu | cuda | mps
    run: str | None = None


class ClientConfigError(Exception):
    """``client.toml`` cannot be read, or holds a key or value the client does not take."""


_KEYS = tuple(f.name for f in fields(ClientConfig))
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _check(path: Path, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ClientConfigError(
            f"{path}: {key} must be a string, not {type(value).__name__} ({value!r})"
        )
    if not value.strip():
        raise ClientConfigError(f"{path}: {key} must not be empty; remove the line instead")
    if key == "server":
        try:
            return normalize_server_url(value)
        except ServerURLError as err:
            raise ClientConfigError(f"{path}: server: {err}") from None
    if key == "device" and value not in DEVICES:
        raise ClientConfigError(
            f"{path}: device must be one of {', '.join(DEVICES)}, not {value!r}"
        )
    return value


def load_client_config(directory: Path | None = None) -> ClientConfig:
    """``<config dir>/client.toml``; a missing file is an empty config."""
    path = (directory or config_dir()) / CLIENT_CONFIG_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ClientConfig()
    except (OSError, UnicodeDecodeError) as err:
        raise ClientConfigError(f"cannot read {path}: {err}") from err
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ClientConfigError(f"{path} is not valid TOML: {err}") from None
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ClientConfigError(
            f"{path}: unknown key {unknown[0]!r}; the keys are {', '.join(_KEYS)}"
        )
    return ClientConfig(**{key: _check(path, key, value) for key, value in raw.items()})


def toml_string(value: str) -> str:
    """``value`` as a TOML basic string: quotes, backslashes and control characters escaped,
    everything else (unicode included) as it is."""
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def save_client_config(cfg: ClientConfig, directory: Path | None = None) -> Path:
    """Write ``cfg`` (keys that are None are left out) atomically; returns the file."""
    directory = directory or config_dir()
    path = directory / CLIENT_CONFIG_FILE
    lines = [
        "# diloco client defaults; flags and DILOCO_* variables win. See `diloco join --help`."
    ]
    for key in _KEYS:
        value = getattr(cfg, key)
        if value is not None:
            lines.append(f"{key} = {toml_string(_check(path, key, value))}")
    text = "\n".join(lines) + "\n"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with atomic_write_text(path) as f:
            f.write(text)
    except (OSError, UnicodeEncodeError) as err:
        raise ClientConfigError(f"cannot write {path}: {err}") from err
    return path
