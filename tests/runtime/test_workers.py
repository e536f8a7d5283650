"""``trio-redis-finalize run MODULE:FACTORY --workers N`` (issue 34, point 2).

The supervisor runs N workers named ``<host>-<k>`` (``--name`` replaces the
host), starts one that died again under its name -- which re-reads its own
pending work at once: nothing is pending within ``RESTART_BOUND`` of a
SIGKILL of one worker, defaults otherwise (heartbeat 30 s) -- forwards one
SIGTERM to each worker for a graceful stop and exits 0, or 1 when a worker
died.  The figures measured are printed (``-s``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import trio
from _procs import AppProc

from trio_redis_finalize._transport import Client

RESTART_BOUND = 10.0
"""Seconds from a SIGKILL of one worker to nothing pending (the promise; a bound)."""


class Supervisor(AppProc):
    """``run _handback_app:FACTORY --workers N`` as a process: the workers'
    stdout lines, and the stderr of all (the workers inherit it)."""

    def mounted(self) -> dict[str, int]:
        """Consumer name -> pid of its latest mount."""
        out: dict[str, int] = {}
        for line in self.lines:
            if line.startswith("M "):
                _, name, pid = line.split()
                out[name] = int(pid)
        return out

    async def until(self, check: object, what: str, timeout: float = 60.0) -> None:
        with trio.fail_after(timeout):
            while not check():  # type: ignore[operator]
                if self.proc is not None and self.proc.returncode is not None:
                    raise AssertionError(f"{what}: the supervisor exited "
                                         f"{self.proc.returncode}: {self.stderr.decode()}")
                await trio.sleep(0.02)

    async def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            return await self.proc.wait()


async def _stream_pending(client: Client, names: list[str]) -> int:
    total = 0
    for name in names:
        total += len(await client.execute("XPENDING", "orders", "g", "-", "+", 100, name))
    return total


async def _list_pending(client: Client, names: list[str]) -> int:
    total = int(await client.execute("LLEN", "jobs"))
    for name in names:
        total += int(await client.execute("LLEN", f"{{jobs}}:processing:{name}"))
    return total


@pytest.mark.parametrize("form", ["stream", "rlist"])
async def test_a_killed_worker_is_restarted_under_its_name_and_nothing_is_pending_soon(
    redis_url: str, client: Client, form: str
) -> None:
    """Two workers, named ``<host>-1`` and ``<host>-2``; SIGKILL the one
    holding work: it is started again under its name, and every message is
    handled and nothing pending within ``RESTART_BOUND`` of the kill; SIGTERM
    stops both gracefully, and the exit status (1) says a worker died."""
    host = socket.gethostname()
    names = [f"{host}-1", f"{host}-2"]
    key = "orders" if form == "stream" else "jobs"
    sup = Supervisor(redis_url, form, key, "--workers", "2", sleep=0.3)
    pending = _stream_pending if form == "stream" else _list_pending
    async with trio.open_nursery() as n:
        await n.start(sup.run)
        await sup.until(lambda: set(sup.mounted()) == set(names), "both mounted")
        sent = [f"m{i}" for i in range(8)]
        for m in sent:
            if form == "stream":
                await client.execute("XADD", "orders", "*", "n", m)
            else:
                await client.execute("LPUSH", "jobs", m)
        await sup.until(lambda: any(x.startswith("H ") for x in sup.lines), "a handler started")
        # the worker holding work (for a list: one handling now, its element in its processing list)
        victim = next(x.split()[1] for x in sup.lines if x.startswith("H "))
        old_pid = sup.mounted()[victim]
        os.kill(old_pid, signal.SIGKILL)
        killed = trio.current_time()
        await sup.until(lambda: sup.mounted()[victim] != old_pid, "restarted", timeout=30)
        restarted = trio.current_time() - killed
        with trio.move_on_after(RESTART_BOUND + 20):  # measured past the bound, to report it
            while await pending(client, names):
                await trio.sleep(0.05)
        took = trio.current_time() - killed
        print(f"\n{form}: worker {victim} SIGKILLed; mounted again after {restarted:.2f} s, "
              f"nothing pending {took:.2f} s after the kill")
        assert took < RESTART_BOUND, f"{took:.2f} s"
        handled = {x.split()[2] for x in sup.lines if x.startswith("A ")}
        code = await sup.stop()
    err = sup.stderr.decode()
    assert code == 1, err  # a worker died
    if form == "stream":
        assert len(handled) == len(sent)  # every entry id ACKed
    else:
        assert handled == set(sent)
    assert "worker 1 started" in err and f"'{victim}') died (killed by SIGKILL)" in err, err
    assert err.count("trio-redis-finalize run: stopped") == 2, err  # each stopped gracefully


async def test_workers_stop_gracefully_on_one_sigterm_and_exit_0(
    redis_url: str, client: Client
) -> None:
    """``--name`` is the names' base; one SIGTERM to the supervisor reaches each
    worker once (no "again: exiting now"), each hands back what it did not
    finish, and with no worker lost the exit status is 0."""
    for i in range(6):
        await client.execute("XADD", "orders", "*", "n", str(i))
    sup = Supervisor(redis_url, "stream", "orders", "--workers", "2", "--name", "svc", sleep=5)
    async with trio.open_nursery() as n:
        await n.start(sup.run)
        await sup.until(lambda: set(sup.mounted()) == {"svc-1", "svc-2"}, "both mounted")
        await sup.until(lambda: any(x.startswith("H ") for x in sup.lines), "a handler started")
        code = await sup.stop()
    err = sup.stderr.decode()
    assert code == 0, err
    assert "again: exiting now" not in err and "killing" not in err, err
    assert err.count("trio-redis-finalize run: stopped") == 2, err
    assert "handed back" in err, err
    # the handed-back entries stay pending (no peer) with the stopped mark, idle at once
    rows = await client.execute("XPENDING", "orders", "g", "-", "+", 100)
    assert all(int(r[2]) > 10**11 for r in rows), rows


def test_workers_is_validated() -> None:
    done = subprocess.run([sys.executable, "-m", "trio_redis_finalize", "run", "x:y",
                           "--workers", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--workers" in done.stderr, done.stderr


@pytest.mark.parametrize("form", ["stream", "rlist"])
async def test_at_mount_the_work_of_a_just_killed_consumer_is_announced_with_when(
    redis_url: str, client: Client, form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer killed moments ago still looks alive (its heartbeat key lives
    up to 30 s): a consumer mounting then says what it holds and when it is
    taken over should it be dead, instead of 30 s of silence."""
    import logging

    from test_handback import RunProc

    from trio_redis_finalize import ReliableListSubscription, StreamSubscription, open_consumer

    key = "orders" if form == "stream" else "jobs"
    if form == "stream":
        for i in range(3):
            await client.execute("XADD", key, "*", "n", str(i))
    else:
        await client.execute("LPUSH", key, b"x")
    a = RunProc(redis_url, form, key, sleep=3600)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_for("H ")
        name = a.seen("H ")[0].split()[1]
        a.signal(signal.SIGKILL)
        await a.exited()
    caplog.set_level(logging.INFO, logger="trio_redis_finalize")

    async def ack(d: object) -> object:
        from trio_redis_finalize import ACK
        return ACK

    sub = StreamSubscription(key, "g") if form == "stream" else ReliableListSubscription(key)
    async with open_consumer(redis_url, name="later") as consumer:
        await consumer.mount(sub, ack)  # type: ignore[arg-type]
        with trio.fail_after(10):
            while not [r for r in caplog.records if "killed just now" in r.getMessage()]:
                await trio.sleep(0.02)
    [note] = [r.getMessage() for r in caplog.records if "killed just now" in r.getMessage()]
    held = "3 entries of consumer" if form == "stream" else "1 element(s) in processing list"
    print("\n" + note)
    assert held in note and repr(name) in note and "heartbeat alive until" in note, note
    seconds = float(note.rsplit("in about ", 1)[1].split()[0])
    assert 0 < seconds <= 30.0, note
