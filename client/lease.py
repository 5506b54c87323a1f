"""Reading the server's answers: the shared messages (``diloco.protocol.messages``: the
lease ``POST /runs/{id}/join`` hands a volunteer, the receipt of an upload...), checked.

Parsing is strict: a missing field or one of the wrong type raises :class:`ProtocolError`
naming the field, instead of an obscure ``KeyError`` rounds later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from diloco.protocol.messages import Lease

__all__ = ["Lease", "ProtocolError", "parse", "parse_lease", "require"]

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


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], data: Any, where: str) -> M:
    """``data`` as one of the shared messages (``diloco.protocol.messages``), or a
    :class:`ProtocolError` that names each missing or mistyped field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            *parents, name = [str(p) for p in e["loc"]] or ["?"]
            place = " ".join([where, *parents])
            if e["type"] == "missing":
                problems.append(f"{place} lacks the field {name!r}")
            else:
                got = e.get("input")
                problems.append(
                    f"{place} field {name!r}: {e['msg']} (got {type(got).__name__} {got!r})"
                )
        raise ProtocolError(
            "; ".join(problems) + "; the server may run another version of DiLoCo Hub than "
            "this client: upgrade the client (pip install -U diloco-hub)"
        ) from None


def parse_lease(data: Any) -> Lease:
    return parse(Lease, data, "the join answer (lease)")
