"""The JSON the server and volunteers exchange: one definition that both sides import.

The server returns these models from its routes (so its OpenAPI is generated from them) and
the client parses the server's answers with them, so a field renamed on one side fails the
other's tests instead of failing volunteers in the field. ``ErrorCode`` lists every
``error`` value the server answers with; clients branch on it, never on the sentence.

Parsing is lenient about fields it does not know (an older client keeps working with a
newer server that adds fields) and strict about the ones it does (a missing or mistyped
field is an error that names it).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from annotated_types import MaxLen
from pydantic import BaseModel, ConfigDict, Field

from diloco.config import NO_CONTROL_CHARS


class ErrorCode(StrEnum):
    """Every ``error`` value of an error answer; docs/api.md says when each is sent."""

    # a body the web framework cannot parse at all (400), a status it answers by itself
    BAD_REQUEST = "bad_request"
    HTTP_ERROR = "http_error"
    # the upload body itself (400)
    MALFORMED_UPLOAD = "malformed_upload"
    NON_FINITE = "non_finite"
    WRONG_TENSORS = "wrong_tensors"
    WRONG_CODEC = "wrong_codec"
    HEADER_MISMATCH = "header_mismatch"
    # who you are (401, 403)
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    BANNED = "banned"  # 403: an admin banned this contributor; the detail names the reason
    NOT_INVITED = "not_invited"  # 403: joining a private run needs its invite code first
    INVALID_INVITE = "invalid_invite"  # 403: not the private run's current invite code
    BANNED_FROM_RUN = "banned_from_run"  # 403: the run's owner banned this contributor from it
    NOT_RUN_OWNER = "not_run_owner"  # 403: managing a run needs its owner's or the admin token
    QUOTA_EXCEEDED = "quota_exceeded"  # 403: past the run owner's quota; the detail names it
    # what you named (404, 405)
    NOT_FOUND = "not_found"
    RUN_NOT_FOUND = "run_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    GONE = "gone"  # 410: a version whose files retention deleted (its row stays)
    # the round's and the run's state (409)
    ROUND_CLOSED = "round_closed"
    ROUND_CLOSING = "round_closing"
    BASE_VERSION_MISMATCH = "base_version_mismatch"
    DUPLICATE_CONTRIBUTION = "duplicate_contribution"
    REPLAYED_UPLOAD = "replayed_upload"
    NO_LEASE = "no_lease"
    RUN_NOT_ACTIVE = "run_not_active"
    ALREADY_CONTRIBUTED = "already_contributed"
    INVALID_TRANSITION = "invalid_transition"
    # hostile or broken traffic: a request that stalls (408), too many uploads at once
    # (429, with Retry-After), a request head over the server's cap (431)
    REQUEST_TIMEOUT = "request_timeout"
    TOO_MANY_UPLOADS = "too_many_uploads"
    HEADER_TOO_LARGE = "header_too_large"
    # sizes and ranges (411, 413, 416)
    LENGTH_REQUIRED = "length_required"
    UPLOAD_TOO_LARGE = "upload_too_large"
    BODY_TOO_LARGE = "body_too_large"
    RANGE_NOT_SATISFIABLE = "range_not_satisfiable"
    # validation (422)
    INVALID_CONFIG = "invalid_config"
    MODEL_TOO_LARGE = "model_too_large"
    INVALID_REQUEST = "invalid_request"
    INVALID_DATA = "invalid_data"
    # too many requests from one address (429, with Retry-After)
    RATE_LIMITED = "rate_limited"
    # ours (500, 503)
    INTERNAL = "internal"
    UNSAFE_PUBLIC_URL = "unsafe_public_url"
    UNAVAILABLE = "unavailable"
    # 503, with Retry-After: a version published with its delta whose parameters file is not
    # yet durable (a returning volunteer catches up by the delta meanwhile)
    CHECKPOINT_PENDING = "checkpoint_pending"
    WHEEL_UNAVAILABLE = "wheel_unavailable"
    STORAGE_FAILED = "storage_failed"


# the schema of every error answer in the server's OpenAPI (server.http.openapi)
class ErrorBody(BaseModel):
    """Every error answer: a stable code, a sentence a person can act on, and sometimes more
    fields (``current_round``, ``status``, ``retry_after_s``, ``expected``...)."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="a stable code: branch on this")
    detail: str = Field(description="a sentence a person can act on")


_Count = Annotated[int, Field(ge=0, le=1 << 62)]


class Hardware(BaseModel):
    """What a volunteer client reports about its machine (``PATCH /contributors/me``); every
    field optional, every string bounded (they end up on the dashboard)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    device: str | None = Field(None, max_length=16, pattern=NO_CONTROL_CHARS)  # cuda|mps|cpu
    device_name: str | None = Field(None, max_length=128, pattern=NO_CONTROL_CHARS)
    memory_bytes: _Count | None = None  # memory of the training device
    ram_bytes: _Count | None = None
    cpu_count: int | None = Field(None, ge=0, le=4096)
    os: str | None = Field(None, max_length=128, pattern=NO_CONTROL_CHARS)
    python: str | None = Field(None, max_length=32, pattern=NO_CONTROL_CHARS)
    torch: str | None = Field(None, max_length=64, pattern=NO_CONTROL_CHARS)
    client_version: str | None = Field(None, max_length=32, pattern=NO_CONTROL_CHARS)

    @classmethod
    def clipped(cls, values: Mapping[str, Any]) -> Hardware:
        """The report of what a machine says about itself: unknown (None) values left out,
        each string cut to its field's bound (a long GPU name is not a reason to refuse)."""
        kept: dict[str, Any] = {}
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, str):
                field = cls.model_fields[key]
                bounds = [m.max_length for m in field.metadata if isinstance(m, MaxLen)]
                value = value[: min(bounds)] if bounds else value
            kept[key] = value
        return cls(**kept)

    def report(self) -> dict[str, Any]:
        """The JSON body's ``hardware``: the fields that were given."""
        return self.model_dump(exclude_unset=True)


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class FileRef(_Message):
    url: str  # a server path (/api/v1/...) or an absolute URL
    sha256: str  # hex; also the file's ETag
    nbytes: int


class CheckpointRef(FileRef):
    version: int


class ShardRef(FileRef):
    index: int
    # a text run's shard: uint8 tokens, row-major (nbytes / chunk_len, chunk_len); a
    # dataset run's: ``dtype`` tokens, little-endian, one row (chunk_len = its tokens)
    chunk_len: int
    dtype: Literal["uint8", "uint16", "uint32"] = "uint8"


class DataRange(_Message):
    """The tokens of the shard a dataset run's lease trains on: ``[start, start + tokens)``,
    read as (tokens − 1) / block_size windows of block_size + 1 tokens, each exactly once
    (``diloco.data.text.range_batches``). ``unit`` is its id in the run's coverage."""

    unit: int
    start: int
    tokens: int


class UploadTarget(_Message):
    """A direct upload (runs on object storage): PUT the body to ``url`` (signed for that
    one object and method, until ``expires_at``; send no Authorization header), then POST
    ``commit_url`` (contributor token). The server checks the stored object as it checks a
    proxied body; its 2xx answer, as a proxied upload's, means accepted and durable."""

    url: str
    method: Literal["PUT"] = "PUT"
    expires_at: datetime
    commit_url: str  # a server path


class Lease(_Message):
    """``POST /runs/{id}/join``: a contributor's claim on the open round, and what to do."""

    lease_id: str
    run_id: str
    round: int
    base_version: int  # the checkpoint version to start from (round − 1)
    checkpoint: CheckpointRef
    shard: ShardRef
    config: dict[str, Any]  # the run config, the same structure as the TOML file
    inner_steps: int  # this lease's H: sized to the volunteer's speed (diloco.protocol.sizing)
    start_step: int  # base_version x the run's steps: the global step that indexes the lr schedule
    seed: int  # seeds this lease's batch sampling
    deadline: datetime
    lease_expires_at: datetime
    # how often to heartbeat: the run's [rounds] heartbeat_interval_s, or longer when the
    # hub is busy (diloco.protocol.heartbeats); each heartbeat's answer may change it
    heartbeat_interval_s: float
    max_upload_bytes: int
    upload: UploadTarget | None = None  # None: PUT the body to the server (local storage)
    data_range: DataRange | None = None  # None: a text run's random windows of the shard
    # seconds from this answer to ``deadline`` by the server's clock, so that a volunteer
    # whose clock is off still knows how long it has (None: an older server)
    deadline_in_s: float | None = None


# the most tokens/s a volunteer may report: no device trains this fast (422 past it)
MAX_TOKENS_PER_S = 1e9


class JoinIn(_Message):
    """``POST /runs/{id}/join``'s optional body. ``tokens_per_s``: the training speed this
    volunteer measured (its last round's, or ``diloco doctor``'s), to size its lease's H
    (``diloco.protocol.sizing``); it only ever sizes the sender's own lease."""

    tokens_per_s: float | None = Field(None, gt=0.0, le=MAX_TOKENS_PER_S, allow_inf_nan=False)


class HeartbeatIn(_Message):
    lease_id: str = Field(min_length=1, max_length=32, pattern=NO_CONTROL_CHARS)  # leases.id
    step: int | None = Field(None, ge=0, le=(1 << 31) - 1)  # leases.last_step is an integer
    loss: float | None = Field(None, allow_inf_nan=False)


class HeartbeatOut(_Message):
    lease_expires_at: datetime
    round_state: str
    deadline: datetime
    # how often to heartbeat from now on (diloco.protocol.heartbeats); None: a server from
    # before the advice (keep the lease's)
    heartbeat_interval_s: float | None = None


class DeltaRef(FileRef):
    """An int8 delta file (``diloco.wire.delta``): θ_version = θ_base_version + decode(q)."""

    version: int
    base_version: int  # version − 1


class CatchUpPlan(_Message):
    """``GET /runs/{id}/checkpoints/{v}/catch-up?from=h``: how a volunteer holding version
    ``from`` gets version ``version``: the ``deltas`` in order (``kind="deltas"``: each
    exists and together they are smaller than the full file), else the ``full`` file."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    version: int
    from_version: int = Field(alias="from")
    kind: Literal["deltas", "full"]
    deltas: list[DeltaRef]  # empty for "full"
    full: CheckpointRef
    delta_nbytes: int  # the deltas' sum (0 for "full")


class Receipt(_Message):
    """The answer to an accepted upload (201, or 200 for an identical retry, which gets the
    very same fields). A late upload (``diloco.protocol.late``) keeps its own ``round`` and
    says which open round's step took it, how stale it was and what it weighs there."""

    contribution_id: str
    round: int  # the round it was trained for (its lease's)
    sha256: str
    accepted: bool = True
    # the round whose outer step takes it: ``round``, or a later one for late work (None:
    # a server from before late contributions)
    merged_into_round: int | None = None
    staleness: int = 0  # versions published since its base version: 0 unless late
    weight: int | None = None  # tokens it counts for in the step and in credit, discounted
    # an audit's id: the upload was drawn for an audit by replay and the volunteer now
    # sends the AdamW state its lease began from (PUT /runs/{id}/audits/{audit}/state)
    audit: str | None = None

    @property
    def late(self) -> bool:
        return self.staleness > 0
