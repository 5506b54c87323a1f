"""Private runs through a real server: joining needs the invite code the run's owner hands
out; a new code stops the old one but keeps its members; a run can go public again; and a
volunteer joins one with ``diloco join --invite``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import server_run_config
from tests.support.cli import volunteer_cli
from tests.support.contribute import API, auth, create_run, register
from tests.support.live import ADMIN_TOKEN, ServerProcess, admin_headers


def new_invite(http: httpx.Client, run_id: str) -> str:
    r = http.post(f"{API}/runs/{run_id}/invite", headers=admin_headers())
    assert r.status_code == 200, r.text
    assert r.json()["run_id"] == run_id
    return str(r.json()["invite"])


def become_member(http: httpx.Client, token: str, run_id: str, invite: str) -> httpx.Response:
    return http.post(f"{API}/runs/{run_id}/members", json={"invite": invite}, headers=auth(token))


def join(http: httpx.Client, token: str, run_id: str) -> httpx.Response:
    return http.post(f"{API}/runs/{run_id}/join", headers=auth(token))


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]


@pytest.fixture(scope="module")
def run_id(http_module: httpx.Client) -> str:
    return str(create_run(http_module, server_run_config())["id"])


@pytest.fixture(scope="module")
def http_module(server: ServerProcess):  # type: ignore[no-untyped-def]
    with server.client() as client:
        yield client


def test_a_private_run_lets_only_its_members_join(http: httpx.Client, run_id: str) -> None:
    # Prepare: the owner makes the run private
    code = new_invite(http, run_id)
    outsider, member = register(http, "outsider"), register(http, "member")

    # Execute / Assert: no membership, no lease; a wrong code admits no one
    assert http.get(f"{API}/runs/{run_id}").json()["private"] is True
    refused = join(http, outsider, run_id)
    assert error(refused) == (403, "not_invited") and "invite" in refused.json()["detail"]
    assert error(become_member(http, outsider, run_id, "inv_wrong")) == (403, "invalid_invite")
    assert error(join(http, outsider, run_id)) == (403, "not_invited")

    # Execute / Assert: the code admits; joining works, and admitting again changes nothing
    admitted = become_member(http, member, run_id, code)
    assert admitted.status_code == 200, admitted.text
    assert admitted.json()["joined_at"] is not None
    assert become_member(http, member, run_id, code).json() == admitted.json()
    assert join(http, member, run_id).status_code == 200


def test_a_new_code_stops_the_old_one_and_keeps_the_members(
    http: httpx.Client, run_id: str
) -> None:
    # Prepare: a member admitted with the first code
    first = new_invite(http, run_id)
    early, late = register(http, "early"), register(http, "late")
    assert become_member(http, early, run_id, first).status_code == 200

    # Execute
    second = new_invite(http, run_id)

    # Assert
    assert second != first
    assert error(become_member(http, late, run_id, first)) == (403, "invalid_invite")
    assert join(http, early, run_id).status_code == 200
    assert become_member(http, late, run_id, second).status_code == 200


def test_a_run_made_public_again_lets_anyone_join(http: httpx.Client) -> None:
    # Prepare
    run_id = create_run(http, server_run_config())["id"]
    new_invite(http, run_id)
    anyone = register(http, "anyone")
    assert error(join(http, anyone, run_id)) == (403, "not_invited")

    # Execute
    r = http.delete(f"{API}/runs/{run_id}/invite", headers=admin_headers())

    # Assert
    assert r.status_code == 204, r.text
    assert http.get(f"{API}/runs/{run_id}").json()["private"] is False
    assert join(http, anyone, run_id).status_code == 200
    public = become_member(http, anyone, run_id, "whatever")
    assert public.status_code == 200 and public.json()["joined_at"] is None


def test_invites_are_the_admins(http: httpx.Client, run_id: str) -> None:
    token = register(http, "would-be-owner")
    for method in ("POST", "DELETE"):
        url = f"{API}/runs/{run_id}/invite"
        assert error(http.request(method, url)) == (401, "unauthorized")
        assert error(http.request(method, url, headers=auth(token))) == (403, "forbidden")
        unknown = http.request(
            method, f"{API}/runs/run_000000000000/invite", headers=admin_headers()
        )
        assert error(unknown) == (404, "run_not_found")
    assert error(become_member(http, token, "run_000000000000", "x")) == (404, "run_not_found")


@pytest.mark.parametrize("body", [{}, {"invite": ""}, {"invite": "a b"}, {"invite": "x" * 65}])
def test_a_bad_membership_body_is_422(http: httpx.Client, run_id: str, body: dict) -> None:
    token = register(http, "bad-body")

    r = http.post(f"{API}/runs/{run_id}/members", json=body, headers=auth(token))

    assert error(r) == (422, "invalid_request"), r.text


def test_a_volunteer_joins_a_private_run_with_diloco_join_invite(
    server: ServerProcess, http: httpx.Client, tmp_path: Path
) -> None:
    # Prepare: a private run whose code the owner got from `diloco run invite`
    run_id = create_run(http, server_run_config(rounds={"quorum": 1, "max_rounds": 2}))["id"]
    diloco = volunteer_cli(tmp_path)

    made = diloco("run", "invite", run_id, "--server", server.url, "--admin-token", ADMIN_TOKEN)
    assert made.returncode == 0, made.stderr
    code = made.stdout.strip()
    assert code.startswith("inv_")
    join_args = ["join", server.url, "--run", run_id, "--name", "invited", "--threads", "1"]

    # Execute / Assert: without the code, refused (exit 4) saying so; with it, a round done
    refused = diloco(*join_args, "--quiet", "--max-rounds", "1")
    assert refused.returncode == 4, refused.stderr
    assert "not_invited" in refused.stderr
    done = diloco(*join_args, "--quiet", "--max-rounds", "1", "--invite", code)
    assert done.returncode == 0, done.stderr
    assert "1 contributions accepted" in done.stdout + done.stderr
