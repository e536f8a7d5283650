"""The benchmarks of ACKs carrying writes measure what they say: the raw floor
and the library apply the same writes, once per message.

``benchmarks/workloads.py`` (``--only write``: its tables of writes, tiny)
and the commands ``benchmarks/instructions.py`` counts on the server (the
raw pipeline and the library finalizer's first round), sent to a real
Redis.  Each runs in a child process from the project's root (the
``benchmarks`` package is not installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _paths import ROOT

pytestmark = pytest.mark.timeout(180)

# a bound, not an expectation: a few seconds on an idle machine
BOUND = 150


def test_workloads_writes_tables_run() -> None:
    """``bench workloads --only write`` prints the two tables of writes, their
    summary rows and the writes target, and nothing else; every run checked
    that each message's writes were applied once (it raises otherwise)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.workloads", "300", "--rounds", "1", "--only", "write"],
        capture_output=True, text=True, timeout=BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for line in ("stream ACK carrying one write (HINCRBY): 300 entries",
                 "stream ACK carrying five writes (HINCRBY, SADD, XADD, HSET, EXPIRE): 300 entries",
                 "  stream ACK + one write ", "  stream ACK + five writes ",
                 "stream ACK + one write >= 0.60 x overlapped floor"):
        assert line in out, out
    # (the header names the checkout's last commit, whose subject may say anything)
    tables = "\n".join(x for x in out.splitlines() if not x.startswith("trio_redis_finalize from "))
    for other in ("stream RETRY", "reliable list ACK", "Pub/Sub", "latency", "memory"):
        assert other not in tables, out


_SERVER_COMMANDS = """
import sys

import trio

from benchmarks import instructions, workloads
from trio_redis_finalize import StreamSubscription
from trio_redis_finalize._transport import open_client

async def main(url: str) -> None:
    target = StreamSubscription("s", "g").target("me")
    async with open_client(url) as c:
        for writes in (1, 5):
            for library in (False, True):
                await c.execute("DEL", "s", *workloads.WRITE_KEYS)
                await c.pipeline([("XADD", "s", "*", "payload", b"x") for _ in range(250)])
                await c.execute("XGROUP", "CREATE", "s", "g", "0")
                while reply := await c.execute("XREADGROUP", "GROUP", "g", "me", "COUNT", 100,
                                               "STREAMS", "s", ">"):
                    cmds = instructions._writes_commands(target, reply[0][1], writes, library)
                    if library:
                        assert len(cmds) < len(reply[0][1]), cmds  # batched: not one per entry
                    await c.pipeline(cmds)
                assert int((await c.execute("XPENDING", "s", "g"))[0]) == 0
                await workloads._check_writes(c, 250)  # raises unless each applied once
                print(writes, library, "ok")

trio.run(main, sys.argv[1])
"""


def test_instructions_server_writes_commands_finalize(redis_url: str) -> None:
    """What the server writes table counts finalizes every entry and applies
    its writes once: the raw pipeline, and the library's batch (one write,
    and the five built per message)."""
    proc = subprocess.run([sys.executable, "-c", _SERVER_COMMANDS, redis_url],
                          capture_output=True, text=True, timeout=BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "False", "ok", "1", "True", "ok",
                                   "5", "False", "ok", "5", "True", "ok"]
