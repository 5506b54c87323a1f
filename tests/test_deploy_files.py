"""docker-compose.yml and the Dockerfile, checked by reading (no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_compose_file_parses_and_wires_postgres_server_and_volunteer():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())

    services = compose["services"]
    assert set(services) == {"postgres", "server", "volunteer"}
    server = services["server"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
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
