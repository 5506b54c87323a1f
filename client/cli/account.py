"""``diloco register``: a contributor identity on a server, and the client's defaults;
``diloco rotate-token``: a new token for it.

The installer (``GET /install.sh``) runs it; a volunteer can run it by hand too. It stores the
token with the other credentials and writes ``client.toml`` so that a bare ``diloco join``
knows the server, device and run. Exit codes are those of ``client.cli.support.ExitStatus``.
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Annotated, Any

import typer

from client import credentials, identity
from client.api import ServerAPI
from client.cli.support import ExitStatus, fail, run_api
from client.config_file import (
    ClientConfig,
    ClientConfigError,
    load_client_config,
    save_client_config,
)
from client.credentials import Credentials, CredentialsError, ServerURLError


class Device(StrEnum):  # client.config_file.DEVICES
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


class PrecisionChoice(StrEnum):  # diloco.precision.PRECISIONS
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


PrecisionOpt = Annotated[
    PrecisionChoice,
    typer.Option(
        help="Autocast dtype (auto: bf16 on CUDA cards that have it, fp16 with loss scaling on "
        "older ones, fp32 on the CPU and MPS).",
        envvar="DILOCO_PRECISION",
    ),
]
MicroBatchOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Sequences per forward/backward pass; gradients accumulate to the run's batch "
        "(default: the most that fits a CUDA card's memory, the whole batch elsewhere).",
        envvar="DILOCO_MICRO_BATCH",
    ),
]

GpuMemoryOpt = Annotated[
    float | None,
    typer.Option(
        min=0.1,
        help="Use at most this many GiB of the CUDA card (the rest stays free for other work); "
        "the micro-batch is sized to it.",
        envvar="DILOCO_GPU_MEMORY",
    ),
]

NO_SERVER = (
    "no server given and none configured; pass SERVER_URL or run the installer / diloco register"
)


def client_config() -> ClientConfig:
    """``client.toml``, or exit 2 with the file and key that are wrong."""
    try:
        return load_client_config()
    except ClientConfigError as err:
        fail(str(err), ExitStatus.USAGE)


def server_url(given: str | None, cfg: ClientConfig) -> str:
    """The server to talk to: the argument, else the configured one; normalised."""
    url = given or cfg.server
    if not url:
        fail(NO_SERVER, ExitStatus.USAGE)
    try:
        return credentials.normalize_server_url(url)
    except ServerURLError as err:
        fail(str(err), ExitStatus.USAGE)


ServerArg = Annotated[
    str | None,
    typer.Argument(
        help="Server URL (default: the one in client.toml).",
        envvar="DILOCO_SERVER",
        metavar="[SERVER_URL]",
    ),
]


def registered(url: str, unregistered: str) -> Credentials:
    """The credentials stored for ``url``; else exit 2 with ``unregistered`` (or with what
    is wrong with the credentials file)."""
    try:
        stored = credentials.load_credentials(url)
    except CredentialsError as err:
        fail(str(err), ExitStatus.USAGE)
    if stored is None:
        fail(unregistered, ExitStatus.USAGE)
    return stored


def _check_token(url: str, token: str) -> dict[str, Any]:
    async def me(api: ServerAPI) -> dict[str, Any]:
        return dict(await identity.check_token(api, f"the token stored for {url}", None))

    return run_api(url, token, me)


def register(
    server: Annotated[
        str | None,
        typer.Argument(
            help="Server URL, e.g. http://localhost:8000 (default: the configured server).",
            envvar="DILOCO_SERVER",
            metavar="SERVER_URL",
            show_default=False,
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Register under this name (default: the configured name, else "
            "volunteer@HOSTNAME).",
            envvar="DILOCO_NAME",
        ),
    ] = None,
    device: Annotated[
        Device | None,
        typer.Option(help="Default device for `diloco join`.", envvar="DILOCO_DEVICE"),
    ] = None,
    run: Annotated[
        str | None,
        typer.Option(help="Default run for `diloco join`.", envvar="DILOCO_RUN"),
    ] = None,
) -> None:
    """Register as a contributor (once per server) and save the defaults `diloco join` uses."""
    cfg = client_config()
    url = server_url(server, cfg)
    try:
        stored = credentials.load_credentials(url)
    except CredentialsError as err:
        fail(str(err), ExitStatus.USAGE)

    # who we are: the stored identity if the server still knows it, else a new one
    if stored is not None:
        me = _check_token(url, stored.token)
        known = me.get("name", stored.name)
        typer.echo(
            f"already registered on {url} as {known} ({me.get('id', stored.contributor_id)})"
        )
        if name and name != known:
            typer.echo(f"note: --name {name!r} is used only when registering; kept the old name")
    else:
        who = name or cfg.name or identity.default_name()
        contributor_id, token = run_api(url, None, lambda api: api.register(who))
        try:
            path = credentials.save_credentials(url, Credentials(contributor_id, who, token))
        except CredentialsError as err:
            fail(f"registered as {who} ({contributor_id}) but {err}", ExitStatus.ERROR)
        typer.echo(f"registered on {url} as {who} ({contributor_id}); token stored in {path}")

    # the defaults for a bare `diloco join`; a run id belongs to its server
    same_server = cfg.server == url
    updated = dataclasses.replace(
        cfg,
        server=url,
        name=name or cfg.name,
        device=device.value if device else cfg.device,
        run=run or (cfg.run if same_server else None),
    )
    try:
        path = save_client_config(updated)
    except ClientConfigError as err:
        fail(str(err), ExitStatus.ERROR)
    typer.echo(f"defaults for `diloco join` written to {path}")


def rotate_token(server: ServerArg = None) -> None:
    """Replace the stored contributor token with a new one; the old one stops working at once
    (do this if it may have leaked). Stop any `diloco join` using it first."""
    url = server_url(server, client_config())
    stored = registered(url, f"not registered on {url}; nothing to rotate")
    token = run_api(url, stored.token, lambda api: api.rotate_token())
    try:  # written atomically: the file holds the old token or the new one, never half
        path = credentials.save_credentials(url, dataclasses.replace(stored, token=token))
    except CredentialsError as err:
        # the old token is already dead: this is the only copy of the new one
        typer.echo(f"new token (store it yourself, it is not shown again): {token}", err=True)
        fail(f"the server rotated the token but {err}", ExitStatus.ERROR)
    typer.echo(f"new token for {stored.name} ({stored.contributor_id}) on {url} stored in {path}")
