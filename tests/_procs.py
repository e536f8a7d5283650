"""Helpers of the list and Pub/Sub tests, and a consumer process for fault
tests (SIGKILL mid-handler).

Usage as a process: ``python tests/_procs.py URL QUEUE NAME HEARTBEAT``

Mounts ``ReliableListSubscription(QUEUE, heartbeat=HEARTBEAT, block=0.1)`` as
consumer ``NAME``; its handler prints ``handling <attempt> <data>`` on stdout
(flushed) and then hangs until the process is killed.  It prints ``mounted``
once ``mount()`` returned.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from trio_redis_finalize import (
    ACK,
    Delivery,
    Outcome,
    ReliableListSubscription,
    _finalizer,
    _handlers,
    _mount,
    _scheduler,
    _shutdown,
    open_consumer,
)
from trio_redis_finalize._transport import Client

# -- helpers for the tests ------------------------------------------------------------


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0,
                     what: str = "condition") -> None:
    """Poll ``check`` (sync or async) until it is true."""
    with trio.move_on_after(timeout):
        while True:
            ok = check()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            await trio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout} s")


def assert_immutable(d: Delivery, names: tuple[str, ...]) -> None:
    """Assigning or deleting each of ``names`` on ``d`` is refused (a frozen
    ``Delivery``, whatever its lazy subclass), as is an unknown attribute."""
    import dataclasses

    import pytest

    for name in names:
        with pytest.raises(dataclasses.FrozenInstanceError, match="Delivery is immutable"):
            setattr(d, name, "x")
        with pytest.raises(dataclasses.FrozenInstanceError, match="Delivery is immutable"):
            delattr(d, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        d.nope  # type: ignore[attr-defined]  # noqa: B018


class Recorder:
    """A handler that records deliveries and answers with ``decide(delivery)``."""

    def __init__(self, decide: Callable[[Delivery], Outcome]) -> None:
        self.decide = decide
        self.seen: list[Delivery] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        return self.decide(d)

    @property
    def data(self) -> list[bytes | None]:
        return [d.data for d in self.seen]


_LINE = re.compile(r'^[\d.]+ \[\d+ ([^\]]+)\] "([^"]+)"(.*)$', re.S)


class Monitor:
    """MONITOR lines as (client address or 'lua', COMMAND, rest)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str]] = []

    async def run(self, client: Client, *, task_status: trio.TaskStatus[None]) -> None:
        async with await client.connect(name="test-monitor") as conn:
            assert await conn.execute("MONITOR") in (b"OK", "OK")
            task_status.started()
            while True:
                line = await conn._read_reply()
                text = line.decode("utf-8", "replace") if isinstance(line, bytes) else str(line)
                m = _LINE.match(text)
                if m:
                    self.lines.append((m[1], m[2].upper(), m[3]))

    def where(self, command: str) -> set[str]:
        """The addresses that sent ``command``."""
        return {addr for addr, cmd, _ in self.lines if cmd == command}

    def index(self, addr: str, command: str, contains: str = "") -> int:
        for i, (a, c, rest) in enumerate(self.lines):
            if (a == addr or addr == "*") and c == command and contains in rest:
                return i
        raise AssertionError(f"no {command} {contains!r} from {addr} in {self.lines}")


async def addr_of(client: Client, name: str) -> str:
    """The address of the client connection called ``name`` (CLIENT LIST)."""
    text = (await client.execute("CLIENT", "LIST")).decode()
    for line in text.splitlines():
        kv = dict(p.split("=", 1) for p in line.split(" ") if "=" in p)
        if kv.get("name") == name:
            return kv["addr"]
    raise AssertionError(f"no client named {name!r} in {text}")


class ConsumerProcess:
    """This file run as a consumer process (see the module docstring)."""

    def __init__(self, url: str, queue: str, name: str, heartbeat: float) -> None:
        self.args = [sys.executable, str(Path(__file__)), url, queue, name, str(heartbeat)]
        self.proc: trio.Process | None = None
        self._buf = b""

    async def start(self) -> None:
        self.proc = await trio.lowlevel.open_process(self.args, stdout=subprocess.PIPE)
        await self.expect("mounted")

    async def expect(self, prefix: str, timeout: float = 20.0) -> str:
        """The next stdout line starting with ``prefix``."""
        assert self.proc is not None and self.proc.stdout is not None
        with trio.fail_after(timeout):
            while True:
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    text = line.decode()
                    if text.startswith(prefix):
                        return text
                chunk = await self.proc.stdout.receive_some(4096)
                if not chunk:
                    raise AssertionError(f"consumer process ended before printing {prefix!r}")
                self._buf += chunk

    async def kill(self) -> None:
        """SIGKILL, and wait for the process to end."""
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()
        if self.proc.stdout is not None:
            await self.proc.stdout.aclose()


# -- the consumer process -----------------------------------------------------------


async def main(url: str, queue: str, name: str, heartbeat: float) -> None:
    async def hang(d: Delivery) -> Outcome:
        data = (d.data or b"").decode("utf-8", "replace")
        print(f"handling {d.attempt} {data}", flush=True)
        await trio.sleep_forever()
        return ACK  # pragma: no cover - killed before

    async with open_consumer(url, name=name) as consumer:
        await consumer.mount(ReliableListSubscription(queue, heartbeat=heartbeat, block=0.1), hang)
        print("mounted", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))


def quick_finalize_timers(monkeypatch: object) -> None:
    """The enumerations' short deadlines: a cancelled finalizer gives up after
    0.2 s instead of 10 s at shutdown, a stalled (never cancelled) request
    times out after 0.3 s instead of 5 s."""
    setattr_ = monkeypatch.setattr  # type: ignore[attr-defined]
    setattr_(_mount, "FINALIZE_GRACE", 0.2)
    setattr_(_handlers, "FINALIZE_GRACE", 0.2)
    setattr_(_shutdown, "FINALIZE_GRACE", 0.2)
    setattr_(_finalizer, "FINALIZE_TIMEOUT", 0.3)
    setattr_(_scheduler, "FINALIZE_TIMEOUT", 0.3)


TESTS = Path(__file__).parent


class AppProc:
    """``trio-redis-finalize run _handback_app:FACTORY ...`` as a process (run
    from tests/): its stdout lines with the time each arrived (``timed``;
    ``lines``: the texts) and its stderr."""

    def __init__(self, url: str, factory: str, key: str, *extra: str, sleep: float) -> None:
        self.args = [sys.executable, "-m", "trio_redis_finalize", "run", f"_handback_app:{factory}",
                     "--url", url, *extra]
        self.env = {**os.environ, "TRF_T_KEY": key, "TRF_T_SLEEP": str(sleep)}
        self.timed: list[tuple[float, str]] = []
        self.proc: trio.Process | None = None
        self.stderr = b""

    @property
    def lines(self) -> list[str]:
        return [line for _, line in self.timed]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        proc = self.proc = await trio.lowlevel.open_process(
            self.args, cwd=TESTS, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        task_status.started()
        assert proc.stdout is not None and proc.stderr is not None
        err = proc.stderr

        async def errors() -> None:
            async for chunk in err:
                self.stderr += chunk

        async with trio.open_nursery() as n:
            n.start_soon(errors)
            buf = b""
            async for chunk in proc.stdout:
                buf += chunk
                *done, buf = buf.split(b"\n")
                self.timed += [(trio.current_time(), line.decode()) for line in done]
            await proc.wait()
