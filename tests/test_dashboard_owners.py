"""The dashboard's pages for run owners and the admin (issue 27) in real headless Chromium
(Debian's, driven by Playwright) against a real ``diloco serve``: signing in with a token,
creating a run from the form made of the served schema (and from pasted TOML), inviting
and banning from a run's page, granting and revoking roles on the admin page, and the
reason a control gives when the signed-in token cannot use it. Each effect is checked
through the API."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, auth, create_run, owner, register
from tests.support.live import ADMIN_TOKEN, admin_headers
from tests.test_dashboard import Console, chromium, desktop_page, expect, open_page, sign_in


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(server, browser) -> Iterator[tuple[Any, Console]]:
    """(``server`` first: its database is made before Playwright's event loop runs.)"""
    with desktop_page(browser, server.url) as (pg, console):
        yield pg, console


def create_owned_run(http: httpx.Client, token: str, **sections: dict) -> dict[str, Any]:
    """``POST /runs`` with a run owner's token: the run is the owner's."""
    return create_run(http, server_run_config(**sections), token=token)


def contributor_id(http: httpx.Client, token: str) -> str:
    return str(http.get(f"{API}/whoami", headers=auth(token)).json()["id"])


# ---------------------------------------------------------------- signing in


def test_signing_in_shows_who_you_are_and_keeps_the_token_in_the_tab_only(page, http):
    # Prepare: a run owner
    pg, console = page
    console.allow(401)  # the unknown token below
    _, token = owner(http, "dora")

    # Execute: sign in on the account page
    sign_in(pg, token)

    # Assert: the page and the header name the account and its role; the token is in this
    # tab's sessionStorage and nowhere else
    identity = pg.locator("#identity")
    expect(identity).to_contain_text("dora")
    expect(identity).to_contain_text("owner")
    expect(identity).to_contain_text("runs not ended")  # its quota
    expect(pg.locator("#whoami")).to_have_text("dora · owner")
    stored = pg.evaluate("[Object.keys(sessionStorage), localStorage.length, document.cookie]")
    assert stored == [["diloco.token"], 0, ""]
    assert pg.context.cookies() == []
    assert pg.locator("#nav-admin").is_hidden()  # the admin's page is not in its menu

    # a token the hub does not know is refused, and the tab stays signed in as before
    pg.get_by_label("Token", exact=True).fill("ctr_not_a_token")
    pg.get_by_role("button", name="Sign in", exact=True).click()
    expect(pg.get_by_text("The hub refused this token")).to_be_visible()
    expect(pg.locator("#whoami")).to_have_text("dora · owner")

    # signing out forgets the token
    pg.get_by_role("button", name="Sign out").click()
    expect(pg.locator("#whoami")).to_have_text("Sign in")
    assert pg.evaluate("sessionStorage.length") == 0


# ---------------------------------------------------------------- a new run


def test_an_owner_creates_a_run_from_the_form_and_from_pasted_toml(page, http, tmp_path):
    # Prepare: a run owner signed in, and a training text on disk
    pg, console = page
    console.allow(422)  # the server's answer to a draft that does not check out
    owner_id, token = owner(http, "olive")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus(120_000))
    sign_in(pg, token)
    open_page(pg, "#/new")
    create = pg.locator("#create-run")

    # the form is made from the served schema: every section, with its defaults and bounds
    schema = http.get(f"{API}/config/schema").json()
    for key, prop in schema["properties"].items():
        if "$ref" in prop:
            assert pg.locator(f"#section-{key}").count() == 1, key
    expect(pg.locator("#cfg-model-n_layer-hint")).to_have_text("default 4; ≥ 1, ≤ 96")
    expect(pg.locator("#cfg-model-n_layer")).to_have_attribute("placeholder", "4")

    # Execute: fill it in; a bad value is named by the server's sentence
    values = server_run_config()
    pg.fill("#cfg-name", "from-the-form")
    for section in ("model", "inner", "rounds", "compression"):
        for key, value in values[section].items():
            if key == "kind":  # a choice
                pg.select_option(f"#cfg-{section}-{key}", label=str(value))
            else:
                pg.fill(f"#cfg-{section}-{key}", str(value))
    pg.fill("#cfg-data-val_fraction", "0.1")
    pg.fill("#cfg-data-chunk_size", "1024")
    pg.fill("#cfg-rounds-quorum", "0")
    expect(pg.locator("#config-check")).to_contain_text("rounds.quorum", timeout=10_000)
    expect(create).to_be_disabled()
    expect(create).to_have_attribute("title", re.compile("does not check out"))
    pg.fill("#cfg-rounds-quorum", "1")
    expect(pg.locator("#config-check")).to_contain_text("checks out", timeout=10_000)
    expect(create).to_have_attribute("title", "choose the training text file")

    # the same draft as TOML; a typo there is named too, and the form takes it back
    pg.get_by_role("button", name="Paste TOML").click()
    toml = pg.locator("#config-toml")
    expect(toml).to_have_value(re.compile(r'^name = "from-the-form"\n\n\[model\]\nn_layer = 1\n'))
    text = toml.input_value()
    toml.fill(text.replace("[inner]\n", "[inner]\nstepz = 3\n"))
    expect(pg.locator("#config-check")).to_contain_text("inner.stepz", timeout=10_000)
    toml.fill(text.replace('name = "from-the-form"', 'name = "from-toml"'))
    expect(pg.locator("#config-check")).to_contain_text("checks out", timeout=10_000)
    pg.get_by_role("button", name="Form", exact=True).click()
    expect(pg.locator("#cfg-name")).to_have_value("from-toml")
    expect(pg.locator("#cfg-compression-block_size")).to_have_value("256")

    pg.set_input_files("#data-file", str(corpus))
    expect(create).to_be_enabled(timeout=10_000)
    create.click()

    # Assert: the new run's page opens; the run is the owner's, with the form's config
    expect(pg).to_have_url(re.compile(r"#/runs/run_[A-Za-z0-9_-]+$"), timeout=30_000)
    run_id = pg.url.rsplit("/", 1)[1]
    expect(pg.locator("#run-owner")).to_contain_text("olive")
    (run,) = http.get(f"{API}/runs", params={"owner": owner_id}).json()["runs"]
    assert run["id"] == run_id and run["name"] == "from-toml"
    assert run["owner"] == {"id": owner_id, "name": "olive"}
    config = run["config"]
    assert config["model"]["n_layer"] == 1 and config["model"]["n_embd"] == 32
    assert config["rounds"]["quorum"] == 1 and config["inner"]["steps"] == 3
    assert config["compression"]["block_size"] == 256
    assert config["data"]["path"] == "corpus.txt" and config["data"]["chunk_size"] == 1024
    assert run["data"]["val_tokens"] == corpus.stat().st_size // 10  # the file's, val_fraction 0.1


# ---------------------------------------------------------------- a run's page


def test_the_owner_invites_and_bans_from_the_run_page(page, http):
    # Prepare: an owner's run, on which a volunteer holds a lease
    pg, _ = page
    _, token = owner(http, "otto")
    run = create_owned_run(http, token, rounds={"quorum": 2})
    path = f"{API}/runs/{run['id']}"
    mallory = register(http, "mallory")
    mallory_id = contributor_id(http, mallory)
    assert http.post(f"{path}/join", headers=auth(mallory)).status_code == 200
    sign_in(pg, token)
    open_page(pg, f"#/runs/{run['id']}")
    expect(pg.locator("#run-owner")).to_contain_text("otto")
    expect(pg.locator("#control-who")).to_contain_text("you manage this run")

    # Execute + Assert: private with an invite code, shown once, which admits
    pg.get_by_role("button", name="Make private with a new invite").click()
    code = pg.locator("#invite-code")
    expect(code).to_have_text(re.compile(r"^inv_"), timeout=10_000)
    assert http.get(path).json()["private"] is True
    guest = register(http, "guest")
    admitted = http.post(
        f"{path}/members", json={"invite": code.text_content()}, headers=auth(guest)
    )
    assert admitted.status_code == 200 and admitted.json()["joined_at"] is not None, admitted.text
    expect(pg.locator("#run-privacy")).to_contain_text("Private: joining needs the invite code")

    # ... and public again
    pg.get_by_role("button", name="Make public").click()
    expect(pg.locator("#run-privacy")).to_have_text("Public: anyone may join.", timeout=10_000)
    assert http.get(path).json()["private"] is False

    # ban the volunteer seen in the round, with a reason
    expect(pg.locator(f"#run-contributors option[value='{mallory_id}']")).to_have_count(1)
    ban = pg.get_by_role("button", name="Ban from this run")
    expect(ban).to_be_disabled()  # no one named yet
    pg.fill("#ban-contributor", mallory_id)
    pg.fill("#ban-reason", "uploads noise")
    ban.click()
    row = pg.locator("#run-bans tr", has=pg.get_by_text("uploads noise"))
    expect(row).to_contain_text("mallory", timeout=10_000)
    (listed,) = http.get(f"{path}/bans", headers=auth(token)).json()["bans"]
    assert listed["contributor_id"] == mallory_id and listed["reason"] == "uploads noise"
    refused = http.post(f"{path}/join", headers=auth(mallory))
    assert refused.status_code == 403 and refused.json()["error"] == "banned_from_run"

    # and lift it
    pg.get_by_role("button", name="Lift the ban of mallory").click()
    expect(pg.get_by_text("Nobody is banned from this run.")).to_be_visible(timeout=10_000)
    assert http.get(f"{path}/bans", headers=auth(token)).json()["bans"] == []

    # the export: the latest checkpoint's link and the CLI command
    link = pg.locator("#checkpoint-link")
    assert link.get_attribute("href") == f"{path}/checkpoints/latest"
    assert http.get(link.get_attribute("href") or "").status_code == 200
    expect(pg.locator("#export-command")).to_have_text(
        re.compile(rf"^diloco run export {run['id']} --server http://127\.0\.0\.1:\d+ --out ")
    )


def test_controls_a_token_cannot_use_are_disabled_with_the_reason(page, http):
    # Prepare: one owner's run; another owner; a plain volunteer
    pg, _ = page
    _, token = owner(http, "rhea")
    run = create_owned_run(http, token)
    _, other = owner(http, "sol")
    volunteer = register(http, "tam")

    # Execute + Assert: another owner sees the run's controls disabled, saying whose it is
    sign_in(pg, other)
    open_page(pg, f"#/runs/{run['id']}")
    reason = "this run is rhea's: only its owner and the hub's admin manage it"
    pause = pg.get_by_role("button", name="Pause", exact=True)
    expect(pause).to_have_attribute("title", reason, timeout=10_000)
    for name in ("Pause", "Cancel run", "Make private with a new invite", "Ban from this run"):
        button = pg.get_by_role("button", name=name, exact=True)
        expect(button).to_be_disabled()
        assert button.get_attribute("title") == reason, name
    resume = pg.get_by_role("button", name="Resume", exact=True)
    expect(resume).to_have_attribute("title", reason)
    expect(pg.locator("#control-who")).to_contain_text("This run is rhea's")
    expect(pg.locator("#run-bans")).to_contain_text("shown to its owner and the hub's admin")

    # a plain volunteer may not create runs, and the page says why
    sign_in(pg, volunteer)
    open_page(pg, "#/new")
    create = pg.locator("#create-run")
    expect(create).to_be_disabled()
    expect(create).to_have_attribute("title", re.compile("not a run owner"), timeout=10_000)
    expect(pg.locator("#create-reason")).to_contain_text("the hub's admin grants that role")

    # nor open the admin's page
    open_page(pg, "#/admin")
    expect(pg.locator("#admin-denied")).to_contain_text("signed in as tam, not as the admin")
    assert pg.locator("#nav-admin").is_hidden()

    # the owner itself may; for a run it cancelled, only what still applies
    sign_in(pg, token)
    open_page(pg, f"#/runs/{run['id']}")
    expect(pause).to_be_enabled(timeout=10_000)
    expect(resume).to_have_attribute("title", "only a paused run can be resumed (it is active)")
    assert http.post(f"{API}/runs/{run['id']}/cancel", headers=auth(token)).status_code == 200
    expect(pause).to_have_attribute("title", re.compile(r"it is cancelled"), timeout=10_000)
    expect(pg.get_by_role("button", name="Ban from this run")).to_have_attribute(
        "title", "the run is cancelled"
    )


# ---------------------------------------------------------------- the admin's page


def test_the_admin_grants_and_revokes_an_owner_and_sets_its_quota(page, http):
    # Prepare: a volunteer; the admin signed in
    pg, _ = page
    quinn = register(http, "quinn")
    quinn_id = contributor_id(http, quinn)
    sign_in(pg, ADMIN_TOKEN)
    expect(pg.locator("#nav-admin")).to_be_visible()
    open_page(pg, "#/admin")

    # Execute + Assert: grant owner
    pg.get_by_role("button", name="Manage quinn").click()
    expect(pg.locator("#account-panel h2")).to_have_text(f"quinn ({quinn_id})")
    pg.get_by_role("button", name="Grant owner").click()
    expect(pg.get_by_role("button", name="Revoke owner")).to_be_visible(timeout=10_000)
    assert http.get(f"{API}/whoami", headers=auth(quinn)).json()["roles"] == ["owner"]

    # its quota: runs 3, the rest the hub's defaults
    expect(pg.locator("#quota-runs")).to_have_attribute("placeholder", "default 2", timeout=10_000)
    pg.fill("#quota-runs", "3")
    pg.get_by_role("button", name="Set quota").click()
    expect(pg.get_by_text("quinn's quota is set.")).to_be_visible(timeout=10_000)
    quota = http.get(f"{API}/contributors/{quinn_id}/quota", headers=admin_headers()).json()
    assert quota["set"] == {"runs": 3, "params": None, "data_bytes": None}

    # revoke it
    pg.get_by_role("button", name="Revoke owner").click()
    expect(pg.get_by_role("button", name="Grant owner")).to_be_visible(timeout=10_000)
    whoami = http.get(f"{API}/whoami", headers=auth(quinn)).json()
    assert whoami["roles"] == [] and whoami["can_create_runs"] is False
    expect(pg.locator("#quota-runs")).to_be_hidden()  # a quota is an owner's

    # verifier too
    pg.get_by_role("button", name="Grant verifier").click()
    expect(pg.get_by_role("button", name="Revoke verifier")).to_be_visible(timeout=10_000)
    assert http.get(f"{API}/whoami", headers=auth(quinn)).json()["roles"] == ["verifier"]
    pg.get_by_role("button", name="Revoke verifier").click()
    expect(pg.get_by_role("button", name="Grant verifier")).to_be_visible(timeout=10_000)

    # a hub ban with its reason, listed, then lifted
    pg.fill("#hub-ban-reason", "sybil accounts")
    pg.get_by_role("button", name="Ban from the hub").click()
    row = pg.locator("#accounts tr", has=pg.get_by_text(quinn_id))
    expect(row).to_contain_text("sybil accounts", timeout=10_000)
    assert http.get(f"{API}/whoami", headers=auth(quinn)).status_code == 403
    pg.get_by_role("button", name="Lift the hub ban").click()
    expect(row).to_contain_text("in good standing", timeout=10_000)
    assert http.get(f"{API}/whoami", headers=auth(quinn)).status_code == 200


def test_the_new_pages_render_at_phone_width_without_errors_or_overflow(server, browser, http):
    context = browser.new_context(viewport={"width": 390, "height": 844}, base_url=server.url)
    try:
        pg = context.new_page()
        console = Console(pg)
        _, token = owner(http, "uma")
        run = create_owned_run(http, token)
        for who in (ADMIN_TOKEN, token):
            sign_in(pg, who)
            for fragment in ("#/account", "#/new", "#/admin", f"#/runs/{run['id']}"):
                open_page(pg, fragment)
                width = pg.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")
                assert width[0] <= width[1], (who, fragment, width)
                assert pg.get_by_role("heading", level=1).count() == 1
        assert console.errors == [], console.errors
    finally:
        context.close()
