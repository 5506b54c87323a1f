"""Domain errors: each carries its HTTP status, a stable code and a sentence.

Services raise them; one handler in ``server.app`` turns them into
``{"error": code, "detail": sentence, ...extra}``. The codes are
``diloco.protocol.messages.ErrorCode`` (the client branches on the same enum);
docs/api.md lists every one. A refusal of the round protocol (``diloco.protocol.rules``)
becomes the matching error through ``refused``.
"""

from __future__ import annotations

import math
from typing import Any

from diloco.protocol.messages import ErrorCode
from diloco.protocol.state import Refusal


class HubError(Exception):
    status = 500
    code: str = ErrorCode.INTERNAL

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries besides the body (none, but ``Retry-After``)."""
        return {}


class MalformedUpload(HubError):
    status = 400
    code = ErrorCode.MALFORMED_UPLOAD


class NonFiniteUpload(HubError):
    status = 400
    code = ErrorCode.NON_FINITE


class WrongTensors(HubError):
    status = 400
    code = ErrorCode.WRONG_TENSORS


class WrongCodec(HubError):
    status = 400
    code = ErrorCode.WRONG_CODEC


class HeaderMismatch(HubError):
    status = 400
    code = ErrorCode.HEADER_MISMATCH


class Unauthorized(HubError):
    status = 401
    code = ErrorCode.UNAUTHORIZED


class Forbidden(HubError):
    status = 403
    code = ErrorCode.FORBIDDEN


class Banned(Forbidden):
    code = ErrorCode.BANNED


class NotInvited(Forbidden):
    code = ErrorCode.NOT_INVITED


class InvalidInvite(Forbidden):
    code = ErrorCode.INVALID_INVITE


class BannedFromRun(Forbidden):
    code = ErrorCode.BANNED_FROM_RUN


class NotRunOwner(Forbidden):
    code = ErrorCode.NOT_RUN_OWNER


class QuotaExceeded(Forbidden):
    code = ErrorCode.QUOTA_EXCEEDED


class NotFound(HubError):
    status = 404
    code = ErrorCode.NOT_FOUND


class RunNotFound(NotFound):
    code = ErrorCode.RUN_NOT_FOUND


class Gone(HubError):
    # a checkpoint version whose files the run's retention policy deleted (server.upkeep.retention)
    status = 410
    code = ErrorCode.GONE


class RoundClosed(HubError):
    status = 409
    code = ErrorCode.ROUND_CLOSED


class BaseVersionMismatch(HubError):
    status = 409
    code = ErrorCode.BASE_VERSION_MISMATCH


class DuplicateContribution(HubError):
    status = 409
    code = ErrorCode.DUPLICATE_CONTRIBUTION


class ReplayedUpload(HubError):
    status = 409
    code = ErrorCode.REPLAYED_UPLOAD


class NoLease(HubError):
    # an upload, heartbeat or release from a contributor that holds no lease on the round
    status = 409
    code = ErrorCode.NO_LEASE


class RunNotActive(HubError):
    status = 409
    code = ErrorCode.RUN_NOT_ACTIVE


class RoundClosing(HubError):
    status = 409
    code = ErrorCode.ROUND_CLOSING


class AlreadyContributed(HubError):
    status = 409
    code = ErrorCode.ALREADY_CONTRIBUTED


class InvalidTransition(HubError):
    status = 409
    code = ErrorCode.INVALID_TRANSITION


class RequestTimeout(HubError):
    # the request line and headers, or the body, stopped arriving (server.http.connection,
    # server.http.body_timeout); the connection is closed after this answer
    status = 408
    code = ErrorCode.REQUEST_TIMEOUT


class LengthRequired(HubError):
    status = 411
    code = ErrorCode.LENGTH_REQUIRED


class UploadTooLarge(HubError):
    status = 413
    code = ErrorCode.UPLOAD_TOO_LARGE


class BodyTooLarge(HubError):
    status = 413
    code = ErrorCode.BODY_TOO_LARGE


class ModelTooLarge(HubError):
    # run creation: a close of this model would need more memory than the server may use
    status = 422
    code = ErrorCode.MODEL_TOO_LARGE


class InvalidConfig(HubError):
    status = 422
    code = ErrorCode.INVALID_CONFIG


class InvalidRequest(HubError):
    status = 422
    code = ErrorCode.INVALID_REQUEST


class InvalidData(HubError):
    status = 422
    code = ErrorCode.INVALID_DATA


class RetryLater(HubError):
    """Refused for now, before anything was done: ``retry_after_s`` (whole seconds, at
    least 1) is in the body and in the ``Retry-After`` header."""

    status = 429

    def __init__(self, detail: str, *, retry_after_s: float) -> None:
        super().__init__(detail, retry_after_s=max(1, math.ceil(retry_after_s)))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.extra["retry_after_s"])}


class RateLimited(RetryLater):
    # this client address sent more than the setting allows (server.http.ratelimit)
    code = ErrorCode.RATE_LIMITED


class TooManyUploads(RetryLater):
    # too many uploads in flight, the contributor's or the server's (server.rounds.slots)
    code = ErrorCode.TOO_MANY_UPLOADS


class CheckpointPending(RetryLater):
    # a version published with its delta, its parameters not yet durable
    # (server.rounds.full_files): the full file exists within seconds
    status = 503
    code = ErrorCode.CHECKPOINT_PENDING


class HeaderTooLarge(HubError):
    # the request line and headers are over max_header_bytes (server.http.connection)
    status = 431
    code = ErrorCode.HEADER_TOO_LARGE


class Internal(HubError):
    status = 500
    code = ErrorCode.INTERNAL  # a bug: the detail names the request id the server logged it under


class Unavailable(HubError):
    status = 503
    code = ErrorCode.UNAVAILABLE  # the database is unreachable, and nothing else


class StorageFailed(HubError):
    status = 507
    code = ErrorCode.STORAGE_FAILED


# the error each refusal code of the round protocol is answered with
_REFUSALS: dict[str, type[HubError]] = {
    cls.code: cls
    for cls in (
        MalformedUpload,
        HeaderMismatch,
        NotFound,
        RoundClosed,
        RoundClosing,
        BaseVersionMismatch,
        DuplicateContribution,
        ReplayedUpload,
        NoLease,
        RunNotActive,
        AlreadyContributed,
    )
}


def refused(refusal: Refusal) -> HubError:
    """The HTTP error for a refusal of the round protocol, with its extra answer fields."""
    return _REFUSALS[refusal.code](refusal.reason, **refusal.extra)
