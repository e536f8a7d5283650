"""Many consumer processes in one stream group (RECLAIM): they share 20,000
entries, and when one of them is SIGKILLed while it holds entries, the others
claim them back; in the end every entry was handled and nothing is pending.

The consumer processes are ``python -m benchmarks.scale_out worker``
(``benchmarks/scale_out.py`` measures the aggregate throughput)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import trio
from _paths import ROOT
from _procs import eventually

from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(60)

N = 20_000
STREAM, GROUP = "scale", "workers"
MIN_IDLE = 0.5


class Worker:
    """One consumer process; ``handled`` collects the ids it printed (``A <id>``)."""

    def __init__(self, url: str, name: str, work: float) -> None:
        self.name = name
        self.args = [sys.executable, "-m", "benchmarks.scale_out", "worker", url, STREAM, GROUP,
                     name, str(MIN_IDLE), str(work), "1"]
        self.proc: trio.Process | None = None
        self.handled: list[str] = []
        self.ready = trio.Event()
        self.mounted = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        self.proc = await trio.lowlevel.open_process(
            self.args, cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        task_status.started()
        assert self.proc.stdout is not None
        buf = b""
        async for chunk in self.proc.stdout:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"A "):
                    self.handled.append(line[2:].decode())
                elif line == b"R":
                    self.ready.set()
                elif line == b"M":
                    self.mounted.set()

    async def go(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.send_all(b"go\n")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)


async def _pending_of(client: Client, consumer: str) -> list[str]:
    rows = await client.execute("XPENDING", STREAM, GROUP, "-", "+", 10_000, consumer)
    return [r[0].decode() for r in rows]


async def _drained(client: Client, last: str) -> bool:
    for g in await client.execute("XINFO", "GROUPS", STREAM):
        info = dict(zip(g[::2], g[1::2], strict=True))
        if info[b"name"] == GROUP.encode():
            return bool(info[b"last-delivered-id"].decode() == last and info[b"pending"] == 0)
    return False


async def test_four_processes_one_sigkilled_all_handled_nothing_pending(
    redis_url: str, client: Client
) -> None:
    await client.execute("XGROUP", "CREATE", STREAM, GROUP, "0", "MKSTREAM")
    # three fast workers, and a slow one that always holds a batch: the victim
    fast = [Worker(redis_url, f"fast{i}", work=0.0) for i in range(3)]
    victim = Worker(redis_url, "victim", work=0.05)
    workers = [*fast, victim]
    try:
        await _run(client, fast, victim)
    finally:
        for w in workers:  # a failed test leaves no process behind
            if w.proc is not None and w.proc.returncode is None:
                w.proc.kill()


async def _run(client: Client, fast: list[Worker], victim: Worker) -> None:
    workers = [*fast, victim]
    async with trio.open_nursery() as nursery:
        for w in workers:
            await nursery.start(w.run)
        with trio.fail_after(30):
            for w in workers:
                await w.ready.wait()
        ids: list[str] = []
        for start in range(0, N, 1000):
            replies = await client.pipeline(
                [("XADD", STREAM, "*", "n", str(i)) for i in range(start, min(start + 1000, N))]
            )
            ids += [r.decode() for r in replies]
        for w in workers:
            await w.go()
        with trio.fail_after(30):
            for w in workers:
                await w.mounted.wait()

        await eventually(lambda: sum(len(w.handled) for w in workers) >= N // 2 and bool(victim.handled),
                         timeout=20, what="half of the entries handled")
        victim.signal(signal.SIGKILL)
        assert victim.proc is not None
        await victim.proc.wait()
        stranded = set(await _pending_of(client, "victim")) - set(victim.handled)
        assert stranded, "the victim held no unhandled entry when it was killed"

        await eventually(lambda: _drained(client, ids[-1]), timeout=20,
                         what="every entry delivered and acknowledged")
        for w in fast:
            w.signal(signal.SIGTERM)
        for w in fast:
            assert w.proc is not None
            assert await w.proc.wait() == 0
    handled_by_survivors = {i for w in fast for i in w.handled}
    handled = handled_by_survivors | set(victim.handled)
    assert handled == set(ids)
    assert stranded <= handled_by_survivors  # claimed back after MIN_IDLE
    assert int((await client.execute("XPENDING", STREAM, GROUP))[0]) == 0
    assert all(len(w.handled) > 0 for w in fast)  # the work was shared
