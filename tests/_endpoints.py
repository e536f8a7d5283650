"""Endpoints that are not Redis servers, started by the tests themselves on
free loopback ports (never a service of the machine): one that answers
non-RESP bytes (an HTTP server's reply), one that accepts and stays silent."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

HTTP_REPLY = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@contextlib.contextmanager
def not_redis(answer: bytes | None = HTTP_REPLY) -> Iterator[int]:
    """A TCP server on 127.0.0.1 (its port yielded) that, to whatever it is
    sent, answers ``answer`` and closes; ``None``: accepts and says nothing."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    held: list[socket.socket] = []

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # the accept timeout, or closed
                continue
            if answer is None:
                held.append(conn)  # silent: kept open until the end
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(4096)
                    conn.sendall(answer)
                except OSError:
                    pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in held:
            conn.close()
