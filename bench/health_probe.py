"""A load balancer's health check, as a process of its own: ``GET /healthz`` every EVERY
seconds for SECONDS, one at a time on one keep-alive connection; then one JSON line per
probe on stdout: ``[sent (time.time()), latency s, status]`` (status: the HTTP status, or
the exception's class name).

bench/load.py runs it beside its simulated volunteers, so that the probe's latency is the
server's answer and the machine's, not the wait for the load generator's own event loop.

    python bench/health_probe.py http://127.0.0.1:PORT EVERY SECONDS
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from urllib.parse import urlsplit


def main() -> None:
    url, every, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    found = []
    end = time.monotonic() + seconds
    due = time.monotonic()
    while due < end:
        time.sleep(max(0.0, due - time.monotonic()))
        sent, start = time.time(), time.perf_counter()
        try:
            conn.request("GET", "/healthz")
            answer = conn.getresponse()
            answer.read()
            status: int | str = answer.status
        except (OSError, http.client.HTTPException) as err:
            status = type(err).__name__
            conn.close()  # the next request connects again
        found.append([sent, time.perf_counter() - start, status])
        due = max(due + every, time.monotonic())
    for row in found:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
