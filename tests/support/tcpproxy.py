"""A TCP forwarder on 127.0.0.1 that a test can cut and restore: the database "goes away"
for a server that reaches Postgres through it, without touching Postgres itself. And
``Balancer``: the same, spreading connections round-robin over several servers and
skipping those that refuse (a load balancer in front of replicas, as dumb as they come)."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress


class TcpProxy:
    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = int(self._listener.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed by cut()
                return
            upstream = self._connect()
            if upstream is None:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _connect(self) -> socket.socket | None:
        try:
            return socket.create_connection(self.target, timeout=5)
        except OSError:
            return None

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        """Refuse new connections and end every open one (shutdown, not just close: that
        would leave the threads blocked in accept and recv holding the sockets open)."""
        with self._lock:
            sockets, self._open = [self._listener, *self._open], []
        for s in sockets:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class Balancer(TcpProxy):
    """Each new connection goes to the next of ``targets`` that accepts it."""

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        self.targets, self._next = list(targets), 0
        self.connections = [0] * len(self.targets)  # connections each target was given
        super().__init__(self.targets[0])

    def _connect(self) -> socket.socket | None:
        for _ in range(len(self.targets)):
            i, self._next = self._next, (self._next + 1) % len(self.targets)
            try:
                upstream = socket.create_connection(self.targets[i], timeout=5)
            except OSError:
                continue  # down, or not started yet: the next one
            self.connections[i] += 1
            return upstream
        return None
