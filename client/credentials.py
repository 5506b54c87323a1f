"""Where the client keeps things: contributor tokens (config dir) and downloads (cache dir).

- Tokens: ``$DILOCO_CONFIG_DIR``, else ``$DILOCO_HOME/config``, else
  ``$XDG_CONFIG_HOME/diloco`` (default ``~/.config/diloco``); file ``credentials.json``,
  one entry per server keyed by its normalised URL, mode 0600, written atomically
  (``diloco.atomic``: temp file, fsync, rename) so a crash never leaves half a file.
- Cache: ``$DILOCO_CACHE_DIR``, else ``$DILOCO_HOME/cache``, else ``$XDG_CACHE_HOME/diloco``
  (default ``~/.cache/diloco``):
  ``runs/<run>/checkpoints/v<version>-<sha256>.safetensors`` and
  ``runs/<run>/shards/<index>-<sha256>.bin``. Content-addressed: a file whose name matches
  the lease's sha256 was verified when it was downloaded and is used as it is.
- ``$DILOCO_HOME`` is the one folder the installer (``GET /install.sh``) puts everything in:
  ``venv/``, ``bin/diloco``, ``config/`` and ``cache/``. The more specific variables win.
  The client config file (``client.toml``, see ``client.config_file``) lives in the config dir.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from client.lease import ProtocolError
from diloco.atomic import atomic_write_text

CREDENTIALS_FILE = "credentials.json"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class CredentialsError(Exception):
    """The credentials file cannot be read or written."""


class ServerURLError(ValueError):
    """A server URL that cannot be used (bad scheme, no host, ...)."""


def _xdg(env_override: str, xdg_var: str, fallback: str, home_sub: str | None = None) -> Path:
    """``$env_override``, else ``$DILOCO_HOME/home_sub`` (when given), else the XDG dir."""
    if override := os.environ.get(env_override):
        return Path(override).expanduser()
    if home_sub and (home := os.environ.get("DILOCO_HOME")):
        return Path(home).expanduser() / home_sub
    base = os.environ.get(xdg_var) or str(Path.home() / fallback)
    return Path(base).expanduser() / "diloco"


def config_dir() -> Path:
    return _xdg("DILOCO_CONFIG_DIR", "XDG_CONFIG_HOME", ".config", "config")


def cache_dir() -> Path:
    return _xdg("DILOCO_CACHE_DIR", "XDG_CACHE_HOME", ".cache", "cache")


def default_data_dir() -> Path:
    """The server's data dir when neither ``--data-dir`` nor ``DILOCO_DATA_DIR`` is given."""
    return _xdg("DILOCO_DATA_DIR", "XDG_DATA_HOME", ".local/share")


def normalize_server_url(url: str) -> str:
    """``HTTP://Host:80/`` → ``http://host``: one key per server, whatever the spelling.

    A missing scheme means http; a trailing ``/`` or ``/api/v1`` is dropped; query and
    fragment are refused (they are never part of a server's address)."""
    text = url.strip()
    if not text:
        raise ServerURLError("the server URL is empty; pass one like http://localhost:8000")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ServerURLError(
            f"server URL {url!r}: the scheme must be http or https, not {scheme!r}"
        )
    if not parts.hostname:
        raise ServerURLError(f"server URL {url!r} has no host; pass one like http://localhost:8000")
    if parts.query or parts.fragment:
        raise ServerURLError(f"server URL {url!r} must not have a query or fragment")
    try:
        port = parts.port
    except ValueError:
        raise ServerURLError(f"server URL {url!r} has an invalid port") from None
    host = parts.hostname.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if port in (None, _DEFAULT_PORTS[scheme]) else f"{host}:{port}"
    path = parts.path.rstrip("/").removesuffix("/api/v1").rstrip("/")
    return f"{scheme}://{netloc}{path}"


@dataclass(frozen=True)
class Credentials:
    contributor_id: str
    name: str
    token: str


def _read_all(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CredentialsError(
            f"cannot read {path}: {err}; fix or delete it (you will register again)"
        ) from err
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise CredentialsError(
            f"{path} is not a map of server URL to credentials; fix or delete it"
        )
    return data


def load_credentials(server_url: str, directory: Path | None = None) -> Credentials | None:
    """The stored credentials for this server, or None when none were ever stored."""
    path = (directory or config_dir()) / CREDENTIALS_FILE
    entry = _read_all(path).get(normalize_server_url(server_url))
    if entry is None:
        return None
    try:
        return Credentials(
            contributor_id=str(entry["contributor_id"]),
            name=str(entry["name"]),
            token=str(entry["token"]),
        )
    except KeyError as err:
        raise CredentialsError(
            f"{path}: the entry for {server_url} lacks {err}; delete that entry to register again"
        ) from None


def save_credentials(server_url: str, creds: Credentials, directory: Path | None = None) -> Path:
    """Store ``creds`` for this server (other servers' entries are kept); returns the file."""
    directory = directory or config_dir()
    path = directory / CREDENTIALS_FILE
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = _read_all(path)
        data[normalize_server_url(server_url)] = asdict(creds)
        with atomic_write_text(path, permissions=0o600) as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
    except OSError as err:
        raise CredentialsError(f"cannot write {path}: {err}") from err
    return path


def _safe(part: str, what: str) -> str:
    """A server-supplied name used in a path: refuse anything that could leave the cache."""
    if not _SAFE_NAME.fullmatch(part) or part in (".", ".."):
        raise ProtocolError(f"the server sent a {what} {part!r} that is not a safe file name")
    return part


def _sha(sha256: str) -> str:
    if not _SHA256.fullmatch(sha256):
        raise ProtocolError(f"the server sent {sha256!r} as a sha256; expected 64 lowercase hex")
    return sha256


def run_cache_dir(run_id: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "runs" / _safe(run_id, "run id")


def checkpoint_path(run_id: str, version: int, sha256: str, root: Path | None = None) -> Path:
    return run_cache_dir(run_id, root) / "checkpoints" / f"v{version}-{_sha(sha256)}.safetensors"


def shard_path(run_id: str, index: int, sha256: str, root: Path | None = None) -> Path:
    return run_cache_dir(run_id, root) / "shards" / f"{index}-{_sha(sha256)}.bin"


def prune_checkpoints(run_id: str, version: int, root: Path | None = None) -> list[Path]:
    """Delete the run's checkpoints older than ``version − 1``: a volunteer needs only the
    newest, and one before it in case another worker sharing the cache is still on it."""
    removed = []
    for old in (run_cache_dir(run_id, root) / "checkpoints").glob("v*-*.safetensors"):
        stem = old.name.removeprefix("v").split("-", 1)[0]
        if stem.isdigit() and int(stem) < version - 1:
            old.unlink(missing_ok=True)
            removed.append(old)
    return removed
