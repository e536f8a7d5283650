"""pytest fixtures for code that consumes Redis (registered as a pytest plugin).

* ``redis_server``: a private :class:`~trio_redis_finalize.testing.RedisServer`
  for the whole session;
* ``redis_url``: its URL, with the database flushed before each test;
* ``fresh_redis_server``: a server of the test's own (for fault tests that
  kill, pause or restart it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import hiredis
import pytest

from ._transport._connection import pack_command
from .testing import RedisServer

__all__ = ["fresh_redis_server", "redis_server", "redis_url", "sync_command"]


def sync_command(server: RedisServer, *args: str | bytes | int | float) -> object:
    """Run one command synchronously on ``server`` (for fixtures and set-up)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        reader = hiredis.Reader()
        payload = b""
        if server.password:
            payload += pack_command(("AUTH", server.password))
        payload += pack_command(args)
        s.sendall(payload)
        replies: list[object] = []
        want = 2 if server.password else 1
        while len(replies) < want:
            reply = reader.gets()
            if reply is False:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError("redis-server closed the connection")
                reader.feed(data)
                continue
            replies.append(reply)
        return replies[-1]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    sync_command(redis_server, "FLUSHALL")
    sync_command(redis_server, "SCRIPT", "FLUSH")
    return redis_server.url


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server
