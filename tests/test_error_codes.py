"""One list of error codes (diloco.protocol.messages.ErrorCode) that the server raises, the
client branches on and docs/api.md documents: none may drift from the others."""

from __future__ import annotations

import re
from pathlib import Path

import server.app  # noqa: F401 - imports every router, hence every error class
from diloco.protocol.messages import ErrorCode
from server.http import openapi
from server.http.errors import HubError

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
ROW = re.compile(r"^\| (\d{3}|any other) \| `([a-z_]+)` \|", re.M)


def error_classes(cls: type[HubError] = HubError) -> list[type[HubError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += error_classes(sub)
    return found


def test_every_error_the_server_raises_has_a_shared_code():
    codes = {cls.code for cls in error_classes()}

    assert codes <= set(ErrorCode), codes - set(ErrorCode)


def test_docs_error_table_lists_exactly_the_shared_codes():
    documented = {code for _, code in ROW.findall(API_DOC.read_text())}

    assert documented == {c.value for c in ErrorCode}, documented ^ {c.value for c in ErrorCode}


def test_each_error_class_answers_with_the_status_the_docs_give_its_code():
    statuses: dict[str, set[int]] = {}
    for status, code in ROW.findall(API_DOC.read_text()):
        if status.isdigit():
            statuses.setdefault(code, set()).add(int(status))

    for cls in error_classes()[1:]:
        if "code" not in vars(cls):  # a base of several (RetryLater): its subclasses answer
            continue
        assert cls.status in statuses[cls.code], (cls.__name__, cls.status, statuses[cls.code])


def test_the_openapi_error_table_uses_only_shared_codes():
    used = {
        code for errors in openapi.ERRORS.values() for codes in errors.values() for code in codes
    }

    assert used <= set(ErrorCode), used - set(ErrorCode)
