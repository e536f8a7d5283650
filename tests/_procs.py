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
import logging
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import trio

from trio_redis_finalize import (
    ACK,
    Consumer,
    Delivery,
    Outcome,
    ReliableListSubscription,
    _finalizer,
    _hand_over,
    _handlers,
    _scheduler,
    _shutdown,
    open_consumer,
)
from trio_redis_finalize._transport import Client

# -- helpers for the tests ------------------------------------------------------------


async def eventually(check: Callable[[], object], timeout: float = 30.0,
                     what: str | Callable[[], str] = "condition") -> float:
    """Poll ``check`` (sync, or returning an awaitable) until it is true; the seconds it took.
    ``timeout`` is a bound, never an expectation; ``what`` names the condition (or builds
    the message when it fails)."""
    start = anyio.current_time()
    with anyio.move_on_after(timeout):
        while True:
            ok = check()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return anyio.current_time() - start
            await anyio.sleep(0.02)
    raise AssertionError(f"{what if isinstance(what, str) else what()} not reached within {timeout} s")


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


def always(outcome: Outcome) -> Callable[[Delivery], Awaitable[Outcome]]:
    """A handler that answers every delivery with ``outcome`` and keeps nothing."""

    async def handler(d: Delivery) -> Outcome:
        return outcome

    return handler


class Recorder:
    """A handler that records deliveries (and when, in ``at``) and answers with
    ``decide(delivery)`` (ACK by default)."""

    def __init__(self, decide: Callable[[Delivery], Outcome] = lambda d: ACK) -> None:
        self.decide = decide
        self.seen: list[Delivery] = []
        self.at: list[float] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        self.at.append(anyio.current_time())
        return self.decide(d)

    @property
    def data(self) -> list[bytes | None]:
        return [d.data for d in self.seen]


class HoldFirst(Recorder):
    """A :class:`Recorder` whose first ``n`` deliveries wait for ``release``
    before they are answered."""

    def __init__(self, decide: Callable[[Delivery], Outcome] = lambda d: ACK, n: int = 1) -> None:
        super().__init__(decide)
        self.release = anyio.Event()
        self.n = n

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        self.at.append(anyio.current_time())
        if len(self.seen) <= self.n:
            await self.release.wait()
        return self.decide(d)


async def mount_refused(consumer: Consumer, subscription: Any) -> str:
    """``mount()`` of ``subscription`` fails with ``WrongTypeError``: its message."""
    import pytest

    from trio_redis_finalize._transport import WrongTypeError

    with pytest.raises(WrongTypeError) as info:
        await consumer.mount(subscription, Recorder(lambda d: ACK))
    return str(info.value)


async def mount_on_a_stream_key(client: Client, url: str, key: str, subscription: Any,
                                then: Any = None) -> str:
    """``key``, ``subscription``'s, made a stream: its ``mount()`` is refused (the
    message returned); ``then``, if given, mounts on the same consumer after."""
    await client.execute("XADD", key, "*", "f", "v")
    async with open_consumer(url, name="c1") as consumer:
        message = await mount_refused(consumer, subscription)
        if then is not None:  # the consumer is still usable
            await consumer.mount(then, Recorder(lambda d: ACK))
    return message


def assert_refused_naming(param: str, factory: Callable[[], object], what: str = "") -> None:
    """``factory()`` raises ``ValueError`` whose message names ``param``."""
    import pytest

    with pytest.raises(ValueError) as info:
        factory()
    assert param in str(info.value), (what, str(info.value))


@asynccontextmanager
async def logged_consumer(url: str, caplog: Any, subscription: Any, handler: Callable[[Delivery], Any],
                          level: int = logging.WARNING) -> AsyncIterator[Consumer]:
    """Consumer ``c1`` with ``handler`` mounted on ``subscription``, the
    package's log records from ``level`` up captured by ``caplog`` meanwhile."""
    with caplog.at_level(level, logger="trio_redis_finalize"):
        async with open_consumer(url, name="c1") as consumer:
            await consumer.mount(subscription, handler)
            yield consumer


def corrupt_envelope_logged(records: list[Any]) -> bool:
    """An error log record says a corrupt envelope was dropped."""
    return any(r.levelno == logging.ERROR and "corrupt envelope" in r.getMessage()
               and "dropped" in r.getMessage() for r in records)


def assert_unchanged(h: Recorder, payloads: list[bytes]) -> None:
    """``h`` got ``payloads`` as they are, in order, each at its first attempt."""
    assert h.data == payloads
    assert all(d.attempt == 1 for d in h.seen)


class Hang:
    """A handler that records each delivery, sets ``started`` and then hangs
    until it is cancelled (by ``shutdown_grace``, say)."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.seen: list[Delivery] = []

    async def __call__(self, d: Delivery) -> Outcome:
        self.seen.append(d)
        self.started.set()
        await anyio.sleep_forever()
        raise AssertionError("not reached")

    @property
    def data(self) -> list[bytes | None]:
        return [d.data for d in self.seen]


def stats(consumer: Consumer, name: str | None = None) -> dict[str, Any]:
    """``consumer.stats()`` of subscription ``name``, or of the consumer's only one."""
    every = consumer.stats()
    if name is None:
        (only,) = every.values()
        return only
    return every[name]


def effects(consumer: Consumer, name: str | None = None) -> dict[str, int]:
    """The effects counted for subscription ``name`` (or the only one) so far."""
    return dict(stats(consumer, name)["effects"])


async def pel_count(client: Client, stream: str, group: str) -> int:
    """How many entries of ``stream`` wait in ``group``'s PEL (``XPENDING`` summary)."""
    return int((await client.execute("XPENDING", stream, group))[0])


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


async def serve(url: str, name: str, sub: Any, handler: Any, window: float | None) -> None:
    """A ``tests/_*_proc.py`` child's consumer: ``sub`` mounted as ``name``
    (with ``window``: ``max_attempts=2`` and ``on_error=Backoff(base=0.01,
    cap=0.01, window=window)``), ``R`` written once mounted, until killed."""
    import dataclasses

    from trio_redis_finalize import Backoff

    async with open_consumer(url, name=name, shutdown_grace=0.0) as consumer:
        if window is None:
            await consumer.mount(sub, handler)
        else:
            await consumer.mount(dataclasses.replace(sub, max_attempts=2), handler,
                                 on_error=Backoff(base=0.01, cap=0.01, window=window))
        os.write(1, b"R\n")
        await trio.sleep_forever()


class ChildLines:
    """A child process (``proc``) and its stdout, line by line: ``lines``, each
    split in words (the ``tests/_*_proc.py`` helpers write one line per event)."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        self.buf = b""
        self.lines: list[list[str]] = []

    async def read(self, until: Callable[[list[str]], bool] | None, timeout: float) -> bool:
        """Read lines until one matches ``until`` (True) or ``timeout`` passes (False)."""
        assert self.proc.stdout is not None
        with trio.move_on_after(timeout):
            while True:
                while b"\n" in self.buf:
                    line, _, self.buf = self.buf.partition(b"\n")
                    words = line.decode().split()
                    self.lines.append(words)
                    if until is not None and until(words):
                        return True
                self.buf += await self.proc.stdout.receive()
        return False

    def words(self, first: str) -> list[list[str]]:
        """The lines read so far that start with ``first``."""
        return [w for w in self.lines if w[:1] == [first]]


@asynccontextmanager
async def child_lines(*args: str) -> AsyncIterator[ChildLines]:
    """``python args...`` as a child process, its stdout read line by line; at
    the end it is resumed (a test may have stopped it: SIGSTOP), killed and
    waited for."""
    import signal

    proc = await anyio.open_process([sys.executable, *args], stdout=subprocess.PIPE, stderr=None)
    try:
        yield ChildLines(proc)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        with trio.fail_after(5):
            await proc.wait()


async def connection(client: Client, name: str) -> tuple[dict[str, str], str]:
    """The ``CLIENT LIST`` fields of the connection called ``name`` (empty:
    none now), and the whole list."""
    text = (await client.execute("CLIENT", "LIST")).decode()
    for line in text.splitlines():
        kv = dict(p.split("=", 1) for p in line.split(" ") if "=" in p)
        if kv.get("name") == name:
            return kv, text
    return {}, text


async def addr_of(client: Client, name: str) -> str:
    """The address of the client connection called ``name`` (CLIENT LIST)."""
    kv, text = await connection(client, name)
    if not kv:
        raise AssertionError(f"no client named {name!r} in {text}")
    return kv["addr"]


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


async def killed_mid_handler(client: Client, url: str, queue: str, name: str, heartbeat: float,
                             element: bytes) -> str:
    """A :class:`ConsumerProcess` ``name`` SIGKILLed while it handles ``element``
    (pushed onto ``queue`` once it mounted): its ``handling`` line."""
    p = ConsumerProcess(url, queue, name, heartbeat=heartbeat)
    await p.start()
    try:
        await client.execute("LPUSH", queue, element)
        return await p.expect("handling")
    finally:
        await p.kill()


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


def finalize_timers(monkeypatch: Any, grace: float, timeout: float) -> None:
    """A cancelled finalizer gives up after ``grace`` at shutdown (its
    ``FINALIZE_GRACE``, 10 s), a stalled request of the mount's finalizer
    times out after ``timeout`` (its ``FINALIZE_TIMEOUT``, 5 s)."""
    for module in (_hand_over, _handlers, _shutdown):
        monkeypatch.setattr(module, "FINALIZE_GRACE", grace)
    monkeypatch.setattr(_finalizer, "FINALIZE_TIMEOUT", timeout)


def quick_finalize_timers(monkeypatch: object) -> None:
    """The enumerations' short deadlines: a cancelled finalizer gives up after
    0.2 s instead of 10 s at shutdown, a stalled (never cancelled) request
    times out after 0.3 s instead of 5 s."""
    finalize_timers(monkeypatch, 0.2, 0.3)
    monkeypatch.setattr(_scheduler, "FINALIZE_TIMEOUT", 0.3)  # type: ignore[attr-defined]


class FinalizeBatches:
    """Finalization batches in progress: ``Finalizer.finalize`` calls not
    returned yet, the pauses before a resend included (one consumer at a
    time), counted once :meth:`watch` patched it in.

    A settle check needs it beside ``in_hand`` when a delivery is finalized
    twice: a stream id leaves ``in_hand`` when *a* batch that finalized it
    ends, and a racer run at the first's fault point ends before the first
    -- whose resend (which hands a runtime copy to the scheduler) is then seen
    nowhere else, nothing pending, nothing held, for as long as its pause lasts.
    """

    running = 0

    @classmethod
    def watch(cls, monkeypatch: Any) -> None:
        plain = _finalizer.Finalizer.finalize

        async def finalize(self: _finalizer.Finalizer, items: list[Any]) -> None:
            cls.running += 1
            try:
                await plain(self, items)
            finally:
                cls.running -= 1

        monkeypatch.setattr(_finalizer.Finalizer, "finalize", finalize)


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
