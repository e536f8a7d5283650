"""``parse_url`` and a real connection over a unix socket."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_redis_finalize._transport import ConnectionParams, open_client, parse_url
from trio_redis_finalize.testing import RedisServer


def test_redis_url_defaults() -> None:
    p = parse_url("redis://localhost")
    assert p == ConnectionParams(host="localhost", port=6379, db=0)
    assert not p.tls and p.path is None and p.username is None and p.password is None
    assert p.address == "localhost:6379"
    assert parse_url("redis://").host == "127.0.0.1"


def test_redis_url_full() -> None:
    p = parse_url("redis://127.0.0.1:7001/5?timeout=2.5")
    assert (p.host, p.port, p.db, p.connect_timeout, p.tls) == ("127.0.0.1", 7001, 5, 2.5, False)
    assert parse_url("redis://h:1/").db == 0
    assert parse_url("redis://h:1?db=4").db == 4
    assert parse_url("REDIS://H:1").host == "h"


def test_rediss_url_is_tls() -> None:
    p = parse_url("rediss://cache.example.com:6380/1")
    assert p.tls and (p.host, p.port, p.db) == ("cache.example.com", 6380, 1)


def test_user_and_password_with_percent_escapes() -> None:
    p = parse_url("redis://al%40ice:p%40ss%3Aw%2Frd%20%25@h:1/2")
    assert (p.username, p.password) == ("al@ice", "p@ss:w/rd %")
    p = parse_url("redis://:only%3Apw@h:1")
    assert (p.username, p.password) == (None, "only:pw")
    p = parse_url("redis://default:pw@h:1/3")
    assert (p.username, p.password, p.db) == ("default", "pw", 3)
    p = parse_url("redis://:@h:1")
    assert p.password == ""  # an empty password is still sent
    # redis-py style query parameters
    p = parse_url("redis://h:1?username=bob&password=x%26y")
    assert (p.username, p.password) == ("bob", "x&y")


def test_unix_url() -> None:
    p = parse_url("unix:///var/run/redis/redis.sock?db=2")
    assert p.path == "/var/run/redis/redis.sock" and p.db == 2
    assert p.address == "/var/run/redis/redis.sock"
    p = parse_url("unix://user:pw@/tmp/r.sock")
    assert (p.path, p.username, p.password, p.db) == ("/tmp/r.sock", "user", "pw", 0)
    with pytest.raises(ValueError, match="url"):
        parse_url("unix://")


def test_cluster_url() -> None:
    p = parse_url("redis+cluster://h1:1,h2:2")
    assert p.cluster_seeds == (("h1", 1), ("h2", 2))
    assert (p.host, p.port, p.tls) == ("h1", 1, False)
    p = parse_url("rediss+cluster://:pw@h1:7000,[::1]:7001,h3")
    assert p.tls and p.password == "pw"
    assert p.cluster_seeds == (("h1", 7000), ("::1", 7001), ("h3", 6379))
    node = p.for_node("h9", 9)
    assert (node.host, node.port, node.cluster_seeds, node.password) == ("h9", 9, (), "pw")
    with pytest.raises(ValueError, match="url"):
        parse_url("redis+cluster://h1:1,h2:x")
    with pytest.raises(ValueError, match="database 0"):
        parse_url("redis+cluster://h1:1/3")


@pytest.mark.parametrize("scheme", ["http", "tcp", "valkey", "redis+sentinal"])
def test_bad_scheme(scheme: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_url(f"{scheme}://h:1/0")
    assert "url" in str(err.value)
    assert scheme in str(err.value)


@pytest.mark.parametrize(
    "url",
    ["redis://h:1/abc", "redis://h:99999", "redis://h:port", "redis://h:1?timeout=soon",
     "redis://h:1/-1", "unix:///s.sock?db=x"],
)
def test_bad_parts(url: str) -> None:
    with pytest.raises(ValueError, match="url"):
        parse_url(url)


def test_errors_do_not_echo_the_password() -> None:
    with pytest.raises(ValueError) as err:
        parse_url("http://user:topsecret@h:1")
    assert "topsecret" not in str(err.value)
    with pytest.raises(ValueError) as err:
        parse_url("redis://user:topsecret@h:1/notadb")
    assert "topsecret" not in str(err.value)


@pytest.fixture
def unix_server() -> Iterator[tuple[RedisServer, str]]:
    # A short directory: unix socket paths are limited to ~107 bytes.
    sock_dir = Path(tempfile.mkdtemp(prefix="trf-sock-"))
    sock = str(sock_dir / "redis.sock")
    try:
        with RedisServer(extra_args=("--unixsocket", sock, "--unixsocketperm", "700")) as server:
            assert os.path.exists(sock)
            yield server, sock
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


async def test_unix_socket_connection(unix_server: tuple[RedisServer, str]) -> None:
    server, sock = unix_server
    async with open_client(f"unix://{sock}?db=2", name="via-unix") as client:
        assert await client.execute("SET", "k", "unix") == b"OK"
        info = await client.execute("CLIENT", "INFO")
        assert b" db=2 " in info and b"name=via-unix" in info
        # really over the socket (Redis: addr=/path:0, Valkey: addr=[/path:0]:0)
        assert b"addr=" + sock.encode() in info or b"addr=[" + sock.encode() in info
    async with open_client(server.url) as tcp:  # db 0 over TCP: not there
        assert await tcp.execute("GET", "k") is None
    async with open_client(server.url.rsplit("/", 1)[0] + "/2") as tcp2:
        assert await tcp2.execute("GET", "k") == b"unix"
