"""Run owners through a real server: the admin grants the role, an owner creates and
manages its own runs and nobody else's, quotas refuse with the quota's name, a ban from
one run keeps a volunteer out of that run only, and the config schema and check the
dashboard's form uses."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API, account, auth, create_run, owner, post_run, register
from tests.support.live import admin_headers
from tests.test_cli import diloco


def create(http: httpx.Client, token: str, *, data: bytes | None = None, **sections: Any):
    return post_run(http, server_run_config(**sections), data, token=token)


def run_ids(http: httpx.Client) -> set[str]:
    return {r["id"] for r in http.get(f"{API}/runs").json()["runs"]}


def test_an_owner_manages_its_own_runs_and_gets_403_on_anyone_elses(http):
    # Prepare: two owners, a plain volunteer, and a run of the admin's
    alice, alice_token = owner(http, "alice-lab")
    bob, bob_token = owner(http, "bob-lab")
    _, plain_token = account(http, "plain-volunteer")
    admins = create_run(http, server_run_config())

    # Execute: alice creates a run; each token tries each run
    r = create(http, alice_token)
    assert r.status_code == 201, r.text
    run = r.json()
    path = f"{API}/runs/{run['id']}"

    # Assert: the run is alice's, listed under her, managed by her and the admin only
    assert run["owner"] == {"id": alice, "name": "alice-lab"}
    assert admins["owner"] is None
    mine = http.get(f"{API}/runs", params={"owner": alice}).json()["runs"]
    assert [x["id"] for x in mine] == [run["id"]]
    assert http.get(f"{API}/runs", params={"owner": bob}).json()["runs"] == []
    assert http.post(f"{path}/pause", headers=auth(alice_token)).json()["status"] == "paused"
    assert http.post(f"{path}/resume", headers=auth(alice_token)).json()["status"] == "active"
    for action in ("pause", "cancel", "invite"):
        r = http.post(f"{path}/{action}", headers=auth(bob_token))
        assert r.status_code == 403 and r.json()["error"] == "not_run_owner", r.text
    r = http.post(f"{API}/runs/{admins['id']}/pause", headers=auth(alice_token))
    assert r.status_code == 403 and r.json()["error"] == "not_run_owner", r.text
    r = http.post(f"{path}/pause", headers=auth(plain_token))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert "owner" in r.json()["detail"]
    r = create(http, plain_token)
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    invite = http.post(f"{path}/invite", headers=auth(alice_token))
    assert invite.status_code == 200 and http.get(path).json()["private"] is True
    assert http.delete(f"{path}/invite", headers=auth(alice_token)).status_code == 204
    assert http.post(f"{path}/pause", headers=admin_headers()).json()["status"] == "paused"
    assert http.get(f"{API}/runs/{run_ids(http).pop()}").status_code == 200
    # nobody's token reaches a run that does not exist
    r = http.post(f"{API}/runs/run_000000000000/pause", headers=auth(alice_token))
    assert r.status_code == 404 and r.json()["error"] == "run_not_found"


def test_a_revoked_owner_gets_403_on_its_own_run_and_cannot_create(http):
    cid, token = owner(http, "revoked-lab")
    r = create(http, token)
    assert r.status_code == 201, r.text
    path = f"{API}/runs/{r.json()['id']}"

    revoked = http.delete(f"{API}/contributors/{cid}/roles/owner", headers=admin_headers())

    assert revoked.status_code == 200 and revoked.json() == {"id": cid, "roles": []}
    for attempt in (
        http.post(f"{path}/pause", headers=auth(token)),
        http.get(f"{path}/bans", headers=auth(token)),
        create(http, token),
    ):
        assert attempt.status_code == 403 and attempt.json()["error"] == "forbidden", attempt.text
    assert http.get(path).json()["owner"]["id"] == cid  # the run stays, the admin manages it
    assert http.post(f"{path}/pause", headers=admin_headers()).json()["status"] == "paused"
    who = http.get(f"{API}/whoami", headers=auth(token)).json()
    assert who["can_create_runs"] is False and who["roles"] == []


@pytest.mark.parametrize(
    ("quota", "sections", "data_kb", "named"),
    [
        ({"params": 1000}, {}, 60, "quota params"),
        ({"data_bytes": 30_000}, {}, 60, "quota data_bytes"),
        ({"runs": 0}, {}, 60, "quota runs"),
    ],
)
def test_quotas_refuse_with_the_quota_named_and_leave_no_run(http, quota, sections, data_kb, named):
    cid, token = owner(http, f"quota-{named.split()[1]}")
    r = http.put(f"{API}/contributors/{cid}/quota", json=quota, headers=admin_headers())
    assert r.status_code == 200, r.text
    assert {k: r.json()["set"][k] for k in quota} == quota
    before = run_ids(http)

    refused = create(http, token, data=make_corpus(data_kb * 1000).encode(), **sections)

    assert refused.status_code == 403, refused.text
    body = refused.json()
    assert body["error"] == "quota_exceeded" and body["detail"].startswith(named), body
    assert body["quota"] == next(iter(quota)) and body["limit"] == next(iter(quota.values()))
    assert run_ids(http) == before


def test_the_runs_quota_counts_runs_not_ended_and_holds_under_concurrent_creation(http):
    cid, token = owner(http, "busy-lab")
    http.put(f"{API}/contributors/{cid}/quota", json={"runs": 1}, headers=admin_headers())
    before = run_ids(http)

    # two creations at once: the quota's lock lets exactly one through
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=str(http.base_url)) as other:
        answers = list(pool.map(lambda client: create(client, token), [http, other]))

    assert sorted(a.status_code for a in answers) == [201, 403], [a.text for a in answers]
    made = next(a.json() for a in answers if a.status_code == 201)
    refused = next(a.json() for a in answers if a.status_code == 403)
    assert refused["error"] == "quota_exceeded" and made["id"] in refused["detail"]
    assert run_ids(http) - before == {made["id"]}
    quota = http.get(f"{API}/contributors/{cid}/quota", headers=auth(token)).json()
    assert quota["runs_not_ended"] == 1 and quota["effective"]["runs"] == 1
    # a cancelled run no longer counts
    http.post(f"{API}/runs/{made['id']}/cancel", headers=auth(token))
    assert create(http, token).status_code == 201


def test_a_ban_from_one_run_refuses_its_joins_there_only_and_releases_its_lease(http):
    cid_owner, owner_token = owner(http, "strict-lab")
    strict = create(http, owner_token, rounds={"quorum": 2, "timeout_s": 600})
    assert strict.status_code == 201, strict.text
    run_id = strict.json()["id"]
    other = create_run(http, server_run_config())
    vol, vol_token = account(http, "troublemaker")
    assert http.post(f"{API}/runs/{run_id}/join", headers=auth(vol_token)).status_code == 200

    banned = http.post(
        f"{API}/runs/{run_id}/bans",
        json={"contributor_id": vol, "reason": "uploads noise"},
        headers=auth(owner_token),
    )

    assert banned.status_code == 200, banned.text
    assert banned.json()["banned_by"] == cid_owner and banned.json()["released"] == 1
    r = http.post(f"{API}/runs/{run_id}/join", headers=auth(vol_token))
    assert r.status_code == 403 and r.json()["error"] == "banned_from_run", r.text
    assert "uploads noise" in r.json()["detail"]
    leases = http.get(f"{API}/runs/{run_id}").json()["current_round"]["leases"]
    assert [(x["contributor_id"], x["live"]) for x in leases] == [(vol, False)]
    assert http.post(f"{API}/runs/{other['id']}/join", headers=auth(vol_token)).status_code == 200
    listed = http.get(f"{API}/runs/{run_id}/bans", headers=auth(owner_token)).json()["bans"]
    assert [(b["contributor_name"], b["reason"]) for b in listed] == [
        ("troublemaker", "uploads noise")
    ]
    # another owner can neither see nor change the run's bans
    _, stranger = owner(http, "stranger-lab")
    assert http.get(f"{API}/runs/{run_id}/bans", headers=auth(stranger)).status_code == 403
    lift = f"{API}/runs/{run_id}/bans/{vol}"
    assert http.delete(lift, headers=auth(stranger)).status_code == 403
    assert http.delete(lift, headers=auth(owner_token)).status_code == 204
    assert http.delete(lift, headers=auth(owner_token)).status_code == 404
    assert http.post(f"{API}/runs/{run_id}/join", headers=auth(vol_token)).status_code == 200


@pytest.fixture(scope="module")
def admins_run(server) -> dict[str, Any]:
    with server.client() as http:
        return create_run(http, server_run_config())


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("post", "/contributors/{cid}/roles", {"role": "king"}, 422),
        ("post", "/contributors/{cid}/roles", {"role": "owner", "x": 1}, 422),
        ("post", "/contributors/ctr_nobody/roles", {"role": "owner"}, 404),
        ("delete", "/contributors/{cid}/roles/king", None, 422),
        ("put", "/contributors/{cid}/quota", {"runs": -1}, 422),
        ("put", "/contributors/{cid}/quota", {"runs": "3"}, 422),
        ("put", "/contributors/{cid}/quota", {"runs": 1, "gpus": 2}, 422),
        ("put", "/contributors/ctr_nobody/quota", {"runs": 1}, 404),
        ("get", "/accounts?limit=0", None, 422),
        ("post", "/runs/{run}/bans", {"contributor_id": "ctr_nobody", "reason": "x"}, 404),
        ("post", "/runs/{run}/bans", {"contributor_id": "{cid}", "reason": " "}, 422),
        ("post", "/runs/{run}/bans", {"contributor_id": "{cid}", "reason": "a\nb"}, 422),
        ("post", "/runs/{run}/bans", {"contributor_id": "{cid}"}, 422),
    ],
)
def test_bad_management_requests_get_a_4xx_with_a_reason_and_change_nothing(
    http, admins_run, method, path, body, status
):
    cid, _ = account(http, "target")
    run = admins_run
    url = API + path.replace("{cid}", cid).replace("{run}", run["id"])
    if body is not None:
        body = json.loads(json.dumps(body).replace("{cid}", cid))
    accounts_before = http.get(f"{API}/accounts?limit=500", headers=admin_headers()).json()

    r = http.request(method.upper(), url, json=body, headers=admin_headers())

    assert r.status_code == status, r.text
    assert set(r.json()) >= {"error", "detail"}
    after = http.get(f"{API}/accounts?limit=500", headers=admin_headers()).json()
    assert after == accounts_before
    assert http.get(f"{API}/runs/{run['id']}/bans", headers=admin_headers()).json()["bans"] == []


def test_only_the_admin_manages_roles_quotas_and_the_accounts_list(http):
    cid, token = owner(http, "ambitious-lab")
    for method, path, body in [
        ("POST", f"/contributors/{cid}/roles", {"role": "verifier"}),
        ("DELETE", f"/contributors/{cid}/roles/owner", None),
        ("PUT", f"/contributors/{cid}/quota", {"runs": 100}),
        ("GET", "/accounts", None),
    ]:
        r = http.request(method, API + path, json=body, headers=auth(token))
        assert r.status_code == 403, (path, r.text)
        assert http.request(method, API + path, json=body).status_code == 401
    other, _ = account(http, "someone-else")
    assert http.get(f"{API}/contributors/{other}/quota", headers=auth(token)).status_code == 403
    listed = http.get(f"{API}/accounts", headers=admin_headers()).json()
    me = next(a for a in listed["accounts"] if a["id"] == cid)
    assert me["roles"] == ["owner"] and me["runs_owned"] == 0 and listed["total"] >= 2


def test_whoami_says_what_each_token_may_do(http):
    cid, token = owner(http, "whoami-lab")
    plain = register(http, "whoami-plain")

    admin = http.get(f"{API}/whoami", headers=admin_headers()).json()
    mine = http.get(f"{API}/whoami", headers=auth(token)).json()
    theirs = http.get(f"{API}/whoami", headers=auth(plain)).json()
    unknown = http.get(f"{API}/whoami", headers=auth("ctr_not-a-token"))

    assert (admin["kind"], admin["roles"], admin["can_create_runs"]) == ("admin", ["admin"], True)
    assert (mine["id"], mine["roles"], mine["can_create_runs"]) == (cid, ["owner"], True)
    assert mine["quota"]["effective"]["runs"] >= 1 and mine["quota"]["runs_not_ended"] == 0
    assert (theirs["roles"], theirs["can_create_runs"], theirs["quota"]) == ([], False, None)
    assert unknown.status_code == 401 and unknown.json()["error"] == "unauthorized"


def test_the_config_schema_and_check_are_the_servers_own(http):
    schema = http.get(f"{API}/config/schema").json()
    good = 'name = "drafted"\n[data]\npath = "corpus.txt"\n[model]\nn_layer = 1\nn_embd = 32\n'
    bad = good.replace("n_layer = 1", "n_layer = 0")

    checked = http.post(f"{API}/config/check", json={"toml": good})
    refused = http.post(f"{API}/config/check", json={"toml": bad})
    unknown = http.post(f"{API}/config/check", json={"config": {"name": "x", "nope": {}}})
    broken = http.post(f"{API}/config/check", json={"toml": "name = "})
    both = http.post(f"{API}/config/check", json={"toml": good, "config": {}})

    assert {"model", "inner", "outer", "rounds", "data"} <= set(schema["properties"])
    assert checked.status_code == 200, checked.text
    assert checked.json()["config"]["model"]["n_layer"] == 1 and checked.json()["parameters"] > 0
    assert (
        checked.json()["config"]["outer"]["lr"]
        == schema["$defs"]["OuterSection"]["properties"]["lr"]["default"]
    )
    assert refused.status_code == 422 and refused.json()["error"] == "invalid_config"
    assert refused.json()["detail"].startswith("model.n_layer"), refused.text
    assert unknown.status_code == 422 and "nope: unknown key" in unknown.json()["detail"]
    assert broken.status_code == 422 and "invalid TOML" in broken.json()["detail"]
    assert both.status_code == 422


def test_an_owner_creates_lists_and_bans_from_the_cli_with_its_own_token(server, http, tmp_path):
    cid, token = owner(http, "cli-lab")
    vol, _ = account(http, "cli-volunteer")
    (tmp_path / "corpus.txt").write_text(make_corpus(60_000))
    config = tmp_path / "run.toml"
    config.write_text(
        'name = "from-the-cli"\n[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n'
        '[data]\npath = "corpus.txt"\n[inner]\nsteps = 3\nbatch_size = 4\n'
    )
    who = ["--server", server.url, "--token", token]

    created = diloco("run", "create", str(config), *who, "--json")
    assert created.returncode == 0, created.stderr
    run_id = json.loads(created.stdout)["id"]
    listed = diloco("run", "list", "--owner", cid, *who, "--json")
    banned = diloco("run", "ban", run_id, vol, "--reason", "off-topic data", *who)
    shown = diloco("run", "bans", run_id, *who)
    lifted = diloco("run", "ban", run_id, vol, "--lift", *who)
    no_reason = diloco("run", "ban", run_id, vol, *who)
    described = diloco("run", "show", run_id, "--server", server.url)

    assert [r["id"] for r in json.loads(listed.stdout)] == [run_id], listed.stderr
    assert http.get(f"{API}/runs/{run_id}").json()["owner"]["id"] == cid
    assert banned.returncode == 0 and "0 contributions left out" in banned.stdout, banned.stderr
    assert "off-topic data" in shown.stdout and "cli-volunteer" in shown.stdout, shown.stderr
    assert lifted.returncode == 0 and f"{vol} may join {run_id} again" in lifted.stdout
    assert http.get(f"{API}/runs/{run_id}/bans", headers=auth(token)).json()["bans"] == []
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    assert f"owner               cli-lab ({cid})" in described.stdout, described.stdout
