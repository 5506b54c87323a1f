"""``GET /install.sh`` and ``/downloads/``: what a volunteer's one-line install fetches.

``curl -fsSL http://SERVER/install.sh | sh -s -- --name alice`` runs the script rendered
here (the server's public URL filled in); the script then fetches the client wheel from
``/downloads/`` and checks it against ``/downloads/<wheel>.sha256``.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from importlib.metadata import version as pkg_version
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from diloco.protocol.messages import ErrorCode
from server.downloads.wheel import ClientWheel, Wheel, find_source_root
from server.http.errors import HubError, NotFound
from server.settings import Settings
from server.storage.files import serve_file

router = APIRouter(tags=["downloads"])

WHEEL_WAIT_S = 120.0  # a request waits this long for a build underway
TEMPLATE = "install.sh.in"
# what may sit inside a single-quoted sh string without any doubt: no quotes, no spaces,
# no $ or backquotes; http(s), a host name or bracketed IPv6, a port, a plain path
_SHELL_SAFE_URL = re.compile(
    r"https?://(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~%+/-]*)?"
)
_SAFE_VERSION = re.compile(r"[A-Za-z0-9.+_-]{1,64}")
_FILENAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


class UnsafePublicURL(HubError):
    status = 500
    code = ErrorCode.UNSAFE_PUBLIC_URL


def client_wheel(request: Request) -> ClientWheel:
    """This app's wheel source, made on first use (requests share one event loop)."""
    state = request.app.state
    if getattr(state, "client_wheel", None) is None:
        settings: Settings = state.settings
        state.client_wheel = ClientWheel(
            data_dir=settings.data_dir,
            version=pkg_version("diloco-hub"),
            prebuilt=settings.client_wheel,
            source_root=find_source_root(),
        )
    wheel: ClientWheel = state.client_wheel
    return wheel


def public_base(request: Request) -> str:
    """The URL volunteers reach this server at: ``DILOCO_PUBLIC_URL``, else this request's."""
    configured = request.app.state.settings.public_url
    return (configured or str(request.base_url)).rstrip("/")


def shell_safe_base(request: Request) -> str:
    base = public_base(request)
    if _SHELL_SAFE_URL.fullmatch(base):
        return base
    if request.app.state.settings.public_url:
        raise UnsafePublicURL(
            f"DILOCO_PUBLIC_URL={base!r} cannot go into the install script; the operator "
            "should set it to a plain http(s)://host[:port][/path] (letters, digits and "
            ". - _ ~ % + / only)"
        )
    raise UnsafePublicURL(
        f"this request's address {base!r} (from its Host header) is not a plain http(s) URL "
        "and cannot go into the install script; the operator should set DILOCO_PUBLIC_URL to "
        "the server's public URL"
    )


@cache
def _template() -> str:
    return resources.files("server.downloads").joinpath(TEMPLATE).read_text(encoding="utf-8")


def render_install_script(base_url: str, version: str) -> str:
    """The installer with ``base_url`` filled in; refuses anything unsafe in single quotes."""
    if not _SHELL_SAFE_URL.fullmatch(base_url):
        raise UnsafePublicURL(f"{base_url!r} is not safe inside a shell script")
    if not _SAFE_VERSION.fullmatch(version):
        version = "unknown"
    return _template().replace("@SERVER_URL@", base_url).replace("@VERSION@", version)


@router.get("/install.sh", response_class=PlainTextResponse)
async def install_sh(request: Request) -> Response:
    """The volunteer installer: ``curl -fsSL URL/install.sh | sh -s -- --name NAME``."""
    client_wheel(request).start()  # the script asks for the wheel within seconds
    script = render_install_script(shell_safe_base(request), pkg_version("diloco-hub"))
    return Response(script, media_type="text/x-shellscript", headers={"Cache-Control": "no-store"})


def _entry(request: Request, wheel: Wheel) -> dict[str, Any]:
    return {
        "filename": wheel.filename,
        "sha256": wheel.sha256,
        "nbytes": wheel.nbytes,
        "url": f"{public_base(request)}/downloads/{wheel.filename}",
    }


@router.get("/downloads/")
@router.get("/downloads", include_in_schema=False)
async def downloads(request: Request) -> dict[str, Any]:
    """What can be downloaded: the client wheel of this server's version."""
    wheel = await client_wheel(request).wait(WHEEL_WAIT_S)
    return {"version": pkg_version("diloco-hub"), "files": [_entry(request, wheel)]}


@router.get("/downloads/{filename}")
async def download(filename: str, request: Request) -> Response:
    """A file listed by ``/downloads/`` (ETag, Range), or ``<file>.sha256`` for sha256sum."""
    checksum = filename.endswith(".sha256")
    name = filename.removesuffix(".sha256")
    if not _FILENAME.fullmatch(name) or not name.endswith(".whl"):
        raise NotFound(f"no such download: {filename!r}; GET /downloads/ lists them")
    wheel = await client_wheel(request).wait(WHEEL_WAIT_S)
    if name != wheel.filename:
        raise NotFound(
            f"no such download: {filename!r}; this server has {wheel.filename} "
            "(GET /downloads/ lists it)"
        )
    if checksum:
        return PlainTextResponse(
            f"{wheel.sha256}  {wheel.filename}\n", headers={"Cache-Control": "no-cache"}
        )
    return serve_file(
        request,
        wheel.path,
        etag=wheel.sha256,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{wheel.filename}"'},
        kind="wheel",
    )
