"""The loopback's own limits, for the benches to print their figures beside: raw TCP
between two processes, and a plain uvicorn app (httptools, uvloop) that reads and discards
a PUT body; HTTP/1.1 written by hand on a plain socket, so that a client measures the
server and not itself. Used by ``bench/transport.py`` and ``bench/server_round.py``."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

RECV_BYTES = 1 << 20  # what each side reads per call


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _drain(conn: socket.socket, nbytes: int) -> None:
    buf = bytearray(RECV_BYTES)
    left = nbytes
    while left:
        got = conn.recv_into(buf, min(left, RECV_BYTES))
        if not got:
            raise ConnectionError(f"peer closed with {left} bytes still to come")
        left -= got


# ---------------------------------------------------------------- (a) raw TCP


def _tcp_peer(listener: socket.socket, nbytes: int, rounds: int, send: bool) -> None:
    payload = memoryview(bytearray(nbytes)) if send else None
    for _ in range(rounds):
        conn, _ = listener.accept()
        with conn:
            if payload is not None:
                conn.sendall(payload)
            else:
                _drain(conn, nbytes)
                conn.sendall(b"k")


def raw_tcp_mbps(nbytes: int, *, rounds: int = 5, send: bool = True) -> list[float]:
    """MB/s of ``rounds`` loopback transfers of ``nbytes``, each on a new connection, the
    peer a separate process: ``send`` True, this process sends and the peer reads and
    discards (an upload); False, the peer sends and this process reads (a download)."""
    listener = socket.create_server(("127.0.0.1", 0))
    peer = mp.get_context("fork").Process(
        target=_tcp_peer, args=(listener, nbytes, rounds, not send), daemon=True
    )
    peer.start()
    payload = memoryview(bytearray(nbytes))
    figures = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            with socket.create_connection(listener.getsockname()) as s:
                if send:
                    s.sendall(payload)
                    if s.recv(1) != b"k":
                        raise ConnectionError("the raw TCP peer did not acknowledge")
                else:
                    _drain(s, nbytes)
            figures.append(mbps(nbytes, time.perf_counter() - start))
    finally:
        peer.join(timeout=30)
        listener.close()
    return figures


# ---------------------------------------------------------------- HTTP by hand


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes  # the answer's body (only its first bytes unless ``keep_body``)
    nbytes: int  # the whole body's size
    seconds: float  # from connecting to the last byte of the answer


def http_request(
    port: int,
    method: str,
    path: str,
    *,
    body: bytes | memoryview = b"",
    headers: dict[str, str] | None = None,
    keep_body: bool = True,
) -> Answer:
    """One HTTP/1.1 request on a new loopback connection (``Connection: close``); the
    answer is read to the end (``keep_body`` False: counted and dropped)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
    for name, value in {**(headers or {}), "Content-Length": str(len(body))}.items():
        head += f"{name}: {value}\r\n"
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head.encode("latin-1") + b"\r\n")
        if len(body):
            s.sendall(body)
        buf, kept, total = bytearray(RECV_BYTES), bytearray(), 0
        while got := s.recv_into(buf):
            total += got
            if keep_body or len(kept) < 65536:  # the head, at least
                kept += buf[:got]
    seconds = time.perf_counter() - start
    head_end = kept.find(b"\r\n\r\n")
    if head_end < 0:
        raise ConnectionError(f"no HTTP answer to {method} {path}: {bytes(kept[:200])!r}")
    status = int(kept[9:12])
    return Answer(status, bytes(kept[head_end + 4 :]), total - head_end - 4, seconds)


# ---------------------------------------------------------------- (b) plain uvicorn


async def _discard_app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    """ASGI: read and drop the request body, answer 200 with the byte count."""
    if scope["type"] != "http":
        return
    total, more = 0, True
    while more:
        message = await receive()
        total += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(total).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _serve_discard(port: int) -> None:
    import uvicorn

    uvicorn.run(
        _discard_app, host="127.0.0.1", port=port, http="httptools", loop="uvloop",
        log_level="warning", access_log=False, lifespan="off",
    )  # fmt: skip


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on port {port} after {timeout:g} s")


@dataclass(frozen=True)
class PlainServer:
    port: int
    pid: int

    def put(self, body: bytes | memoryview) -> Answer:
        answer = http_request(self.port, "PUT", "/discard", body=body)
        if answer.status != 200 or int(answer.body) != len(body):
            raise SystemExit(f"plain uvicorn answered {answer.status} {answer.body!r}")
        return answer


@contextmanager
def plain_server() -> Iterator[PlainServer]:
    """A uvicorn (httptools, uvloop) app in its own process that reads and discards a
    PUT body: the HTTP limit for any ingest."""
    port = free_port()
    process = mp.get_context("spawn").Process(target=_serve_discard, args=(port,), daemon=True)
    process.start()
    try:
        wait_port(port, 30)
        assert process.pid is not None
        yield PlainServer(port, process.pid)
    finally:
        process.terminate()
        process.join(timeout=10)


def plain_http_mbps(nbytes: int, *, rounds: int = 5) -> list[float]:
    """MB/s of ``rounds`` PUTs of ``nbytes`` to ``plain_server``."""
    body = memoryview(bytearray(nbytes))
    with plain_server() as plain:
        return [mbps(nbytes, plain.put(body).seconds) for _ in range(rounds)]
