"""CPU cost of the finalizer's sans-IO core per batch: build, answer, settle.

No server: each batch is driven as the finalizer drives it
(``FinalizeBatch`` -> ``commands()`` -> ``receive(replies)`` until done ->
``result()`` -> ``forget()``), answered with success replies at once.  It
shows what finalization costs the process beside the round trips, and keeps
the hot path (a batch of plain ACKs on a stream: one XACK) honest; last,
batches of ACKs carrying writes (one ``HINCRBY``, the same outcome for all;
the five writes of ``workloads.five_writes``, built per message).  Best of
``ROUNDS`` rounds, microseconds per batch and per delivery.

    python -m benchmarks.finalize_core
"""

from __future__ import annotations

import time
from typing import Any

from trio_redis_finalize import ACK, DROP, RETRY, Delivery, ReliableListSubscription, StreamSubscription
from trio_redis_finalize._core._finalize import FinalizerCore, Item
from trio_redis_finalize._core._types import Target

from ._common import internal

ROUNDS = 5


def _stream_items(n: int, outcome: Any) -> tuple[Target, list[Item]]:
    t = StreamSubscription("orders", "billing").target("c1")
    return t, [(Delivery(source="orders", id=f"{i}-0", fields={b"k": b"v"}, data=None, attempt=1,
                         origin_id=f"{i}-0", mount=t.name), outcome) for i in range(n)]


def _five_writes_items(n: int) -> tuple[Target, list[Item]]:
    """``n`` ACKs on a stream, each carrying the five writes of
    ``workloads.five_writes`` built from its id (the outcomes built before
    the clock starts: the core's cost only)."""
    from .workloads import five_outcome

    t, items = _stream_items(n, ACK)
    return t, [(d, five_outcome(d)) for d, _ in items]


def _list_items(n: int) -> tuple[Target, list[Item]]:
    t = ReliableListSubscription("q").target("c1")
    return t, [(Delivery(source="q", id=None, fields={}, data=b"x%d" % i, attempt=1,
                         origin_id="o", raw=b"x%d" % i, mount=t.name), ACK) for i in range(n)]


def _ok(cmd: Any) -> Any:
    if cmd[0] == b"EVALSHA":
        if cmd[1] in _BATCHED:  # a batched script call: each delivery finalized
            return [_deliveries(cmd)]
        return b"9-0"
    return 1


try:  # the batched scripts (not in every checkout TRF_BENCH_LIB measures)
    from trio_redis_finalize._core._batch import BATCHED as _BATCHED
    STREAM_ZADD_ACK_BATCH = internal("_scripts").STREAM_ZADD_ACK_BATCH
    _FIXED = frozenset({STREAM_ZADD_ACK_BATCH.sha,
                        internal("_scripts").STREAM_COPY_ACK_BATCH.sha})
except (ImportError, AttributeError):  # pragma: no cover - an older checkout
    _BATCHED = _FIXED = frozenset()


def _deliveries(cmd: Any) -> int:
    """How many deliveries a batched call carries (see ``_lua``), cheaply."""
    if cmd[1] not in _FIXED:  # a batched writes call: its deliveries' writes vary
        return len(internal("_batch").batch_singles(cmd))
    if cmd[1] == STREAM_ZADD_ACK_BATCH.sha:  # ... lo hi count (id delay member)...
        return (len(cmd) - 10) // 3
    i, n = 11, 0  # ... lo hi count (id n values...)...
    while i < len(cmd):
        i += 2 + cmd[i + 1]
        n += 1
    return n


def _per_batch(t: Target, items: list[Item], reps: int) -> float:
    core = FinalizerCore(t)
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(reps):
            b = core.batch(items)
            while cmds := b.commands():
                b.receive([_ok(c) for c in cmds])
            b.result().forget()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    print(f"finalizer core, per batch (no I/O; best of {ROUNDS})")
    print(f"  {'batch':36s} {'us/batch':>10s} {'us/delivery':>12s}")
    cases: list[tuple[str, Target, list[Item], int]] = [
        ("1000 ACK, stream (one XACK)", *_stream_items(1000, ACK), 200),
        ("100 ACK, stream", *_stream_items(100, ACK), 2000),
        ("10 ACK, stream", *_stream_items(10, ACK), 10000),
        ("1000 DROP, stream", *_stream_items(1000, DROP), 200),
        ("1000 ACK, reliable list (LREM each)", *_list_items(1000), 200),
        ("1000 RETRY, stream (a plan each)", *_stream_items(1000, RETRY), 10),
        ("100 ACK + HINCRBY, stream", *_stream_items(100, ACK.with_writes(("HINCRBY", "t", "n", 1))),
         200),
        ("100 ACK + five writes each, stream", *_five_writes_items(100), 100),
    ]
    for name, t, items, reps in cases:
        s = _per_batch(t, items, reps)
        print(f"  {name:36s} {s * 1e6:10.1f} {s * 1e6 / len(items):12.3f}")


if __name__ == "__main__":
    main()
