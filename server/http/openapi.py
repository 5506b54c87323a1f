"""``/openapi.json`` as the server really answers: FastAPI's schema, corrected from one table.

FastAPI knows each route's success body; it cannot know our errors, nor what a route that
returns a bare ``Response`` sends. So: ``ERRORS`` lists, per operation, each error status
and the codes it carries (docs/api.md says when each happens), ``FILES`` and ``CONTENT``
the real content types, ``BODIES`` the request bodies FastAPI cannot see. Every error answer
is the ``ErrorBody`` schema with ``error`` limited to the listed codes (the schema test
checks the server against exactly this). Added by rule: ``408 request_timeout`` and ``431
header_too_large`` everywhere (a request head that stalls or is too long,
``server.http.connection``), ``500 internal`` everywhere, ``503
unavailable`` where the database is read, ``400 bad_request`` where FastAPI parses a JSON or
multipart body, and ``422`` in our shape instead of FastAPI's ``HTTPValidationError``. An
operation missing from the table fails the schema's build.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from diloco.protocol.messages import ErrorBody

Errors = dict[int, tuple[str, ...]]

ADMIN: Errors = {401: ("unauthorized",), 403: ("forbidden",)}
CONTRIBUTOR: Errors = {401: ("unauthorized",), 403: ("banned",)}
LIMITED: Errors = {429: ("rate_limited",)}  # server.http.ratelimit: with Retry-After
RUN: Errors = {404: ("run_not_found",)}
VERIFIER: Errors = {401: ("unauthorized",), 403: ("forbidden", "banned")}  # or the admin
# the admin, or a run owner (server.auth.require_manager); on a run: that run's owner
MANAGER: Errors = {401: ("unauthorized",), 403: ("forbidden", "banned")}
RUN_MANAGER: Errors = {401: ("unauthorized",), 403: ("forbidden", "banned", "not_run_owner")}
FILE: Errors = {404: ("run_not_found", "not_found"), 416: ("range_not_satisfiable",)}
VERSION_FILE: Errors = {**FILE, 410: ("gone",)}  # retention deleted the version's files
UPLOAD: Errors = {
    400: ("malformed_upload", "non_finite", "wrong_tensors", "wrong_codec", "header_mismatch"),
    **CONTRIBUTOR,
    **RUN,
    409: (
        "round_closed",
        "base_version_mismatch",
        "duplicate_contribution",
        "replayed_upload",
        "no_lease",
        "run_not_active",
    ),
    411: ("length_required",),
    413: ("upload_too_large",),
    429: ("rate_limited", "too_many_uploads"),
}

ERRORS: dict[str, Errors] = {
    "POST /api/v1/runs": {
        **MANAGER,
        403: ("forbidden", "banned", "quota_exceeded"),
        404: ("not_found",),  # data.dataset names no registered dataset
        413: ("upload_too_large",),
        422: ("invalid_config", "invalid_data", "model_too_large"),
    },
    "GET /api/v1/runs": {},
    "GET /api/v1/runs/{run_id}": RUN,
    "GET /api/v1/runs/{run_id}/storage": RUN,
    "GET /api/v1/runs/{run_id}/coverage": RUN,
    "POST /api/v1/datasets": {**ADMIN, 413: ("body_too_large",), 422: ("invalid_data",)},
    "GET /api/v1/datasets/{dataset_id}": {404: ("not_found",)},
    "PUT /api/v1/datasets/{dataset_id}/files/{name}": {
        **ADMIN,
        404: ("not_found",),
        422: ("invalid_data",),
        507: ("storage_failed",),
    },
    "GET /api/v1/datasets/{dataset_id}/files/{name}": {
        404: ("not_found",),
        416: ("range_not_satisfiable",),
    },
    "POST /api/v1/runs/{run_id}/pause": {**RUN_MANAGER, **RUN, 409: ("invalid_transition",)},
    "POST /api/v1/runs/{run_id}/resume": {**RUN_MANAGER, **RUN, 409: ("invalid_transition",)},
    "POST /api/v1/runs/{run_id}/cancel": {**RUN_MANAGER, **RUN, 409: ("invalid_transition",)},
    "GET /api/v1/runs/{run_id}/bans": {**RUN_MANAGER, **RUN},
    "POST /api/v1/runs/{run_id}/bans": {**RUN_MANAGER, 404: ("run_not_found", "not_found")},
    "DELETE /api/v1/runs/{run_id}/bans/{contributor_id}": {
        **RUN_MANAGER,
        404: ("run_not_found", "not_found"),
    },
    "GET /api/v1/runs/{run_id}/rounds": RUN,
    "GET /api/v1/runs/{run_id}/rounds/{index}/contributions": {404: ("run_not_found", "not_found")},
    "POST /api/v1/runs/{run_id}/invite": {**RUN_MANAGER, **RUN},
    "DELETE /api/v1/runs/{run_id}/invite": {**RUN_MANAGER, **RUN},
    "POST /api/v1/runs/{run_id}/members": {
        **CONTRIBUTOR,
        403: ("banned", "invalid_invite"),
        **RUN,
    },
    "POST /api/v1/runs/{run_id}/join": {
        **CONTRIBUTOR,
        403: ("banned", "banned_from_run", "not_invited"),
        **RUN,
        409: ("run_not_active", "already_contributed", "round_closing"),
    },
    "POST /api/v1/runs/{run_id}/rounds/{index}/heartbeat": {
        **CONTRIBUTOR,
        **RUN,
        409: ("round_closed", "no_lease", "run_not_active"),
    },
    "DELETE /api/v1/runs/{run_id}/rounds/{index}/lease": {
        **CONTRIBUTOR,
        **RUN,
        409: ("no_lease",),
    },
    "PUT /api/v1/runs/{run_id}/rounds/{index}/contribution": UPLOAD,
    # a direct upload's commit: the stored body, checked as a PUT's (its size is the store's)
    "POST /api/v1/runs/{run_id}/rounds/{index}/contribution/commit": {
        **{status: codes for status, codes in UPLOAD.items() if status != 411},
        404: ("run_not_found", "not_found"),
        507: ("storage_failed",),
    },
    # its parameters not yet durable: with Retry-After (server.rounds.full_files)
    "GET /api/v1/runs/{run_id}/checkpoints/{version}": {
        **VERSION_FILE,
        503: ("checkpoint_pending",),
    },
    "GET /api/v1/runs/{run_id}/checkpoints/{version}/delta": VERSION_FILE,
    "GET /api/v1/runs/{run_id}/checkpoints/{version}/catch-up": {
        404: ("run_not_found", "not_found"),
        410: ("gone",),  # the version asked for is retired
        422: (),  # from: not a number, or not older than the version
    },
    "GET /api/v1/runs/{run_id}/shards/{index}": FILE,
    "POST /api/v1/contributors": LIMITED,
    "GET /api/v1/contributors": RUN,
    "GET /api/v1/contributors/me": CONTRIBUTOR,
    "PATCH /api/v1/contributors/me": CONTRIBUTOR,
    "POST /api/v1/contributors/me/token": CONTRIBUTOR,
    "POST /api/v1/contributors/{contributor_id}/ban": {**ADMIN, 404: ("not_found",)},
    "POST /api/v1/contributors/{contributor_id}/unban": {**ADMIN, 404: ("not_found",)},
    "POST /api/v1/contributors/{contributor_id}/unquarantine": {**ADMIN, 404: ("not_found",)},
    "POST /api/v1/contributors/{contributor_id}/roles": {**ADMIN, 404: ("not_found",)},
    "DELETE /api/v1/contributors/{contributor_id}/roles/{role}": {**ADMIN, 404: ("not_found",)},
    "GET /api/v1/contributors/{contributor_id}/quota": {
        401: ("unauthorized",),
        403: ("forbidden", "banned"),  # another account's quota
        404: ("not_found",),
    },
    "PUT /api/v1/contributors/{contributor_id}/quota": {**ADMIN, 404: ("not_found",)},
    "GET /api/v1/accounts": ADMIN,
    "GET /api/v1/whoami": CONTRIBUTOR,
    "POST /api/v1/runs/{run_id}/webhooks": {**RUN_MANAGER, **RUN, 422: ()},
    "GET /api/v1/runs/{run_id}/webhooks": {**RUN_MANAGER, **RUN},
    "DELETE /api/v1/runs/{run_id}/webhooks/{webhook_id}": {
        **RUN_MANAGER,
        404: ("run_not_found", "not_found"),
        422: (),
    },
    "POST /api/v1/webhooks": {**ADMIN, 422: ()},
    "GET /api/v1/webhooks": ADMIN,
    "DELETE /api/v1/webhooks/{webhook_id}": {**ADMIN, 404: ("not_found",), 422: ()},
    "GET /api/v1/config/schema": {},
    "POST /api/v1/config/check": {422: ("invalid_config",)},
    "PUT /api/v1/runs/{run_id}/audits/{audit_id}/state": {
        **CONTRIBUTOR,
        403: ("banned", "forbidden"),  # another contributor's audit
        404: ("not_found",),
        409: ("invalid_transition",),  # not waiting for a state (any more)
        411: ("length_required",),
        413: ("upload_too_large",),
        422: ("invalid_data", "invalid_request"),  # not the committed SHA-256
        507: ("storage_failed",),
    },
    "GET /api/v1/runs/{run_id}/audits": {**VERIFIER, **RUN},
    "GET /api/v1/runs/{run_id}/audits/mine": {**CONTRIBUTOR, **RUN},
    "POST /api/v1/runs/{run_id}/audits/claim": {**VERIFIER, **RUN},
    "POST /api/v1/runs/{run_id}/audits/{audit_id}": {
        **VERIFIER,
        404: ("not_found",),
        409: ("invalid_transition",),
    },
    "GET /api/v1/runs/{run_id}/audits/{audit_id}/state": {**VERIFIER, **FILE},
    "GET /api/v1/runs/{run_id}/contributions/{contribution_id}/blob": {**VERIFIER, **FILE},
    "GET /api/v1/runs/{run_id}/rounds/{index}/ledger/{contributor_id}": {
        **VERIFIER,
        404: ("run_not_found", "not_found"),
        410: ("gone",),  # retention deleted the round's base
    },
    "GET /api/v1/speedtest": LIMITED,
    "POST /api/v1/speedtest": {413: ("body_too_large",), 422: (), **LIMITED},
    "GET /api/v1/hub": {},
    "GET /install.sh": {500: ("unsafe_public_url",)},
    "GET /downloads/": {503: ("wheel_unavailable",)},
    "GET /downloads/{filename}": {
        404: ("not_found",),
        416: ("range_not_satisfiable",),
        503: ("wheel_unavailable",),
    },
    "GET /healthz": {},
    "GET /metrics": {},
    "GET /": {},
}
# operations that never touch the database (every other one may answer 503 unavailable)
NO_DATABASE = {
    "GET /api/v1/speedtest",
    "POST /api/v1/speedtest",
    "GET /api/v1/hub",
    "GET /install.sh",
    "GET /downloads/",
    "GET /downloads/{filename}",
    "GET /metrics",
    "GET /",
}

_BINARY_SCHEMA = {"type": "string", "format": "binary"}
_RANGE_HEADERS = [
    {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "one byte range, `bytes=a-b`, `bytes=a-` or `bytes=-n`: answered 206"},
    {"name": "If-None-Match", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "the ETag you hold: answered 304 when it is current"},
]  # fmt: skip
# operations whose success answers are files: 200 whole, 206 a range, 304 unchanged
FILES = {
    "GET /api/v1/runs/{run_id}/checkpoints/{version}": "safetensors: the model's parameters",
    "GET /api/v1/runs/{run_id}/checkpoints/{version}/delta": "safetensors: the int8 delta "
    "from version − 1 (diloco.wire.delta)",
    "GET /api/v1/runs/{run_id}/shards/{index}": "a text run's uint8 tokens, row-major "
    "(nbytes / chunk_len, chunk_len); a dataset run's shard file (data.token_dtype)",
    "GET /downloads/{filename}": "the client wheel (or, for NAME.sha256, `<hex>  NAME` as "
    "text/plain)",
    "GET /api/v1/runs/{run_id}/audits/{audit_id}/state": "safetensors: the AdamW state an "
    "audited lease began from (client.optimizer_state)",
    "GET /api/v1/runs/{run_id}/contributions/{contribution_id}/blob": "an accepted "
    "contribution's body as uploaded (docs/protocol.md)",
    "GET /api/v1/datasets/{dataset_id}/files/{name}": "a file of a prepared dataset "
    "(tokenizer.json, val.bin, shard-NNNNN.bin: docs/api.md, Datasets)",
}
# operations whose 200 is not JSON: operation -> (media type, schema)
CONTENT: dict[str, tuple[str, dict[str, Any]]] = {
    "GET /api/v1/speedtest": ("application/octet-stream", _BINARY_SCHEMA),
    "GET /install.sh": ("text/x-shellscript", {"type": "string"}),
    "GET /metrics": ("text/plain", {"type": "string"}),  # Prometheus text format
    "GET /": ("text/html", {"type": "string"}),
}
BODIES: dict[str, dict[str, Any]] = {
    "PUT /api/v1/runs/{run_id}/rounds/{index}/contribution": {
        "required": True,
        "description": "the upload of docs/protocol.md, with a Content-Length",
        "content": {"application/octet-stream": {"schema": _BINARY_SCHEMA}},
    },
    "PUT /api/v1/datasets/{dataset_id}/files/{name}": {
        "required": True,
        "description": "the file's bytes, exactly as its manifest entry (Content-Length, sha256)",
        "content": {"application/octet-stream": {"schema": _BINARY_SCHEMA}},
    },
    "PUT /api/v1/runs/{run_id}/audits/{audit_id}/state": {
        "required": True,
        "description": "the AdamW state file the audited lease began from, with a "
        "Content-Length; its SHA-256 must be the upload's replay record's start",
        "content": {"application/octet-stream": {"schema": _BINARY_SCHEMA}},
    },
    "POST /api/v1/datasets": {
        "required": True,
        "description": "the dataset's manifest.json (diloco.data.manifest), at most 64 MiB",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    "POST /api/v1/speedtest": {
        "required": False,
        "description": "any bytes, at most 64 MiB; read and thrown away",
        "content": {"application/octet-stream": {"schema": _BINARY_SCHEMA}},
    },
}
SECURITY = {
    "adminToken": {"type": "http", "scheme": "bearer", "description": "the admin token"},
    "contributorToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "a contributor token, from POST /api/v1/contributors",
    },
}

# some codes carry more than error and detail: current_round, expected, status, retry_after_s
ERROR_BODY = ErrorBody.model_json_schema()


def _error_response(codes: tuple[str, ...]) -> dict[str, Any]:
    schema = {
        "allOf": [
            {"$ref": "#/components/schemas/ErrorBody"},
            {"properties": {"error": {"enum": list(codes)}}},
        ]
    }
    return {
        "description": ", ".join(f"`{c}`" for c in codes) + " (docs/api.md)",
        "content": {"application/json": {"schema": schema}},
    }


def _errors_of(key: str, op: dict[str, Any]) -> Errors:
    errors = dict(ERRORS[key])
    parsed = {"application/json", "multipart/form-data"}
    if parsed & set(op.get("requestBody", {}).get("content", {})):  # FastAPI parses it
        errors[400] = ("bad_request", *(c for c in errors.get(400, ()) if c != "bad_request"))
    if "422" in op["responses"] or 422 in errors:
        errors[422] = ("invalid_request", *errors.get(422, ()))
    # the connection's own guards (server.http.connection), before any route: a request head
    # that stalls, or that is too long
    errors[408] = ("request_timeout",)
    errors[431] = ("header_too_large",)
    errors[500] = ("internal", *errors.get(500, ()))
    if key not in NO_DATABASE:
        errors[503] = ("unavailable", *errors.get(503, ()))
    return errors


def _fix_success(key: str, op: dict[str, Any]) -> None:
    responses = op["responses"]
    if key in FILES:
        binary = {"application/octet-stream": {"schema": _BINARY_SCHEMA}}
        whole = dict(binary)
        if key.startswith("GET /downloads/"):
            whole["text/plain"] = {"schema": {"type": "string"}}
        responses["200"] = {"description": FILES[key], "content": whole}
        responses["206"] = {"description": "the byte range asked for", "content": binary}
        responses["304"] = {"description": "If-None-Match holds the current ETag"}
        if not key.startswith("GET /downloads/"):
            responses["307"] = {
                "description": "the blobs live in object storage: Location is the file's URL "
                "there (signed, or the operator's CDN)"
            }
        op.setdefault("parameters", []).extend(_RANGE_HEADERS)
    if key in CONTENT:
        media, schema = CONTENT[key]
        responses["200"] = {**responses["200"], "content": {media: {"schema": schema}}}
    if key in BODIES:
        op["requestBody"] = BODIES[key]
    retried = key.startswith("PUT ") or key.endswith("/commit")
    if retried and "200" in responses and "201" in responses:  # an identical retry
        responses["200"]["content"] = responses["201"]["content"]


def _security(forbidden: tuple[str, ...]) -> list[dict[str, list[str]]]:
    """Which tokens an operation takes, from its 403 codes: ``forbidden`` alone, the admin
    token only; ``forbidden`` and ``banned``, the admin's or an account's with a role (a
    run owner, a verifier); no ``forbidden``, a contributor's."""
    if "forbidden" not in forbidden:
        return [{"contributorToken": []}]
    if "banned" in forbidden:
        return [{"adminToken": []}, {"contributorToken": []}]
    return [{"adminToken": []}]


def document(schema: dict[str, Any]) -> dict[str, Any]:
    """Correct FastAPI's generated ``schema`` in place; return it."""
    listed = set(ERRORS)
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            key = f"{method.upper()} {path}"
            if key not in listed:
                raise KeyError(f"{key}: add its errors to server.http.openapi.ERRORS")
            listed.discard(key)
            _fix_success(key, op)
            for status, codes in _errors_of(key, op).items():
                op["responses"][str(status)] = _error_response(codes)
            op["responses"] = dict(sorted(op["responses"].items()))
            if 401 in ERRORS[key]:
                op["security"] = _security(ERRORS[key].get(403, ()))
    if listed:
        raise KeyError(
            f"server.http.openapi.ERRORS lists operations the app lacks: {sorted(listed)}"
        )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for fastapi_only in ("HTTPValidationError", "ValidationError"):
        schemas.pop(fastapi_only, None)
    schemas["ErrorBody"] = ERROR_BODY
    components["securitySchemes"] = SECURITY
    return schema


def install(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
