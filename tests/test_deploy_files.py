"""docker-compose.yml and the Dockerfile, checked by reading (no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_compose_file_parses_and_wires_postgres_minio_server_and_volunteer():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())

    services = compose["services"]
    assert set(services) == {"postgres", "minio", "bucket", "server", "volunteer"}
    server = services["server"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    # the server stores blobs in MinIO's bucket, which the one-shot service creates first
    assert server["depends_on"]["bucket"]["condition"] == "service_completed_successfully"
    assert services["bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "mc mb --ignore-existing hub/diloco" in services["bucket"]["entrypoint"][-1]
    env = server["environment"]
    assert env["DILOCO_STORAGE"].startswith("s3://diloco/")
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        assert env[name], name
    assert env["DILOCO_STORAGE_PUBLIC_ENDPOINT"].endswith(":9000}")
    assert "9000:9000" in services["minio"]["ports"]
    url = server["environment"]["DILOCO_DATABASE_URL"]
    assert url.startswith("postgresql://") and "@postgres:5432/" in url
    assert "DILOCO_ADMIN_TOKEN" in server["environment"]
    assert server["ports"] == ["8000:8000"]
    assert services["volunteer"]["profiles"] == ["volunteer"]
    assert services["volunteer"]["command"][:2] == ["diloco", "join"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], f"{name}: undeclared {volume}"


def test_dockerfile_copies_only_what_exists_and_pins_cpu_torch():
    text = (REPO / "Dockerfile").read_text()

    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.M):
        for path in source.split():
            assert (REPO / path).exists(), f"Dockerfile copies missing {path}"
    assert 'torch==2.13.0"' in text and "whl/cpu" in text
    assert re.search(r'^CMD \["diloco", "serve"', text, re.M)
    assert '--host", "0.0.0.0"' in text
