"""What the CLI commands share: exit codes, failing with a sentence, running API calls.

Exit codes (``ExitStatus``): 0 success; 1 unexpected failure; 2 bad usage or an invalid
config (the message names the key); 3 a data file that cannot be used; 4 the server
refused the request (a 4xx: bad token, no such run, invalid config, ...); 5 the server
could not be reached, or kept failing (connection errors, timeouts, 5xx), after retries.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from enum import IntEnum
from typing import NoReturn, TypeVar

import typer

from client.api import ApiError, DownloadError, RetryPolicy, ServerAPI, ServerUnreachable
from client.credentials import CredentialsError, ServerURLError
from client.lease import ProtocolError
from diloco.config import ConfigError

T = TypeVar("T")

# an interactive command should not sit in backoff for minutes
CLI_RETRY = RetryPolicy(attempts=4, base_delay_s=0.5, max_delay_s=5.0, total_s=30.0)


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    DATA = 3
    REFUSED = 4
    UNREACHABLE = 5


def fail(message: str, status: ExitStatus) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(int(status))


# Errors of modules that load torch, by module and class name: importing them here would make
# every command pay for torch. An error of a module that was never imported cannot have been
# raised, so only the loaded ones are looked up (``sys.modules``).
_TORCH_BOUND_ERRORS: dict[ExitStatus, tuple[tuple[str, str], ...]] = {
    ExitStatus.DATA: (("diloco.data.text", "DataError"), ("diloco.checkpoint", "CheckpointError")),
    ExitStatus.USAGE: (
        ("client.training", "DeviceError"),
        ("diloco.precision", "PrecisionError"),
        ("client.gpu", "DoesNotFit"),
        ("client.gpu", "MemoryLimitError"),
    ),
}


def _loaded_errors(status: ExitStatus) -> tuple[type[BaseException], ...]:
    found = []
    for module, name in _TORCH_BOUND_ERRORS[status]:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def exit_status_for(err: BaseException) -> ExitStatus | None:
    """The exit status for an error the CLI knows how to explain; None for a bug."""
    if isinstance(err, ApiError):
        return ExitStatus.UNREACHABLE if err.status >= 500 else ExitStatus.REFUSED
    if isinstance(err, ServerUnreachable):
        return ExitStatus.UNREACHABLE
    if isinstance(err, (DownloadError, *_loaded_errors(ExitStatus.DATA))):
        return ExitStatus.DATA
    if isinstance(
        err, (ConfigError, CredentialsError, ServerURLError, *_loaded_errors(ExitStatus.USAGE))
    ):
        return ExitStatus.USAGE
    if isinstance(err, ProtocolError):
        return ExitStatus.ERROR
    return None


def run_api(server: str, token: str | None, call: Callable[[ServerAPI], Awaitable[T]]) -> T:
    """Run ``call`` against the server in a fresh event loop; known errors exit with their
    status and a sentence, anything else propagates (a bug: traceback, exit 1)."""

    async def go() -> T:
        async with ServerAPI(server, token=token, retry=CLI_RETRY) as api:
            return await call(api)

    try:
        return asyncio.run(go())
    except Exception as err:
        status = exit_status_for(err)
        if status is None:
            raise
        fail(str(err), status)
