"""The dashboard in real headless Chromium (Debian's, driven by Playwright) against a real
server whose run has closed rounds made of real contributions; plus how its files are
served and shipped."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from diloco.config import parse_config
from diloco.simulate.attacks import hostile_body
from server.storage import keys
from tests.conftest import server_run_config
from tests.support.contribute import API, create_run, register, train, upload
from tests.support.live import ADMIN_TOKEN, wait_for

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("DILOCO_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu",
    "--disable-background-networking", "--disable-component-update",
]  # fmt: skip
PAGES = ("#/runs", "#/runs/{run}", "#/contributors", "#/join", "#/new", "#/account", "#/admin")
EVIL_NAME = "<img src=x onerror=alert(1)>"
CLOSED_ROUNDS = 2


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


# ---------------------------------------------------------------- static files, no browser


def test_dashboard_files_are_served_with_their_content_types(http):
    index = http.get("/")
    assert index.status_code == 200
    assert index.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in index.headers["content-security-policy"]
    assert '<main id="app"' in index.text
    for name, kind in [
        ("app.js", "javascript"),
        ("run.js", "javascript"),
        ("style.css", "text/css"),
    ]:
        r = http.get(f"/web/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"], (name, r.headers)
    missing = http.get("/web/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


def test_hub_endpoint_gives_the_install_command_for_this_server(http, server):
    hub = http.get(f"{API}/hub").json()
    assert hub["public_url"] == server.url
    install = f"curl -fsSL {server.url}/install.sh | sh -s -- --name YOUR_NAME"
    assert hub["install_command"] == install
    assert hub["join_command"] == f"diloco join {server.url}"


def test_every_package_is_listed_and_the_wheel_carries_the_dashboard(tmp_path):
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in ("diloco", "server", "client", "migrations")
        for p in (REPO / top).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == on_disk | {"server.web.static"}
    assert setuptools["package-dir"] == {"server.web.static": "web"}

    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".*")
    for name in ("diloco", "server", "client", "migrations", "web"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (REPO / "web").iterdir():
        assert f"server/web/static/{f.name}" in names, f.name
    assert "server/downloads/install.sh.in" in names  # package data of the server

    # installed, the router finds them there (no checkout next to it)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = "from server.web.router import static_dir; print(static_dir())"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, timeout=60, check=False,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == tmp_path / "site" / "server" / "web" / "static"


# ---------------------------------------------------------------- a run with closed rounds


@pytest.fixture(scope="module")
def run(server) -> Iterator[dict[str, Any]]:
    """quorum 2, target 3: two volunteers close rounds 1 and 2; round 3 stays open."""
    with server.client() as http:
        created = create_run(
            http, server_run_config(rounds={"quorum": 2, "target": 3, "max_rounds": 10})
        )
        run_id = created["id"]
        tokens = {name: register(http, name) for name in ("alice", EVIL_NAME, "carol")}
        for index in range(1, CLOSED_ROUNDS + 1):
            for name in ("alice", EVIL_NAME):
                r = upload(http, tokens[name], train(http, tokens[name], run_id))
                assert r.status_code == 201, r.text

            def closed(index: int = index) -> bool:  # and its eval loss measured
                rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
                return any(
                    r["index"] == index and r["state"] == "closed" and r["eval_loss"] is not None
                    for r in rounds
                )

            wait_for(closed, timeout=60, what=f"round {index} to close and be evaluated")
        # a rejected upload on the open round: its reason shows on the dashboard
        work = train(http, tokens["carol"], run_id)
        bad = upload(http, tokens["carol"], work, body=work.body(base_version=0))
        assert bad.status_code == 409 and bad.json()["error"] == "base_version_mismatch"
        yield {"id": run_id, "tokens": tokens}


def test_round_contributions_list_accepted_and_rejected_uploads(http, run):
    closed = http.get(f"{API}/runs/{run['id']}/rounds/1/contributions").json()
    assert closed["state"] == "closed"
    assert sorted(c["contributor_name"] for c in closed["contributions"]) == sorted(
        ["alice", EVIL_NAME]
    )
    assert all(c["aggregated"] and c["credit"] > 0 for c in closed["contributions"])
    assert closed["rejections"] == []

    open_ = http.get(f"{API}/runs/{run['id']}/rounds/{CLOSED_ROUNDS + 1}/contributions").json()
    (rejection,) = open_["rejections"]
    assert rejection["contributor_name"] == "carol"
    assert rejection["error"] == "base_version_mismatch"
    assert "version 0" in rejection["detail"]
    assert http.get(f"{API}/runs/{run['id']}/rounds/99/contributions").status_code == 404
    assert http.get(f"{API}/runs/run_nope/rounds/1/contributions").status_code == 404


def test_run_view_lists_the_current_rounds_leases_with_heartbeat_ages(http, run):
    current = http.get(f"{API}/runs/{run['id']}").json()["current_round"]
    (lease,) = current["leases"]
    assert lease["contributor_name"] == "carol"
    assert lease["live"] is True and lease["contributed"] is False
    assert 0 <= lease["heartbeat_age_s"] < 120


# ---------------------------------------------------------------- in the browser


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright (which never downloads one)."""
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (or set DILOCO_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


FAILED_REQUEST = re.compile(
    r"^Failed to load resource: the server responded with a status of (\d+)"
)


class Console:
    """Every console message and page error of a page, to assert none is an error. The
    browser logs each API answer of 4xx as an error; ``allow(status)`` expects it (a test
    that makes the hub refuse something)."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.allowed: set[int] = set()
        page.on("console", lambda m: m.type == "error" and self._error(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        page.on("dialog", lambda d: self.errors.append(f"dialog: {d.message}") or d.dismiss())

    def allow(self, *statuses: int) -> None:
        self.allowed.update(statuses)

    def _error(self, text: str) -> None:
        failed = FAILED_REQUEST.match(text)
        if not (failed and int(failed.group(1)) in self.allowed):
            self.errors.append(text)


@contextmanager
def desktop_page(browser: Any, base_url: str) -> Iterator[tuple[Any, Console]]:
    """A page in a fresh context (its own sessionStorage); no console error by its end."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, base_url=base_url)
    pg = context.new_page()
    console = Console(pg)
    try:
        yield pg, console
    finally:
        context.close()
    assert console.errors == [], console.errors


@pytest.fixture
def page(browser, server) -> Iterator[tuple[Any, Console]]:
    with desktop_page(browser, server.url) as (pg, console):
        yield pg, console


def open_page(pg: Any, fragment: str) -> None:
    pg.goto(f"/{fragment}")
    pg.wait_for_selector("body[data-ready='1']", timeout=15_000)


def sign_in(pg: Any, token: str) -> None:
    """Sign in on #/account; the token stays in this tab's sessionStorage across pages."""
    open_page(pg, "#/account")
    pg.get_by_label("Token", exact=True).fill(token)
    pg.get_by_role("button", name="Sign in", exact=True).click()
    expect(pg.locator("main .control-msg")).to_have_text(re.compile("^Signed in as "))


def test_chart_has_one_point_per_closed_round(page, run, http):
    pg, _ = page
    open_page(pg, f"#/runs/{run['id']}")
    closed = [
        r for r in http.get(f"{API}/runs/{run['id']}/rounds").json()["rounds"]
        if r["state"] == "closed"
    ]  # fmt: skip
    assert len(closed) == CLOSED_ROUNDS
    points = pg.locator("svg.chart g[data-series='eval'] circle[data-round]")
    assert points.count() == len(closed)
    rounds = sorted(int(points.nth(i).get_attribute("data-round")) for i in range(points.count()))
    assert rounds == [r["index"] for r in closed]
    pg.get_by_role("button", name="By tokens").click()
    assert pg.locator("svg.chart g[data-series='eval'] circle[data-round]").count() == len(closed)
    # coverage: the tokens the accepted contributions trained on, and epochs
    data = http.get(f"{API}/runs/{run['id']}").json()["data"]
    assert data["tokens_trained"] > 0
    expect(pg.get_by_text(re.compile(r"tokens trained, \d+\.\d\d epochs"))).to_have_count(1)
    assert f"{data['epochs']:.2f} epochs" in (pg.text_content("main") or "")


def test_round_progress_changes_without_a_reload_when_a_contribution_is_accepted(page, run, server):
    pg, _ = page
    open_page(pg, f"#/runs/{run['id']}")
    progress = pg.get_by_role("progressbar")
    before = int(progress.get_attribute("aria-valuenow"))
    pg.evaluate("window.__sameDocument = true")

    with server.client() as http:
        token = run["tokens"]["alice"]
        assert upload(http, token, train(http, token, run["id"])).status_code == 201

    # (wait_for_function would evaluate a string: the page's CSP forbids that)
    expect(progress).to_have_attribute("aria-valuenow", str(before + 1), timeout=10_000)
    assert pg.evaluate("window.__sameDocument") is True  # no navigation, no reload
    text = pg.text_content("#round-progress-text")
    assert re.match(rf"{before + 1} accepted · quorum 2 · target 3", text or "")


def test_pausing_from_the_ui_pauses_the_run(page, run, http):
    pg, _ = page
    open_page(pg, f"#/runs/{run['id']}")
    pause = pg.get_by_role("button", name="Pause", exact=True)
    assert pause.is_disabled()  # until signed in, and it says so
    assert "sign in" in (pause.get_attribute("title") or "")
    sign_in(pg, ADMIN_TOKEN)
    open_page(pg, f"#/runs/{run['id']}")
    pause.click()
    expect(pg.locator("#run-status")).to_have_text("paused", timeout=10_000)
    assert http.get(f"{API}/runs/{run['id']}").json()["status"] == "paused"
    resume = pg.get_by_role("button", name="Resume")
    assert resume.is_enabled()
    resume.click()
    wait_for(
        lambda: http.get(f"{API}/runs/{run['id']}").json()["status"] == "active",
        timeout=10, what="the run to resume",
    )  # fmt: skip


def test_every_page_renders_at_phone_width_without_errors_or_overflow(browser, server, run):
    context = browser.new_context(viewport={"width": 390, "height": 844}, base_url=server.url)
    try:
        pg = context.new_page()
        console = Console(pg)
        for fragment in PAGES:
            open_page(pg, fragment.format(run=run["id"]))
            width = pg.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], (fragment, width)
            assert pg.get_by_role("heading", level=1).count() == 1
        assert console.errors == [], console.errors
    finally:
        context.close()


def test_user_provided_names_show_as_text(page, run):
    pg, _ = page
    open_page(pg, "#/contributors")
    assert pg.get_by_text(EVIL_NAME, exact=True).count() == 1
    assert pg.locator("main img").count() == 0
    open_page(pg, f"#/runs/{run['id']}")
    pg.get_by_role("button", name="Contributions of round 1").click()
    pg.wait_for_selector("text=Contributions to round 1")
    assert pg.get_by_text(EVIL_NAME, exact=True).count() >= 1
    assert pg.locator("main img").count() == 0


def test_join_page_shows_this_servers_install_command(page, server):
    pg, _ = page
    open_page(pg, "#/join")
    command = pg.text_content("#install-command")
    assert command == f"curl -fsSL {server.url}/install.sh | sh -s -- --name YOUR_NAME"
    assert httpx.get(f"{server.url}/install.sh", timeout=30).status_code == 200


def test_a_failing_close_and_a_left_out_contribution_are_shown_with_their_reasons(page, server):
    # Prepare: run A's close fails (its base state file is gone); in run B one of two
    # uploads is damaged on disk, so B's round closes on the other one
    pg, _ = page
    with server.client() as http:
        config = server_run_config(rounds={"quorum": 1, "target": 2, "max_rounds": 5})
        failing, leaving = create_run(http, config), create_run(http, config)
        base = server.data_dir / "blobs" / keys.checkpoints(failing["id"])
        (base / "0.state.safetensors").unlink()
        token = register(http, "closer")
        work = train(http, token, failing["id"], steps=1)
        first, second = register(http, "damaged"), register(http, "intact")
        # both hold leases before the first upload, so the round waits for the second
        works = {t: train(http, t, leaving["id"], steps=1) for t in (first, second)}
        assert upload(http, first, works[first]).status_code == 201
        (blob,) = (server.data_dir / "blobs" / keys.rounds(leaving["id"]) / "1").glob("*.bin")
        blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
        assert upload(http, second, works[second]).status_code == 201
        assert upload(http, token, work).status_code == 201
        wait_for(
            lambda: http.get(f"{API}/runs/{leaving['id']}").json()["checkpoint_version"] == 1,
            timeout=60, what="run B's round 1 to close on the intact upload",
        )  # fmt: skip

    # Execute + Assert: run A's live round says its close failed and when it retries
    open_page(pg, f"#/runs/{failing['id']}")
    expect(pg.locator("#round-error")).to_contain_text("failed (close_failed)", timeout=20_000)
    assert "BlobMissing" in (pg.text_content("#round-error") or "")  # its base state is gone
    # run B's round 1 lists the damaged upload as left out, with why
    open_page(pg, f"#/runs/{leaving['id']}")
    pg.get_by_role("button", name="Contributions of round 1").click()
    cell = pg.get_by_text("left out: blob_unreadable: its stored upload is damaged")
    expect(cell).to_have_count(1, timeout=10_000)


def test_a_clipped_contribution_shows_its_norm_cosine_and_clip(page, server):
    # Prepare: two honest volunteers and one who sends its update scaled 100x; the robust
    # aggregate bounds that one to the round's median norm (the scoring, which would leave
    # it out before any step, is off: its update alone raises the loss)
    pg, _ = page
    with server.client() as http:
        config = server_run_config(rounds={"quorum": 3, "target": 3})
        config["aggregation"] = {"score_windows": 0}
        run = create_run(http, config)
        cfg = parse_config(run["config"])
        tokens = [register(http, name) for name in ("steady", "also-steady", "loud")]
        works = [train(http, token, run["id"], steps=1) for token in tokens]
        loud = hostile_body(
            "scaled100", works[2].delta, works[2].meta,
            kind=cfg.compression.kind, block_size=cfg.compression.block_size,
        )  # fmt: skip
        for token, work, body in zip(tokens, works, (None, None, loud), strict=True):
            assert upload(http, token, work, body=body).status_code == 201
        wait_for(
            lambda: http.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == 1,
            timeout=60, what="round 1 to close",
        )  # fmt: skip

    # Execute: the round's contributions in the run view
    open_page(pg, f"#/runs/{run['id']}")
    pg.get_by_role("button", name="Contributions of round 1").click()

    # Assert: the loud one's row shows it was clipped (about 1/100), the others untouched
    loud_row = pg.locator("tr", has=pg.get_by_text("loud", exact=True))
    expect(loud_row.locator("td.clipped")).to_have_text(re.compile(r"×0\.0\d\d"), timeout=10_000)
    for name in ("steady", "also-steady"):
        row = pg.locator("tr", has=pg.get_by_text(name, exact=True))
        expect(row).to_contain_text("×1")
        expect(row).to_contain_text("passed")  # the close's checks
    headers = pg.locator("th").all_text_contents()
    assert {"Weight", "Norm", "Cosine", "Clip", "Checks"} <= set(headers), headers
    # each is a new account's first upload: its weight says why it counts for less
    expect(loud_row.locator("td.weighed")).to_have_attribute(
        "title", re.compile(r"its contributor's standing: 11%")
    )


def test_api_docs_render_offline_under_their_csp(server, page):
    """Swagger UI at /docs draws the API from our files alone: every request the page makes
    goes to this server, and the page fixture fails on any console error (a CSP refusal).
    (``server`` comes first: its database is made before Playwright's event loop runs.)"""
    pg, _ = page
    requested: list[str] = []
    pg.on("request", lambda r: requested.append(r.url))

    pg.goto("/docs")

    expect(pg.locator(".swagger-ui .info .title")).to_contain_text("DiLoCo Hub", timeout=20_000)
    expect(pg.locator(".opblock-summary-path").first).to_be_visible()
    assert requested and all(url.startswith(server.url + "/") for url in requested), requested


def test_a_round_whose_eval_is_pending_says_so(browser, pg_admin_url, tmp_path):
    # Prepare: a server whose evals of published versions fail (version 0's passes), so
    # round 1's eval loss stays pending
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.live import ServerProcess
    from tests.support.pg import fresh_database

    # the database is made on a thread of its own: Playwright's loop runs on this one
    database = fresh_database(pg_admin_url)
    with ThreadPoolExecutor(1) as thread:
        url = thread.submit(database.__enter__).result()
    try:
        proc = ServerProcess(
            data_dir=tmp_path / "srv", database_url=url, faults="eval.version=fail@2*100000"
        )
        try:
            proc.wait_ready()
            with proc.client() as http:
                run = create_run(http, server_run_config(rounds={"quorum": 1}))
                token = register(http, "only")
                assert upload(http, token, train(http, token, run["id"])).status_code == 201
                wait_for(
                    lambda: http.get(f"{API}/runs/{run['id']}").json()["checkpoint_version"] == 1,
                    timeout=60, what="round 1 to close",
                )  # fmt: skip
            context = browser.new_context(
                viewport={"width": 1280, "height": 800}, base_url=proc.url
            )
            try:
                pg = context.new_page()
                # Execute
                open_page(pg, f"#/runs/{run['id']}")
                # Assert: the closed round's eval loss reads "pending", in the run list too
                row = pg.locator(
                    "tr", has=pg.get_by_role("button", name="Contributions of round 1")
                )
                expect(row.locator("td.pending")).to_have_text("pending", timeout=10_000)
                open_page(pg, "#/runs")
                expect(pg.get_by_text("pending")).to_have_count(1, timeout=10_000)
            finally:
                context.close()
        finally:
            proc.stop()
    finally:
        with ThreadPoolExecutor(1) as thread:
            thread.submit(database.__exit__, None, None, None).result()
