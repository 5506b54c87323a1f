# DiLoCo Hub: one image for the server and the (CPU) volunteer client; Dockerfile.volunteer
# is the volunteer on an NVIDIA GPU.
#   docker build -t diloco-hub .
#   docker run -p 8000:8000 -e DILOCO_DATABASE_URL=postgresql://... diloco-hub
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    DILOCO_DATA_DIR=/data \
    DILOCO_CLIENT_WHEEL=/opt/diloco/wheels

WORKDIR /app
# the CPU build of torch first, pinned, so the range in pyproject.toml never pulls CUDA wheels
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY diloco ./diloco
COPY server ./server
COPY client ./client
COPY migrations ./migrations
COPY web ./web
# the client wheel that GET /install.sh hands to volunteers: this very code and version,
# without the server (server.downloads.volunteer_project)
# DL3013 (pin versions): what is installed is this checkout; its dependencies' ranges are
# pyproject.toml's, and torch, the one that matters, is pinned above
# hadolint ignore=DL3013
RUN pip install ".[server]" \
    && python -m server.downloads.wheel . /opt/diloco/wheels \
    && useradd --create-home --uid 1000 diloco \
    && mkdir -p /data && chown diloco /data
# diloco, created above; numeric, so that runAsNonRoot and the host can check it
USER 1000
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
CMD ["diloco", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
