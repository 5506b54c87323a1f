"""The lease ``POST /runs/{id}/join`` hands a volunteer (``docs/api.md``), parsed and checked.

Parsing is strict: a missing field or one of the wrong type raises :class:`ProtocolError`
naming the field, instead of an obscure ``KeyError`` rounds later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

T = TypeVar("T")


class ProtocolError(Exception):
    """The server answered something this client does not understand (another version?)."""


def require(data: Mapping[str, Any], key: str, kind: type[T], where: str) -> T:
    """``data[key]`` if present and of type ``kind`` (an int is accepted as a float)."""
    if not isinstance(data, Mapping):
        raise ProtocolError(f"{where} is not a JSON object; is the server a DiLoCo Hub server?")
    if key not in data:
        raise ProtocolError(
            f"{where} lacks the field {key!r}; the server may run another version of "
            "DiLoCo Hub than this client: upgrade the client (pip install -U diloco-hub)"
        )
    value = data[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(
            f"{where} field {key!r} should be {kind.__name__}, got {type(value).__name__} "
            f"({value!r}); the server may run another version of DiLoCo Hub than this client"
        )
    return value


def _time(data: Mapping[str, Any], key: str, where: str) -> datetime:
    text = require(data, key, str, where)
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise ProtocolError(f"{where} field {key!r} is not an ISO 8601 time: {text!r}") from None


@dataclass(frozen=True)
class CheckpointRef:
    version: int
    url: str
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class ShardRef:
    index: int
    url: str
    sha256: str
    nbytes: int
    chunk_len: int  # the shard is uint8 tokens, row-major (nbytes / chunk_len, chunk_len)


@dataclass(frozen=True)
class Lease:
    lease_id: str
    run_id: str
    round: int
    base_version: int  # the checkpoint version to start from (round − 1)
    checkpoint: CheckpointRef
    shard: ShardRef
    config: dict[str, Any]  # the run config, the same structure as the TOML file
    inner_steps: int  # H
    start_step: int  # the global inner step that indexes the lr schedule
    seed: int  # seeds this lease's batch sampling
    deadline: datetime
    lease_expires_at: datetime
    heartbeat_interval_s: float
    max_upload_bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Lease:
        where = "the join answer (lease)"
        ckpt = require(data, "checkpoint", dict, where)
        shard = require(data, "shard", dict, where)
        cw, sw = f"{where} checkpoint", f"{where} shard"
        return cls(
            lease_id=require(data, "lease_id", str, where),
            run_id=require(data, "run_id", str, where),
            round=require(data, "round", int, where),
            base_version=require(data, "base_version", int, where),
            checkpoint=CheckpointRef(
                version=require(ckpt, "version", int, cw),
                url=require(ckpt, "url", str, cw),
                sha256=require(ckpt, "sha256", str, cw),
                nbytes=require(ckpt, "nbytes", int, cw),
            ),
            shard=ShardRef(
                index=require(shard, "index", int, sw),
                url=require(shard, "url", str, sw),
                sha256=require(shard, "sha256", str, sw),
                nbytes=require(shard, "nbytes", int, sw),
                chunk_len=require(shard, "chunk_len", int, sw),
            ),
            config=require(data, "config", dict, where),
            inner_steps=require(data, "inner_steps", int, where),
            start_step=require(data, "start_step", int, where),
            seed=require(data, "seed", int, where),
            deadline=_time(data, "deadline", where),
            lease_expires_at=_time(data, "lease_expires_at", where),
            heartbeat_interval_s=require(data, "heartbeat_interval_s", float, where),
            max_upload_bytes=require(data, "max_upload_bytes", int, where),
        )
