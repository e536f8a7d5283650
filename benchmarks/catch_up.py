"""Optional: the modules one stream catch-up passes through, counted.

    python -m benchmarks catch_up     # or: python3 dev.py bench catch_up

Not a timing: a count of the package's modules whose functions run while
one ``StreamReader.catch_up`` is on the stack, on a private redis-server.
The catch-up is a RECLAIM mount's first (consumer ``me``, ``count=10``),
which does all of it at once:

* **own-PEL recovery**: 2 entries pending for ``me`` (read before a
  "restart", delivery count 1), taken back with ``XPENDING`` + ``XCLAIM``;
* **a dead consumer's take-over**: 2 entries pending for ``dead``, registered
  in the group's registry and without a heartbeat key (what a killed
  consumer leaves), taken by the look at the group (``REAP``);
* **a claim**: 2 entries idle 10 minutes pending for ``other`` (never
  registered), claimed by RECLAIM's ``XAUTOCLAIM`` (``min_idle=1``);
* **the hand-over**: every entry taken goes to the mount's work queue
  (``Context.deliver``); a no-op handler acknowledges them.

How it counts: ``sys.setprofile`` sees every Python function call; a call
counts when its code is in the package and the first ``catch_up`` frame is
among its callers (``f_back``, as the coroutines are chained while they
run), and only its first entry counts (a coroutine resumed after an
``await`` calls again with the same frame).  What the catch-up hands over
and the tasks it wakes (the handlers, the finalizer, the heartbeat) run
later on other stacks: not counted.  Code the interpreter generates
(dataclasses' ``__init__``) has no file in the package: not counted.  A
module is named by its path under ``trio_redis_finalize/``.

The modules are printed in groups:

* **the stream's own** (``_forms/stream/``, ``_core/stream/``): the
  catch-up's logic, the reader included;
* **the runtime's hand-over** (``_hand_over``, and ``_mount`` when it is
  entered): where a taken entry goes;
* **shared by every form**: the transport (``_transport/``), the shared
  core (``_core/_*.py``: commands, replies, plans, the Backoff schedule
  ...), the forms' shared I/O (``_forms/_*.py``) and the package's
  utilities (``_keys``, ``_shutdown`` ...).

"Own" is the first two groups; the reader's calls into other modules are
counted too ("returns to the reader": each such call returns to it once).
The own groups are the same from run to run; the shared ones grow by
``_core/_caps`` and ``_transport/_keepalive`` in a run where the client's
pool happens to dial a connection during the catch-up (all its others busy).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import trio

import trio_redis_finalize
from trio_redis_finalize import ACK, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._core.stream import liveness
from trio_redis_finalize._forms.stream.reader import StreamReader
from trio_redis_finalize._transport import Client, open_client

from ._common import redis_server

PACKAGE = Path(trio_redis_finalize.__file__).resolve().parent
STREAM, GROUP, ME = "walk:stream", "walk", "me"
EACH = 2
"""Entries per part: the own PEL, the dead consumer's, the claimed."""

RUNTIME = ("_mount", "_hand_over")
"""The runtime's modules a hand-over enters."""


def module_of(filename: str) -> str | None:
    """``_forms/stream/own_pel`` for a file of the package, else None."""
    try:
        rel = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    return str(rel.with_suffix(""))


def group_of(module: str) -> str:
    """Which group of the module docstring ``module`` is in."""
    if module.startswith(("_forms/stream/", "_core/stream/")):
        return "own: the stream's"
    if module in RUNTIME:
        return "own: the runtime's hand-over"
    if module.startswith("_transport/"):
        return "shared: transport"
    if module.startswith("_core/"):
        return "shared: core"
    if module.startswith("_forms/"):
        return "shared: forms' I/O"
    return "shared: utilities"


@dataclass
class Walk:
    """What one catch-up called: module -> the package's functions entered there."""

    calls: dict[str, Counter[str]] = field(default_factory=dict)
    returns_to_reader: int = 0
    """Calls from the reader's module into another module (each returns to it once)."""
    done: bool = False

    def own(self) -> list[str]:
        return sorted(m for m in self.calls if group_of(m).startswith("own"))

    def report(self) -> str:
        groups: dict[str, list[str]] = {}
        for m in sorted(self.calls):
            groups.setdefault(group_of(m), []).append(m)
        lines = []
        for g in sorted(groups, key=lambda g: (not g.startswith("own"), g)):
            lines.append(f"  {g} ({len(groups[g])}):")
            for m in groups[g]:
                names = ", ".join(sorted(self.calls[m]))
                lines.append(f"    {m:32} {sum(self.calls[m].values()):4} calls: {names}")
        runtime = sum(m in RUNTIME for m in self.calls)
        lines.append(f"  modules: {len(self.calls)}, own: {len(self.own())} "
                     f"({len(self.own()) - runtime} the stream's + {runtime} the runtime's), "
                     f"shared: {len(self.calls) - len(self.own())}")
        lines.append(f"  returns to the reader: {self.returns_to_reader}")
        return "\n".join(lines)


def profiler(walk: Walk) -> Any:
    """The ``sys.setprofile`` function that fills ``walk`` (see the module docstring)."""
    target = StreamReader.catch_up.__code__
    reader = module_of(target.co_filename)
    first: list[FrameType] = []
    seen: set[int] = set()
    kept: list[FrameType] = []  # every frame counted, kept alive: ids stay unique

    def on(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or walk.done:
            return
        code = frame.f_code
        if code is target and not first:
            first.append(frame)
        module = module_of(code.co_filename)
        if module is None or not first or id(frame) in seen:
            return
        caller: str | None = None
        f: FrameType | None = frame.f_back
        while f is not None and f is not first[0]:
            if caller is None:
                caller = module_of(f.f_code.co_filename)
            f = f.f_back
        if f is None and frame is not first[0]:
            return  # not below the first catch-up
        seen.add(id(frame))
        kept.append(frame)
        if frame is first[0]:
            caller = None
        elif caller is None:
            caller = reader
        walk.calls.setdefault(module, Counter())[code.co_qualname] += 1
        if caller == reader and module != reader:
            walk.returns_to_reader += 1

    return on


async def seed(client: Client) -> None:
    """The three parts (see the module docstring), ``EACH`` entries each."""
    await client.execute("DEL", STREAM, liveness.registry_key(STREAM, GROUP))
    await client.execute("XGROUP", "CREATE", STREAM, GROUP, "0", "MKSTREAM")
    for owner in (ME, "dead", "other"):
        ids = [await client.execute("XADD", STREAM, "*", "n", str(i), "by", owner)
               for i in range(EACH)]
        await client.execute("XREADGROUP", "GROUP", GROUP, owner, "COUNT", EACH,
                             "STREAMS", STREAM, ">")
        await client.execute("XCLAIM", STREAM, GROUP, owner, 0, *ids, "IDLE", 600_000, "JUSTID")
    # registered as the library registers a consumer (heartbeat 200 ms, plain),
    # with no heartbeat key: dead
    await client.execute("HSET", liveness.registry_key(STREAM, GROUP), "dead", "200 plain")


async def measure(url: str) -> Walk:
    """One catch-up's walk, on the server at ``url``."""
    async with open_client(url) as client:
        await seed(client)
    walk = Walk()
    handled: list[str] = []

    async def handle(d: Delivery) -> Outcome:
        assert d.id is not None
        handled.append(d.id)
        return ACK

    sub = StreamSubscription(STREAM, GROUP, mode=Mode.RECLAIM, min_idle=1.0, heartbeat=5.0,
                             count=10, block=0.05)
    async with open_consumer(url, name=ME) as consumer:
        sys.setprofile(profiler(walk))
        try:
            await consumer.mount(sub, handle)
            with trio.fail_after(30):
                while len(handled) < 3 * EACH:
                    await trio.sleep(0.01)
        finally:
            walk.done = True
            sys.setprofile(None)
    assert len(set(handled)) == 3 * EACH, handled
    return walk


def main(argv: list[str] | None = None) -> None:
    with redis_server() as server:
        walk = trio.run(measure, server.url)
    print("\nOne stream catch-up (own-PEL recovery, a RECLAIM claim, a dead consumer's "
          "take-over, the hand-over): modules entered")
    print(walk.report())


if __name__ == "__main__":
    main(sys.argv[1:])
