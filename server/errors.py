"""Domain errors: each carries its HTTP status, a stable code and a sentence.

Services raise them; one handler in ``server.app`` turns them into
``{"error": code, "detail": sentence, ...extra}``. docs/api.md lists every code.
"""

from __future__ import annotations

from typing import Any


class HubError(Exception):
    status = 500
    code = "internal"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}


class MalformedUpload(HubError):
    status = 400
    code = "malformed_upload"


class NonFiniteUpload(HubError):
    status = 400
    code = "non_finite"


class WrongTensors(HubError):
    status = 400
    code = "wrong_tensors"


class WrongCodec(HubError):
    status = 400
    code = "wrong_codec"


class HeaderMismatch(HubError):
    status = 400
    code = "header_mismatch"


class Unauthorized(HubError):
    status = 401
    code = "unauthorized"


class Forbidden(HubError):
    status = 403
    code = "forbidden"


class NotFound(HubError):
    status = 404
    code = "not_found"


class RunNotFound(NotFound):
    code = "run_not_found"


class LeaseNotFound(NotFound):
    code = "no_lease"  # releasing a lease this contributor never held (409 no_lease: uploads)


class RoundClosed(HubError):
    status = 409
    code = "round_closed"


class BaseVersionMismatch(HubError):
    status = 409
    code = "base_version_mismatch"


class DuplicateContribution(HubError):
    status = 409
    code = "duplicate_contribution"


class NoLease(HubError):
    status = 409
    code = "no_lease"


class RunNotActive(HubError):
    status = 409
    code = "run_not_active"


class RoundClosing(HubError):
    status = 409
    code = "round_closing"


class AlreadyContributed(HubError):
    status = 409
    code = "already_contributed"


class InvalidTransition(HubError):
    status = 409
    code = "invalid_transition"


class LengthRequired(HubError):
    status = 411
    code = "length_required"


class UploadTooLarge(HubError):
    status = 413
    code = "upload_too_large"


class BodyTooLarge(HubError):
    status = 413
    code = "body_too_large"


class InvalidConfig(HubError):
    status = 422
    code = "invalid_config"


class InvalidRequest(HubError):
    status = 422
    code = "invalid_request"


class InvalidData(HubError):
    status = 422
    code = "invalid_data"


class Internal(HubError):
    status = 500
    code = "internal"  # a bug: the detail names the request id the server logged it under


class Unavailable(HubError):
    status = 503
    code = "unavailable"  # the database is unreachable, and nothing else
