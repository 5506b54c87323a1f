"""Serving the dashboard. Its files are ``web/`` at the top of a checkout; an installed wheel
carries the same files as the package ``server.web.static`` (pyproject.toml maps one onto
the other), so ``diloco serve`` finds them either way.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import version as pkg_version
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel
from starlette.staticfiles import StaticFiles

from server.downloads.router import public_base

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the ``server`` package
CANDIDATES = (PACKAGE_ROOT.parent / "web", PACKAGE_ROOT / "web" / "static")

# only our own files, no inline script or style: a name that slipped through escaping
# still could not run
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class DashboardMissing(RuntimeError):
    """Neither a checkout's web/ nor the installed package's files: a broken install."""


@cache
def static_dir() -> Path:
    """The directory holding index.html: the checkout's web/, else the installed copy."""
    for candidate in CANDIDATES:
        if (candidate / "index.html").is_file():
            return candidate
    tried = ", ".join(str(c) for c in CANDIDATES)
    raise DashboardMissing(f"the dashboard's files are missing (looked in {tried}); reinstall")


class HubInfo(BaseModel):
    version: str
    public_url: str  # DILOCO_PUBLIC_URL, else the address this request came to
    install_command: str  # the one line a volunteer runs
    join_command: str  # what an installed client runs to contribute


router = APIRouter(tags=["dashboard"])


@router.get("/")
async def index() -> FileResponse:
    """The dashboard (HTML; its scripts and styles are under /web/)."""
    return FileResponse(
        static_dir() / "index.html",
        media_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
    )


@router.get("/api/v1/hub")
async def hub(request: Request) -> HubInfo:
    """What the dashboard's join page shows: this server's install command."""
    base = public_base(request)
    return HubInfo(
        version=pkg_version("diloco-hub"),
        public_url=base,
        install_command=f"curl -fsSL {base}/install.sh | sh -s -- --name YOUR_NAME",
        join_command=f"diloco join {base}",
    )


def static_files() -> StaticFiles:
    """``/web/...``: the dashboard's scripts and styles."""
    return StaticFiles(directory=static_dir())
