"""Prometheus metrics, served at /metrics in the text format."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

UPLOADS = Counter("diloco_uploads_total", "Contribution uploads by outcome", ["outcome"])
UPLOAD_BYTES = Counter("diloco_upload_bytes_total", "Bytes of accepted contribution bodies")
ROUNDS_CLOSED = Counter("diloco_rounds_closed_total", "Rounds closed, by reason code", ["code"])
CLOSE_SECONDS = Histogram(
    "diloco_round_close_seconds",
    "Aggregation + outer step + eval + checkpoint write",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
REQUESTS = Counter("diloco_http_requests_total", "HTTP requests", ["method", "route", "status"])
CLOSE_STAGE_SECONDS = Histogram(
    "diloco_round_close_stage_seconds",
    "Time per stage of closing a round",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
