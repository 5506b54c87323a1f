"""What a request may carry, bounded so that the database never sees a value it would refuse.

Postgres refuses an ``integer`` beyond 2^31-1, a NUL byte in any text or JSONB value, and
invalid UTF-8; a refusal there would be our 500, not the caller's mistake. So every value
that reaches a column is checked here first and a bad one is ``422 invalid_request`` naming
it. The path and query parameter types below are shared by the routers; request bodies use
the same bounds (``HeartbeatIn``, ``Hardware``, the run config in ``diloco.config``).

Run ids: a well-formed id that names no run is ``404 run_not_found``; a malformed one (a
control character, or longer than the 32 characters of ``runs.id``) is ``422
invalid_request``, whichever endpoint it is sent to.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Path, Query

from diloco.config import INT32_MAX, NO_CONTROL_CHARS
from diloco.config import error_message as config_error_message
from server.http.errors import BodyTooLarge, HubError, InvalidRequest

RUN_ID_CHARS = 32  # runs.id is varchar(32): ids are run_<12 hex>
_NO_CONTROL = re.compile(NO_CONTROL_CHARS)
_VERSION = r"^(latest|[0-9]{1,10})$"  # ASCII digits only: "¹".isdigit() is True in Python

RunId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=RUN_ID_CHARS,
        pattern=NO_CONTROL_CHARS,
        description="a run id (`run_<12 hex>`); an unknown one is 404 `run_not_found`",
    ),
]
ContributorId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=RUN_ID_CHARS,  # contributors.id is varchar(32) too: ctr_<12 hex>
        pattern=NO_CONTROL_CHARS,
        description="a contributor id (`ctr_<12 hex>`); an unknown one is 404 `not_found`",
    ),
]
RunFilter = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=RUN_ID_CHARS,
        pattern=NO_CONTROL_CHARS,
        description="a run id: only that run's contributors and figures",
    ),
]
OwnerFilter = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=RUN_ID_CHARS,
        pattern=NO_CONTROL_CHARS,
        description="a contributor id: only the runs that run owner created",
    ),
]
RoundIndex = Annotated[int, Path(ge=1, le=INT32_MAX, description="a round index, counted from 1")]
ShardIndex = Annotated[int, Path(ge=0, le=INT32_MAX, description="a shard index, from 0")]
CheckpointVersion = Annotated[
    str,
    Path(
        pattern=_VERSION,
        description=f"a version number (ASCII digits, at most {INT32_MAX}) or `latest`",
    ),
]


# what a pattern of ours means, for a 422 that a person can read
_PATTERN_WORDS = {_VERSION: "must be a version number (ASCII digits) or 'latest'"}


def error_message(error: Any) -> str:
    """A validation error's message, in words where pydantic would quote our pattern."""
    pattern = (error.get("ctx") or {}).get("pattern")
    if error.get("type") == "string_pattern_mismatch" and pattern in _PATTERN_WORDS:
        return _PATTERN_WORDS[pattern]
    return config_error_message(error)


def checkpoint_version(version: str) -> int | None:
    """``latest`` → None, else the number; a number past any version is 422."""
    if version == "latest":
        return None
    if not version.isascii() or not version.isdigit() or int(version) > INT32_MAX:
        raise InvalidRequest(
            f"version: {version!r} is neither a version number (0..{INT32_MAX}) nor 'latest'"
        )
    return int(version)


def check_text(value: str, *, what: str, max_length: int) -> str:
    """``value`` if it is 1..max_length characters of UTF-8 text without control characters
    (nor the lone surrogates Python lets a str hold), else 422."""
    if not 1 <= len(value) <= max_length or not _NO_CONTROL.match(value) or _surrogates(value):
        raise InvalidRequest(
            f"{what}: must be 1 to {max_length} characters without control characters"
        )
    return value


def _surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def declared_length(
    content_length: str | None,
    *,
    limit: int,
    what: str,
    too_large: type[HubError] = BodyTooLarge,
) -> int | None:
    """A request's declared body size (its Content-Length), None when it declares none.
    Checked before a byte of the body is read: not ASCII digits is ``422
    invalid_request``, over ``limit`` is ``413`` (``too_large``: ``body_too_large``, or
    ``upload_too_large`` for the uploads that say so), which clients and proxies act on."""
    if content_length is None:
        return None
    if not (content_length.isascii() and content_length.isdigit()):  # "¹".isdigit() is True
        raise InvalidRequest(f"Content-Length: {content_length!r} is not a number of bytes")
    declared = int(content_length)
    if declared > limit:
        raise too_large(f"{declared} bytes is over {what}'s {limit}-byte limit")
    return declared
