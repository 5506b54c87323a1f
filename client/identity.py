"""Who this volunteer is on a server: sign in with a given or stored token, or register and
store the new token; report this machine's hardware on the profile."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

from client import credentials
from client.api import ApiError, ServerAPI
from client.credentials import Credentials

if TYPE_CHECKING:  # they load torch: `diloco register` and `diloco me` need none of it
    import torch

    from client.progress import Reporter


def default_name() -> str:
    return f"volunteer@{socket.gethostname()}"[:64]


async def check_token(api: ServerAPI, what: str, config_dir: Path | None) -> dict[str, object]:
    """``GET /contributors/me`` with the API's token; a 401 says which token and what to do."""
    try:
        return await api.me()
    except ApiError as err:
        if err.status != 401:
            raise
        store = (config_dir or credentials.config_dir()) / credentials.CREDENTIALS_FILE
        raise ApiError(
            401,
            err.code,
            f"{what} was refused by the server; pass a valid --token, or delete its entry "
            f"in {store} to register again",
            err.body,
        ) from None


async def sign_in(
    api: ServerAPI,
    *,
    token: str | None,
    name: str | None,
    config_dir: Path | None,
    say: Reporter,
) -> None:
    """Set ``api.token``: the one given, else the one stored for this server (both checked
    with the server), else a new registration under ``name`` whose token is stored."""
    if token:
        api.token = token
        await check_token(api, "the token given with --token", config_dir)
        return
    stored = credentials.load_credentials(api.server_url, config_dir)
    if stored is not None:
        api.token = stored.token
        await check_token(api, f"the token stored for {api.server_url}", config_dir)
        return
    name = name or default_name()
    contributor_id, new_token = await api.register(name)
    creds = Credentials(contributor_id, name, new_token)
    path = credentials.save_credentials(api.server_url, creds, config_dir)
    api.token = new_token
    say.always(f"registered as {name!r} ({contributor_id}); token stored in {path}")


async def report_hardware(api: ServerAPI, device: torch.device, *, say: Reporter) -> None:
    """Put this machine's summary on our profile; a server without profiles is fine."""
    from client.hardware import describe

    hardware = describe(device)
    say.info(f"hardware: {hardware.summary()}")
    try:
        await api.update_me(hardware.report())
    except ApiError as err:
        if err.status not in (404, 405, 422):
            raise
        say.warn(f"the server did not take our hardware summary: {err}")
