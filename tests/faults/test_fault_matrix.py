"""Fault matrix: every command kind on every path x lost reply / blackhole / error replies.

Like the crash-point enumeration (``test_crash_points.py``), but the faults
are on the wire: a command-aware proxy (``faults.cmdproxy``) sits between
the consumer and a real redis-server and, for one *command kind* (``XACK``,
``XREADGROUP>``, ``EVALSHA:stream_copy_ack``, ``BLMOVE``, ``SET`` (the
heartbeat), ...), applies one fault to its first request:

* ``lost``: the server runs it, the reply is dropped, the connection reset;
* ``blackhole``: from that request on the connection forwards nothing either
  way and stays open (the library must notice by its own deadline);
* ``errors``: the first ten requests of that kind are each answered with
  another transient error (OOM, BUSY, READONLY, LOADING, MASTERDOWN, MISCONF,
  NOREPLICAS, TRYAGAIN, CLUSTERDOWN; NOSCRIPT for scripts) *instead of*
  running; scripts also get the Redis 6.2 "Error running script ... -READONLY"
  form and the bare form a script's inner error has on 7.0.

Each case runs a short workload (a handful of messages whose handlers return
ACK, RETRY, DROP, retry_after, or RETRY until ``max_attempts`` sends them to
the dead letter, or raise under a short ``on_error=Backoff``; identical list
elements; pre-seeded state so that recovery paths run: an own PEL /
processing list from a previous life, a dead consumer's entries to reclaim /
reap -- for the stream reaper, a dead consumer registered by the library
whose heartbeat is gone --, a Backoff due time not passed yet for the seeded
delivery) until Redis holds nothing left to do, shuts down gracefully, and
checks.  (A give-back workload first stops while a handler holds on, so that
what was read and not started is given back, then a second life does the
rest; the ``cluster`` workloads consume a one-node Redis Cluster through the
proxy, whose ``CLUSTER SLOTS`` reply names the proxy.)  The checks:

* no loss: every message was finalized by a handler (ACK / DROP / the dead
  letter) or is still physically in Redis;
* no hang: the case settles within a few seconds (``fail_after``), mount and
  shutdown included;
* duplicates explained: handler calls per message never exceed what the
  handler asked for plus one per fault that can make a duplicate (a lost or
  blackholed reply; an error reply means "did not run" and makes none);
* attempts: a message sent to the dead letter had ``max_attempts`` handler
  calls (a fault never spends an attempt without a call);
* counters: ``dead_lettered`` equals the dead letter's length, ``copied``
  (streams) the copies in the stream.

(In a Redis Cluster a dead letter in another slot than its source is copied
ungated, then the original removed: a copy whose reply was lost is sent
again, one more dead letter per such fault -- documented in
docs/scaling_out.rst; the delivery counts once.)

The library's timers are shortened for the run (deadlines, backoff) the way
``test_crash_points.py`` does, so that a blackhole costs a fraction of a
second instead of five.

Some kinds depend on what the server can do (``_core._caps``): a
:class:`Native` kind is the native command where the session's server has
the capability (Redis 8.2: ``XACKDEL``, the native trim script, the native
durable-delay script) and the fallback's elsewhere -- chosen from the
detected capabilities, never from the server's name.  The detection itself
(``COMMAND`` in every connection's handshake) is a kind too.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
from _procs import eventually
from redis import exceptions as rexc

from faults.checks import list_state, stream_state
from faults.cmdproxy import (
    BLACKHOLE,
    LOST,
    TRANSIENT_ERRORS,
    CommandProxy,
    Fault,
    error,
    kind_of,
    script_names,
    serving,
    wrapped,
)
from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Backoff,
    ChannelSubscription,
    DelayedRetry,
    Delivery,
    ListSubscription,
    Mode,
    Outcome,
    ReliableListSubscription,
    Retention,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._caps import Capabilities
from trio_redis_finalize._core._recovery import SCHEDULE, schedule_key, schedule_member
from trio_redis_finalize._core._types import content_origin
from trio_redis_finalize._core.reliable_list import liveness as reliable
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._transport import Client, open_client
from trio_redis_finalize.testing import RedisCluster, RedisServer

NAME, DEAD_NAME = "w1", "w0"
S, G = "orders", "billing"
S_DEAD = "orders-dead"
Q = "jobs"
Q_DEAD = "jobs-dead"
Q_PROC = "{jobs}:processing:" + NAME
Q_PROC_DEAD = "{jobs}:processing:" + DEAD_NAME
SL = "plain-jobs"
CHAN = "events"
MAX_ATTEMPTS = 3
# what each plan's handler calls are: ack, drop: 1; retry, later: 2; dead: max_attempts.
# Under on_error=Backoff: "raise" raises once, then ACKs; "fail" always raises (the
# dead letter after max_attempts).  "twin": an ACK, its element pushed twice (identical
# bytes: counted removals).  "hold": an ACK, its handler holding on until the
# shutdown begins (what was read meanwhile is given back unstarted).
CALLS = {"ack": 1, "drop": 1, "retry": 2, "later": 2, "dead": MAX_ATTEMPTS,
         "raise": 2, "fail": MAX_ATTEMPTS, "twin": 1, "hold": 1}
DEAD_PLANS = ("dead", "fail")
COPIES = {"twin": 2}
"""Identical copies pushed of a plan's element (list forms; 1 unless named)."""
QUICK_BACKOFF = Backoff(base=0.05, cap=0.1, window=0)


# -- timers: short, as in test_crash_points ----------------------------------

def _fast_backoff(real: Callable[..., float]) -> Callable[..., float]:
    def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0) -> float:
        return min(real(attempt, base=base / 10, cap=cap / 10), 0.05)

    return backoff


@pytest.fixture(autouse=True)
def _quick_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every module's copy of the deadlines and of ``backoff``, shortened."""
    from trio_redis_finalize import _deadlines

    real = _deadlines.backoff
    fast = _fast_backoff(real)
    # (0.6 s: a round trip on a loaded CI machine can take 0.4 s)
    values = {"FINALIZE_TIMEOUT": 0.6, "FINALIZE_GRACE": 0.3, "READ_MARGIN": 0.3,
              "_MOVE_RETRY": 0.1}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("trio_redis_finalize") or mod is None:
            continue
        for attr, current in list(vars(mod).items()):
            # any other deadline (a set-up deadline, ...): at most 1 s
            if (attr.isupper() and attr.endswith(("TIMEOUT", "DEADLINE"))
                    and isinstance(current, float) and attr not in values):
                monkeypatch.setattr(mod, attr, min(current, 1.0))
        for attr, value in values.items():
            if isinstance(getattr(mod, attr, None), (int, float)):
                monkeypatch.setattr(mod, attr, value)
        if getattr(mod, "backoff", None) is real:
            monkeypatch.setattr(mod, "backoff", fast)


# -- workloads ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Native:
    """A command kind that depends on the server: ``native`` where it has the
    capability ``cap`` (a ``Capabilities`` flag), else ``fallback``."""

    cap: str
    native: str
    fallback: str

    def __str__(self) -> str:
        return f"{self.native}|{self.fallback}"

    def on(self, caps: Capabilities) -> str:
        return self.native if getattr(caps, self.cap) else self.fallback


Kind = str | Native


def resolve(kind: Kind, caps: Capabilities) -> str:
    """The command kind the session's server gets for ``kind``."""
    return kind.on(caps) if isinstance(kind, Native) else kind


@dataclasses.dataclass(frozen=True)
class Workload:
    id: str
    form: str  # stream, list, simple, channel
    kinds: tuple[Kind, ...]  # the command kinds this workload is the test of
    make: Callable[[], Any]  # the subscription
    plans: tuple[str, ...] = ("ack", "retry", "drop", "later", "dead")
    # "own": own PEL / processing list; "dead": a dead consumer's too (streams:
    # one without a heartbeat, for XAUTOCLAIM); "registered": a dead stream
    # consumer the library registered, its heartbeat gone (for the reaper)
    seed: str = ""
    concurrency: int = 2
    dead_letter: str | None = None
    writes: bool = False  # each message's last outcome carries a write (exactly-once effects)
    batch: bool = False  # mounted with batch=True: one handler call per read's deliveries
    on_error: Backoff | None = None  # mounted with this on_error (None: the default)
    # the seeded delivery failed in its previous life under a Backoff that is not
    # due yet: its due time (SCHEDULE_MS from the seeding) is in the schedule
    scheduled: bool = False
    # a first life stops while a "hold" handler runs (what was read and not
    # started is given back); a second life then does the rest
    stop_early: bool = False
    # consumed through a redis+cluster:// URL (a one-node Redis Cluster behind the
    # proxy): the dead letter, in another slot, is copied first, then removed
    cluster: bool = False


SCHEDULE_MS = 1500
"""Far enough ahead that the consumer's start (its first recovery or claim) finds
it not due even on a loaded CI machine (400 ms was not, with two burners)."""


def _stream(**kw: Any) -> Callable[[], StreamSubscription]:
    return lambda: StreamSubscription(S, G, **{"block": 0.05, "max_attempts": MAX_ATTEMPTS,
                                              "dead_letter": S_DEAD, "heartbeat": 1.5, **kw})


def _rlist(**kw: Any) -> Callable[[], ReliableListSubscription]:
    return lambda: ReliableListSubscription(Q, **{"block": 0.05, "max_attempts": MAX_ATTEMPTS,
                                                 "dead_letter": Q_DEAD, "heartbeat": 1.5, **kw})


DURABLE = {"delayed_retry": DelayedRetry.DURABLE_ZSET}
WORKLOADS = [
    Workload("stream-plain", "stream",
             ("TYPE", "XGROUP CREATE", "XINFO GROUPS", "XPENDING", "XCLAIM", "XREADGROUP>", "XACK",
              "EVALSHA:stream_copy_ack", "EVALSHA:stream_remove_receipt",
              "EVALSHA:stream_copy_once"),
             _stream(), seed="own", dead_letter=S_DEAD),
    # the heartbeat, the registry, the reaper (a registered dead consumer's
    # entry taken over, the consumer deleted), the hand-back at shutdown
    Workload("stream-reap", "stream",
             ("EVALSHA:heartbeat_claim", "EVALSHA:heartbeat_renew", "XINFO CONSUMERS", "HGETALL",
              "PTTL", "XPENDING IDLE", "EVALSHA:stream_reap", "EVALSHA:stream_stop"),
             _stream(), seed="registered", dead_letter=S_DEAD),
    # the lease: one owner-checked script (EVALSHA:stream_lease)
    Workload("stream-reclaim", "stream", ("XAUTOCLAIM", "EVALSHA:stream_lease"),
             _stream(mode=Mode.RECLAIM, min_idle=0.6), seed="dead", dead_letter=S_DEAD),
    Workload("stream-claiming", "stream", ("XPENDING", "XAUTOCLAIM", "EVALSHA:stream_lease"),
             _stream(mode=Mode.CLAIMING, min_idle=0.6), plans=("ack", "retry", "drop"),
             seed="dead", dead_letter=S_DEAD),
    # on_error=Backoff: the due times written (backoff_schedule) and the redelivery
    # (stream_redeliver); the own PEL's entry failed in a previous life, its Backoff
    # not due yet: the recovery reads the schedule and lets it wait out the rest
    Workload("stream-backoff", "stream",
             ("EVALSHA:backoff_schedule", "EVALSHA:stream_redeliver",
              "EVALSHA:backoff_schedule_left", "XRANGE"),
             _stream(), plans=("ack", "raise", "raise", "fail"), seed="own", scheduled=True,
             dead_letter=S_DEAD, on_error=QUICK_BACKOFF),
    # a claim of a stopped consumer's entry whose Backoff is not due yet: it waits
    # out the rest (its count given back, only while still this consumer's at the
    # claim's count: stream_give_back), then the redelivery
    Workload("stream-reclaim-backoff", "stream",
             ("EVALSHA:backoff_schedule_left", "EVALSHA:stream_give_back",
              "EVALSHA:stream_redeliver"),
             _stream(mode=Mode.RECLAIM, min_idle=0.6), plans=("ack", "raise", "ack"),
             seed="dead", scheduled=True, dead_letter=S_DEAD, on_error=QUICK_BACKOFF),
    Workload("stream-delete", "stream",
             (Native("xackdel", "XACKDEL", "XDEL"), "EVALSHA:stream_copy_ack_ex", "COMMAND"),
             _stream(retention=Retention.DELETE_ON_FINALIZE), dead_letter=S_DEAD),
    Workload("stream-delete-durable", "stream",
             (Native("xackdel", "EVALSHA:stream_zadd_ackdel", "EVALSHA:stream_zadd_ack_del"),),
             _stream(retention=Retention.DELETE_ON_FINALIZE, **DURABLE), dead_letter=S_DEAD),
    Workload("stream-trim", "stream",
             (Native("acked_trim", "EVALSHA:trim_acked_native", "EVALSHA:trim_acked"),),
             _stream(retention=Retention.TRIM_ACKED), dead_letter=S_DEAD),
    Workload("stream-durable", "stream",
             ("EVALSHA:stream_zadd_ack", "EVALSHA:move_due_to_stream"),
             _stream(**DURABLE), dead_letter=S_DEAD),
    # batches of two-step deliveries (concurrency 1: one batch): batched script calls
    Workload("stream-batched", "stream", ("EVALSHA:stream_copy_ack_batch",),
             _stream(), plans=("retry", "retry", "dead", "dead", "ack"), concurrency=1,
             dead_letter=S_DEAD),
    Workload("stream-durable-batched", "stream",
             ("EVALSHA:stream_zadd_ack_batch", "EVALSHA:stream_copy_ack_batch"),
             _stream(**DURABLE), plans=("later", "later", "dead", "dead"), concurrency=1,
             dead_letter=S_DEAD),
    Workload("stream-delete-batched", "stream", ("EVALSHA:stream_copy_ack_batch",),
             _stream(retention=Retention.DELETE_ON_FINALIZE, copy_maxlen=1000),
             plans=("retry", "retry", "dead", "dead"), concurrency=1, dead_letter=S_DEAD),
    # exactly-once effects: the finalizations carry a write, each message's counted once
    Workload("stream-writes", "stream",
             ("EVALSHA:stream_writes", "EVALSHA:stream_remove_receipt", "EVALSHA:stream_copy_once",
              "XREADGROUP>"),
             _stream(), seed="own", dead_letter=S_DEAD, writes=True),
    Workload("stream-delete-writes", "stream", ("EVALSHA:stream_writes",),
             _stream(retention=Retention.DELETE_ON_FINALIZE, **DURABLE), dead_letter=S_DEAD,
             writes=True),
    # ACKs and DROPs carrying writes, one batch (concurrency 1): batched writes calls
    Workload("stream-writes-batched", "stream", ("EVALSHA:stream_writes_ack_batch",),
             _stream(), plans=("ack", "ack", "drop", "ack"), concurrency=1,
             dead_letter=S_DEAD, writes=True),
    # the batch handler (mount(..., batch=True)): the same commands, one call per read
    Workload("stream-batch-handler", "stream",
             ("XREADGROUP>", "XACK", "EVALSHA:stream_copy_ack_batch", "EVALSHA:stream_copy_once"),
             _stream(), seed="own", dead_letter=S_DEAD, batch=True),
    Workload("stream-writes-batch-handler", "stream", ("EVALSHA:stream_writes",),
             _stream(), dead_letter=S_DEAD, writes=True, batch=True),
    Workload("list-batch-handler", "list", ("BLMOVE", "LREM", "EVALSHA:list_copy_remove"),
             _rlist(), seed="dead", dead_letter=Q_DEAD, batch=True),
    Workload("list", "list",
             ("TYPE", "EVALSHA:heartbeat_claim", "EVALSHA:heartbeat_renew", "HGETALL", "PTTL",
              "LRANGE", "EVALSHA:reliable_list_reap",
              "EVALSHA:reliable_list_bump", "BLMOVE", "LMOVE", "LREM", "EVALSHA:list_copy_remove",
              "EVALSHA:reliable_list_stop"),
             _rlist(), seed="dead", dead_letter=Q_DEAD),
    Workload("list-writes", "list", ("EVALSHA:list_writes", "BLMOVE"),
             _rlist(), seed="dead", dead_letter=Q_DEAD, writes=True),
    Workload("list-writes-batched", "list", ("EVALSHA:list_writes_remove_batch",),
             _rlist(), plans=("ack", "ack", "drop", "ack"), concurrency=1,
             dead_letter=Q_DEAD, writes=True),
    Workload("list-durable", "list",
             ("EVALSHA:list_zadd_remove", "EVALSHA:move_due_to_list"),
             _rlist(**DURABLE), dead_letter=Q_DEAD),
    # on_error=Backoff on a reliable list: the due times written, the bump of a
    # redelivery, the rescan at start reading the schedule of its own element (failed
    # in a previous life, not due yet); a runtime retry_after's delayed copy; identical
    # elements held at once, whose removals are counted (list_remove)
    Workload("list-backoff", "list",
             ("EVALSHA:backoff_schedule", "EVALSHA:backoff_schedule_left",
              "EVALSHA:reliable_list_bump", "EVALSHA:reliable_list_delayed_copy",
              "EVALSHA:list_remove"),
             _rlist(), plans=("raise", "later", "twin", "fail"), seed="own", scheduled=True,
             dead_letter=Q_DEAD, on_error=QUICK_BACKOFF),
    # a reliable list's runtime retry_after: the held copy's due time written
    # beside the processing list (backoff_schedule; no Backoff here), sent again
    # after a fault until the copy is due
    Workload("list-later", "list", ("EVALSHA:backoff_schedule",),
             _rlist(), plans=("later", "later", "ack"), dead_letter=Q_DEAD),
    # a stop while a handler runs: what was read and not started is given back
    # onto the queue (uncounted), and a second life handles it as a first attempt
    Workload("list-give-back", "list", ("EVALSHA:reliable_list_give_back",),
             _rlist(), plans=("hold", "ack", "ack", "ack"), concurrency=1, stop_early=True,
             dead_letter=Q_DEAD),
    # the same on a stream: the entries read and not started get their count set
    # back (one owner-checked script, sent by the finalizer and again at the stop)
    Workload("stream-give-back", "stream", ("EVALSHA:stream_give_back",),
             _stream(), plans=("hold", "ack", "ack", "ack"), concurrency=1, stop_early=True,
             dead_letter=S_DEAD),
    # Redis Cluster, the dead letter in another slot than the source: the copy
    # with the server's time (stream_xadd, list_dead_push), then the removal
    Workload("stream-cluster", "stream", ("EVALSHA:stream_xadd",),
             _stream(), plans=("dead", "ack"), dead_letter=S_DEAD, cluster=True),
    Workload("list-cluster", "list", ("EVALSHA:list_dead_push",),
             _rlist(), plans=("dead", "ack"), dead_letter=Q_DEAD, cluster=True),
    Workload("simple-list", "simple", ("BRPOP", "LPUSH"),
             lambda: ListSubscription(SL, block=0.05), plans=("ack", "later")),
    Workload("channel", "channel", ("SUBSCRIBE", "PUBLISH"),
             lambda: ChannelSubscription(CHAN), plans=("ack", "later"), concurrency=1),
]

PERIODIC_KINDS = {"EVALSHA:heartbeat_renew", "HGETALL", "PTTL", "EVALSHA:reliable_list_reap",
                  "XCLAIM", "EVALSHA:stream_lease"}
"""Kinds a periodic task sends (heartbeat, reaper, lease): it meets one error per period."""
ERRORS = [c for c in TRANSIENT_ERRORS if c != "NOSCRIPT"]
FAULT_GROUPS = ["lost", "blackhole", "errors"]


def _faults(group: str, kind: str) -> list[Fault]:
    """The faults of one case, for the 1st, 2nd, ... request of ``kind``."""
    if group == "lost":
        return [LOST]
    if group == "blackhole":
        return [BLACKHOLE]
    faults = [error(c) for c in ERRORS]
    if kind.startswith("EVALSHA:"):
        faults += [error("NOSCRIPT"), wrapped("READONLY"), wrapped("OOM")]
    return faults


CASES = [(w, k, g) for w in WORKLOADS for k in w.kinds for g in FAULT_GROUPS]


# -- the harness ----------------------------------------------------------------

@dataclasses.dataclass
class Case:
    workload: Workload
    kind: str
    group: str
    plan: dict[str, str] = dataclasses.field(default_factory=dict)  # origin -> plan
    calls: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # origin -> attempts
    finished: set[str] = dataclasses.field(default_factory=set)  # ACK / DROP returned
    done: Counter[str] = dataclasses.field(default_factory=Counter)  # ACK / DROP returns
    copies: Counter[str] = dataclasses.field(default_factory=Counter)  # identical copies pushed
    seeded: set[str] = dataclasses.field(default_factory=set)  # pending from a "previous life"
    remounted: str = ""

    @property
    def label(self) -> str:
        return f"[{self.workload.id}] {self.group} at {self.kind}"

    def outcome(self, d: Delivery) -> Outcome:
        origin = d.origin_id
        plan = self.plan.get(origin, "ack")
        calls = self.calls.setdefault(origin, [])
        calls.append(d.attempt)
        first = len(calls) == 1
        if plan == "drop":
            out: Outcome = DROP
        elif plan == "retry":
            out = RETRY if first else ACK
        elif plan == "later":
            out = retry_after(0.05) if first else ACK
        elif plan == "dead":
            out = RETRY
        elif plan == "fail" or (plan == "raise" and first):
            raise RuntimeError(f"planned failure of {origin} at attempt {d.attempt}")
        else:
            out = ACK
        if out in (ACK, DROP):
            self.finished.add(origin)
            self.done[origin] += 1
        if self.workload.writes and (out in (ACK, DROP) or d.attempt >= MAX_ATTEMPTS):
            # the message's one effect, committed with its last finalization
            out = out.with_writes(("HINCRBY", effects_key(self.workload), origin, 1))
        return out


def effects_key(workload: Workload) -> str:
    """Where a ``writes`` workload's handlers count each message's effect (in the
    source's hash slot)."""
    return "{orders}:effects" if workload.form == "stream" else "{jobs}:effects"


def _lease_plan(workload: Workload) -> set[str]:
    """Plans whose handler is slow (lease renewal, a claim while handled)."""
    return {"ack"} if workload.id in ("stream-reclaim", "stream-claiming") else set()


async def _produce(admin: Client, case: Case) -> None:
    w = case.workload
    if w.form == "stream":
        await admin.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
        ids = []
        for i, plan in enumerate(w.plans):
            eid = (await admin.execute("XADD", S, "*", "do", plan, "n", str(i))).decode()
            ids.append(eid)
            case.plan[eid] = plan
        if w.seed:
            # a previous life: the first entry ("ack") is pending, in the own
            # PEL or in a dead consumer's (idle long: claimed at once)
            owner = NAME if w.seed == "own" else DEAD_NAME
            await admin.execute("XREADGROUP", "GROUP", G, owner, "COUNT", 1, "STREAMS", S, ">")
            await admin.execute("XCLAIM", S, G, owner, 0, ids[0], "IDLE", 600_000, "JUSTID")
            if w.seed == "registered":  # as the library registers it; no heartbeat key
                await admin.execute("HSET", presence.registry_key(S, G), DEAD_NAME, "1500 plain")
            case.seeded.add(ids[0])
            if w.scheduled:
                await _schedule(admin, w.make().target(owner), ids[0], None)
        return
    if w.form == "list":
        await _push_plans(admin, case, Q)
        if w.seed:
            own, dead = b"ack:own", b"retry:dead"
            case.plan[content_origin(own)] = "ack"
            case.plan[content_origin(dead)] = "retry"
            case.seeded |= {content_origin(own), content_origin(dead)}
            await admin.execute("LPUSH", Q_PROC, own)
            await admin.execute("LPUSH", Q_PROC_DEAD, dead)
            await admin.execute("HSET", reliable.registry_key(Q), DEAD_NAME, Q_PROC_DEAD)
            if w.scheduled:
                await _schedule(admin, w.make().target(NAME), None, own)
        return
    if w.form == "simple":
        await _push_plans(admin, case, SL)


async def _schedule(admin: Client, t: Any, entry_id: str | None, raw: bytes | None) -> None:
    """A seeded delivery's attempt 1 failed under a Backoff due ``SCHEDULE_MS``
    from now: its due time in the schedule, as the library writes it."""
    member = schedule_member(t, entry_id, raw)
    await admin.evalsha(SCHEDULE, (schedule_key(t),), [member, SCHEDULE_MS, 1])


async def _push_plans(admin: Client, case: Case, key: str) -> None:
    """The workload's elements (``<plan>:<i>``) pushed onto list ``key`` (``COPIES``
    identical ones of a plan that names some), each one's plan noted by its
    content origin."""
    for i, plan in enumerate(case.workload.plans):
        element = f"{plan}:{i}".encode()
        origin = content_origin(element)
        case.plan[origin] = plan
        case.copies[origin] = COPIES.get(plan, 1)
        for _ in range(case.copies[origin]):
            await admin.execute("LPUSH", key, element)


def _scheduler_busy(consumer: Any) -> bool:
    """Runtime copies held, or a batch of them being sent (out of the heap meanwhile)."""
    sending = getattr(consumer.scheduler, "_sending", None)
    return bool(len(consumer.scheduler)) or (sending is not None and sending.locked())


async def _pending_work(admin: Client, case: Case, consumer: Any) -> str:
    """What is left to do ('' once Redis holds nothing more for the consumer)."""
    if _scheduler_busy(consumer) or any(m.in_hand or m.stats.in_flight for m in consumer.mounts):
        return f"in process: scheduler {len(consumer.scheduler)}, " + ", ".join(
            f"held {len(m.in_hand)} in flight {m.stats.in_flight}" for m in consumer.mounts)
    w = case.workload
    if w.form == "stream":
        summary = await admin.execute("XPENDING", S, G)
        delayed = int(await admin.execute("ZCARD", "{orders}:delayed"))
        last = await admin.execute("XREVRANGE", S, "+", "-", "COUNT", 1)
        info = {g[1]: g[7] for g in await admin.execute("XINFO", "GROUPS", S)}
        unread = bool(last) and info.get(G.encode()) != last[0][0]
        if int(summary[0]) or delayed or unread:
            return f"stream: {summary[0]} pending, {delayed} delayed, unread={unread}"
        return ""
    if w.form == "list":
        lens = await admin.pipeline([("LLEN", Q), ("LLEN", Q_PROC), ("LLEN", Q_PROC_DEAD),
                                     ("ZCARD", "{jobs}:delayed")])
        return f"list: queue/processing/dead consumer's/delayed = {lens}" if any(lens) else ""
    if w.form == "simple":
        n = int(await admin.execute("LLEN", SL))
        return f"list: {n} queued" if n else ""
    return ""


async def _read_all(admin: Client, state: dict[str, Any], case: Case) -> None:
    """Until a "hold" handler runs and the reader has read the whole queue
    (a stream: every entry pending; what it does not hand to a handler waits,
    read and not started), or for a second after the handler began (a reader
    that reads no further)."""
    while not state["holding"]:
        await anyio.sleep(0.01)
    with anyio.move_on_after(1.0):
        if case.workload.form == "stream":
            while int((await admin.execute("XPENDING", S, G))[0]) < len(case.plan):
                await anyio.sleep(0.01)
        while int(await admin.execute("LLEN", Q)):
            await anyio.sleep(0.01)


def _channel_done(case: Case) -> str:
    missing = [o for o in case.plan if o not in case.finished]
    return f"channel: not finished {missing}" if missing else ""


async def _run_channel(admin: Client, case: Case, consumer: Any) -> None:
    """Pub/Sub is at-most-once: publish each message until it is handled once."""
    for i, plan in enumerate(case.workload.plans):
        payload = f"{plan}:{i}".encode()
        origin = content_origin(payload)
        case.plan[origin] = plan
        while origin not in case.calls:
            await admin.execute("PUBLISH", CHAN, payload)
            await anyio.sleep(0.05)


async def _settle(admin: Client, case: Case, consumer: Any) -> None:
    calm = 0
    why = ""
    while calm < 3:
        await anyio.sleep(0.02)
        if case.workload.form == "channel":
            why = _channel_done(case)
        else:
            why = await _pending_work(admin, case, consumer)
        calm = 0 if why else calm + 1
    del why


async def run_case(server: RedisServer, proxy: CommandProxy, case: Case) -> list[str]:
    """One case: produce, arm, consume until settled, shut down, judge."""
    w = case.workload
    problems: list[str] = []
    stats: dict[str, Any] = {}
    slow = _lease_plan(w)

    async def handle(d: Delivery) -> Outcome:
        out = case.outcome(d)
        plan = case.plan.get(d.origin_id)
        if plan in slow and len(case.calls[d.origin_id]) == 1:
            await anyio.sleep(0.5)  # longer than min_idle / 3: the lease is renewed
        elif plan == "twin":
            # both copies in hand at once, so that the first removal is counted
            # (list_remove, n=2): a loaded machine could otherwise finish one copy
            # before the reader took the other (a plain LREM; the fault never fired)
            with anyio.move_on_after(1.0):
                while len(case.calls[d.origin_id]) < COPIES["twin"]:
                    await anyio.sleep(0.01)
        elif plan == "hold":
            state["holding"] = True
            while not state["stopping"]:
                await anyio.sleep(0.01)
            await anyio.sleep(0.05)  # the shutdown has begun: nothing new is started
        return out

    async def handle_all(ds: list[Delivery]) -> list[Outcome]:
        return [await handle(d) for d in ds]

    async with open_client(server.url) as admin:
        await admin.execute("FLUSHALL")
        await admin.execute("SCRIPT", "FLUSH")
        await _produce(admin, case)
        proxy.reset()
        faults = _faults(case.group, case.kind)
        for i, f in enumerate(faults):
            proxy.arm(case.kind, f, at=i)
        # a periodic task (heartbeat, reaper, lease) meets one error per period
        per_error = 0.9 if case.kind in PERIODIC_KINDS else 0.3
        budget = 4.0 + (per_error * len(faults) if case.group == "errors" else 0.0)
        state: dict[str, Any] = {"what": "mount", "hung": False, "consumer": None,
                                 "holding": False, "stopping": not w.stop_early}

        # the detection runs in the handshake, whose deadline is the URL's
        # connect timeout (5 s): short here, as the other deadlines are (1 s: a
        # loaded CI machine took more than 0.5 s to connect and shake hands)
        url = proxy.url + ("?timeout=1.0" if case.kind == "COMMAND" else "")
        if w.cluster:
            url = f"redis+cluster://127.0.0.1:{proxy.port}"

        options: dict[str, Any] = {"concurrency": w.concurrency}
        if w.on_error is not None:
            options["on_error"] = w.on_error

        async def life() -> None:
            async with open_consumer(url, name=NAME, shutdown_grace=0.5) as consumer:
                state["consumer"] = consumer
                if w.batch:
                    await consumer.mount(w.make(), handle_all, batch=True, **options)
                else:
                    await consumer.mount(w.make(), handle, **options)
                state["what"] = "consume"
                if w.form == "channel":
                    await _run_channel(admin, case, consumer)
                if not state["stopping"]:
                    await _read_all(admin, state, case)
                    state["stopping"] = True  # the handler lets go as the shutdown begins
                    state["what"] = "shutdown of the first life"
                    return
                await _settle(admin, case, consumer)
                stats.update(consumer.stats()[w.make().name])
                state["what"] = "shutdown"

        async def body() -> None:
            if not state["stopping"]:  # a first life, stopped early
                await life()
                state["what"] = "mount"
            await life()

        left = ""
        try:
            await _bounded(body, budget, proxy, state)
        except BaseException as e:
            if state["hung"]:
                pass  # the watchdog's reset ended it: reported as a hang below
            elif state["what"] == "mount" and case.group != "errors":
                # a set-up reply lost: mount() may fail (in time, with an error);
                # the caller mounts again, and that one must do all the work.  A
                # mount that failed before the fault fired (a loaded machine's
                # set-up deadline) leaves the fault armed for the second one.
                # The quick timers' 0.6 s request deadline may also cut that
                # second mount on a loaded machine (a TimeoutError, in time):
                # then a third must do all the work.
                if proxy.fired:
                    proxy.disarm()
                state["what"] = "mount"
                case.remounted = f"{type(e).__name__}"
                for last in (False, True):
                    try:
                        await _bounded(body, budget, proxy, state)
                        break
                    except BaseException as e2:
                        timed_out = _is_timeout(e2) and state["what"] == "mount"
                        if last or not timed_out or state["hung"]:
                            problems.append(f"CRASH during {state['what']} (after a first "
                                            f"mount() failed with {_brief(e)}): {_brief(e2)}")
                            break
                        state["what"] = "mount"
            else:
                problems.append(f"CRASH during {state['what']}: {_brief(e)}")
        if state["hung"]:
            if state["what"] == "consume" and state["consumer"] is not None:
                left = (_channel_done(case) if w.form == "channel"
                        else await _pending_work(admin, case, state["consumer"]))
            problems.append(f"HANG: {state['what']} did not finish within {budget:.1f} s "
                            f"({left or 'no work left'})")
        fired = [f"{f.kind}#{f.k}={f.fault.label}" for f in proxy.fired]
        if not proxy.fired and case.group != "errors":
            problems.append(f"the fault never fired: no {case.kind} request (sent: {dict(proxy.seen)})")
        await proxy.cut_all()
        problems += await _judge(admin, case, stats)
        return [f"{case.label} (fired {', '.join(fired) or 'nothing'}): {p}" for p in problems]


async def _bounded(body: Callable[[], Any], budget: float, proxy: CommandProxy,
                   state: dict[str, Any]) -> None:
    """Run ``body`` for at most ``budget`` seconds.

    A cancel scope is not enough: the library shields some of its calls
    (mount, finalization), so when time is up the watchdog also disarms the
    proxy and resets its connections (a shielded call blocked on a blackholed
    connection then fails) until the body has ended.
    """
    done = anyio.Event()
    async with anyio.create_task_group() as outer:
        scope = anyio.CancelScope()

        async def watchdog() -> None:
            with anyio.move_on_after(budget):
                await done.wait()
                return
            state["hung"] = True
            scope.cancel()
            proxy.disarm()
            while not done.is_set():
                await proxy.cut_all()
                with anyio.move_on_after(0.05):
                    await done.wait()

        outer.start_soon(watchdog)
        try:
            with scope:
                await body()
        finally:
            done.set()


def _is_timeout(e: BaseException) -> bool:
    """A request deadline, alone or as every error of a group."""
    if isinstance(e, BaseExceptionGroup):
        return all(map(_is_timeout, e.exceptions))
    return isinstance(e, (TimeoutError, rexc.TimeoutError))


def _brief(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_brief(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"


async def _judge(admin: Client, case: Case, stats: dict[str, Any]) -> list[str]:
    w = case.workload
    problems: list[str] = []
    present: Counter[str] = Counter()
    dead: Counter[str] = Counter()
    dead_len = 0
    copies: Counter[str] = Counter()
    if w.form == "stream":
        st = await stream_state(admin, S, G, delay_key="{orders}:delayed", dead_letter=S_DEAD)
        present, dead, copies = st.present(), st.dead_letters(), st.copies()
        dead_len = len(st.dead)
    elif w.form == "list":
        ls = await list_state(admin, Q, [Q_PROC, Q_PROC_DEAD], delay_key="{jobs}:delayed",
                              dead_letter=Q_DEAD)
        present, dead = ls.present(), ls.dead_letters()
        dead_len = len(ls.dead)
    elif w.form == "simple":
        for e in await admin.execute("LRANGE", SL, 0, -1):
            present[content_origin(e)] += 1
    duplicating = 1 if case.group in ("lost", "blackhole") else 0
    read_lost: list[str] = []  # a simple list's messages no handler saw, gone
    for origin, plan in case.plan.items():
        calls = case.calls.get(origin, [])
        n = case.copies.get(origin) or 1  # identical copies pushed
        # copies finalized (a handler's ACK / DROP, the dead letter) or still in Redis
        if min(case.done[origin] + dead[origin], n) + present[origin] < n:
            lost = (f"LOST message {origin} ({plan}, {n} cop{'y' if n == 1 else 'ies'}): "
                    f"handler calls at attempts {calls}, not finalized, nothing of it left "
                    f"in Redis")
            if w.form == "simple" and not calls:
                read_lost.append(lost)  # judged below
            else:
                problems.append(lost)
        if len(calls) > CALLS[plan] * n + duplicating:
            problems.append(f"DUPLICATE: message {origin} ({plan}) handled {len(calls)} times "
                            f"(attempts {calls}); the handler asked for {CALLS[plan] * n}")
        if plan in DEAD_PLANS and dead[origin] and len(calls) < MAX_ATTEMPTS:
            problems.append(f"ATTEMPTS: message {origin} dead-lettered after {len(calls)} handler "
                            f"call(s) (attempts {calls}), max_attempts={MAX_ATTEMPTS}")
        if calls and calls[0] != 1 and origin not in case.seeded:
            problems.append(f"ATTEMPTS: message {origin} ({plan}) first handled at attempt "
                            f"{calls[0]} (attempts {calls}): an attempt was spent without a call")
        if any(a > MAX_ATTEMPTS for a in calls) and w.form in ("stream", "list"):
            problems.append(f"ATTEMPTS: message {origin} handled at attempts {calls} > "
                            f"max_attempts={MAX_ATTEMPTS}")
        # (a dead letter in another cluster slot is copied ungated, then the original
        # removed: a copy whose reply is unknown is sent again, a documented duplicate)
        if dead[origin] > n + (duplicating if w.cluster else 0):
            problems.append(f"DUPLICATE: message {origin} dead-lettered {dead[origin]} times")
        if plan not in DEAD_PLANS and dead[origin]:
            problems.append(f"message {origin} ({plan}) in the dead letter")
    # A simple list is at-most-once: a BRPOP whose reply is lost takes its element
    # with it (documented), the fault's or one later than block + READ_MARGIN on a
    # loaded machine (counted a read error): at most one element per read error.
    documented = case.kind == "BRPOP" and case.group == "lost"
    if read_lost and not documented and len(read_lost) > (stats or {}).get("read_errors", 0):
        problems += read_lost
    if w.writes:
        problems += await _judge_writes(admin, case, dead, present)
    if stats and w.dead_letter is not None:
        counted = stats["effects"].get("dead_lettered", 0)
        # (a cluster's ungated copy sent again: the delivery is counted once)
        extra = duplicating if w.cluster else 0
        if not counted <= dead_len <= counted + extra:
            problems.append(f"COUNTERS: effects.dead_lettered={counted} but the dead letter "
                            f"{w.dead_letter!r} holds {dead_len}")
    if stats and w.form == "stream" and w.make().retention is None:
        # (with a retention the handled copies are deleted or trimmed: nothing to count)
        made = sum(n for o, n in copies.items() if case.plan.get(o) in ("retry", "dead"))
        counted = stats["effects"].get("copied", 0)
        if counted != made:
            problems.append(f"COUNTERS: effects.copied={counted} but the stream holds {made} "
                            f"RETRY copies")
    return problems


async def _judge_writes(admin: Client, case: Case, dead: Counter[str],
                        present: Counter[str]) -> list[str]:
    """Exactly-once effects: every finalized message's write applied exactly
    once, none for a message still in Redis; the counter equals the number of
    finalized messages."""
    got = await admin.execute("HGETALL", effects_key(case.workload))
    applied = {k.decode(): int(v) for k, v in zip(got[::2], got[1::2], strict=True)}
    problems: list[str] = []
    finalized = 0
    for origin, plan in case.plan.items():
        n = applied.get(origin, 0)
        done = origin in case.finished or dead[origin] >= 1
        finalized += done
        # its last outcome came from a handler (a message past max_attempts is
        # dead-lettered without a call, so without the write)
        wrote = origin in case.finished or (dead[origin] >= 1
                                            and MAX_ATTEMPTS in case.calls.get(origin, []))
        if n > 1:
            problems.append(f"WRITES: message {origin} ({plan}) applied its write {n} times")
        elif wrote and n == 0:
            problems.append(f"WRITES: message {origin} ({plan}) finalized, its write not applied")
        elif not done and n:
            problems.append(f"WRITES: message {origin} ({plan}) not finalized but its write applied")
    if sum(applied.values()) > finalized:
        problems.append(f"WRITES: {sum(applied.values())} writes applied for {finalized} messages")
    return problems


# -- fixtures -----------------------------------------------------------------

@pytest.fixture
async def proxy(redis_server: RedisServer, flavour: str) -> AsyncIterator[CommandProxy]:
    async with serving(CommandProxy(redis_server.port, flavour=flavour)) as p:
        yield p


_HAPPY: dict[str, Counter[str]] = {}


async def _happy_kinds(server: RedisServer, proxy: CommandProxy, w: Workload,
                       kind: str) -> Counter[str]:
    """The kinds the workload sends without a fault, and its soundness: run
    once per workload, again (at most twice more) while ``kind`` was not
    among them -- on a loaded machine a run can take another path (a late
    heartbeat, other batches) that sends a kind another run does."""
    seen = _HAPPY.setdefault(w.id, Counter())
    for _ in range(3 if not seen else 2):
        if seen[kind]:
            break
        case = Case(w, "-", "none")
        problems = await run_case(server, proxy, case)
        problems = [p for p in problems if "never fired" not in p]
        assert not problems, "the workload fails without any fault:\n" + "\n".join(problems)
        seen.update(proxy.seen)
    return seen


# -- the proxy itself -----------------------------------------------------------

async def test_proxy_maps_pipelined_replies_and_injects_in_order(
    redis_server: RedisServer, proxy: CommandProxy
) -> None:
    from trio_redis_finalize._transport import open_client as oc

    proxy.arm("INCR", error("OOM"), at=1)
    async with oc(proxy.url) as c:
        replies = await c.pipeline([("INCR", "n"), ("INCR", "n"), ("INCR", "n"), ("GET", "n")],
                                   raise_on_error=False)
    assert replies[0] == 1 and replies[2] == 2 and replies[3] == b"2"
    assert "used memory > 'maxmemory'" in str(replies[1])
    assert [f.kind for f in proxy.fired] == ["INCR"]


async def test_proxy_lost_reply_ran_on_the_server(redis_server: RedisServer,
                                                  proxy: CommandProxy) -> None:
    proxy.arm("SET", LOST)
    async with open_client(proxy.url) as c:
        with pytest.raises(Exception):  # noqa: B017 - any connection error
            await c.execute("SET", "k", "v", timeout=1.0)
    async with open_client(redis_server.url) as admin:
        assert await admin.execute("GET", "k") == b"v"


async def test_proxy_blackhole_never_answers(redis_server: RedisServer,
                                             proxy: CommandProxy) -> None:
    proxy.arm("SET", BLACKHOLE)
    async with open_client(redis_server.url) as admin:
        await admin.execute("DEL", "bh")
        async with open_client(proxy.url) as c:
            with pytest.raises(Exception):  # noqa: B017 - the client's own deadline
                await c.execute("SET", "bh", "v", timeout=0.3)
        assert await admin.execute("GET", "bh") is None


async def test_a_final_error_on_one_removal_fails_that_element_only(
        redis_server: RedisServer, proxy: CommandProxy) -> None:
    """Counts are what Redis answered, element by element: of three reliable-list
    ACKs the second ``LREM`` is answered a final error (NOPERM) instead of
    running -- that element failed and stays in the processing list; the other
    two were removed and count as acknowledged."""
    queue = "fm:final"
    sub = ReliableListSubscription(queue)
    processing = sub.target("c-final").processing
    async with open_client(redis_server.url) as admin:
        await admin.execute("DEL", queue, processing)
        await admin.execute("RPUSH", queue, b"a", b"b", b"c")
        seen: list[bytes] = []

        async def handler(d: Delivery) -> Outcome:
            seen.append(d.data or b"")
            return ACK

        proxy.arm("LREM", error("NOPERM"), at=1)
        async with open_consumer(proxy.url, name="c-final", shutdown_grace=0.5) as consumer:
            await consumer.mount(sub, handler)
            name = consumer.mounts[0].name

            def settled() -> bool:
                e = consumer.stats()[name]["effects"]
                return e.get("acked", 0) + e.get("failed", 0) >= 3
            await eventually(settled, what="three removals answered")
            stats = consumer.stats()[name]
            assert stats["effects"].get("acked") == 2 and stats["effects"].get("failed") == 1
            assert stats["finalize_errors"] == 1
            assert await admin.execute("LRANGE", processing, 0, -1) == [b"b"]
        assert sorted(seen) == [b"a", b"b", b"c"]


@pytest.mark.parametrize("fault", [LOST, error("OOM"), BLACKHOLE], ids=lambda f: f.label)
@pytest.mark.parametrize("form", ["stream", "reliable list"])
async def test_a_removal_sent_again_counts_as_planned_not_gate_closed(
        redis_server: RedisServer, proxy: CommandProxy, form: str, fault: Fault) -> None:
    """Counts are what Redis answered, and a resend's "removed nothing" is no
    such answer: the first ``XACK`` / ``LREM`` of three ACKs loses its reply
    (it ran), is refused (OOM: it did not) or meets a silent link (unknown);
    the finalizer sends it again, which may answer 0 -- still ``acked`` 3,
    never ``gate_closed``, and nothing pending."""
    seen: list[Delivery] = []

    async def handler(d: Delivery) -> Outcome:
        seen.append(d)
        return ACK

    async with open_client(redis_server.url) as admin:
        if form == "stream":
            await admin.execute("DEL", "fm:again")
            for i in range(3):
                await admin.execute("XADD", "fm:again", "*", "n", str(i))
            sub: Any = StreamSubscription("fm:again", "g", block=0.1, start_id="0")
            kind = "XACK"
        else:
            sub = ReliableListSubscription("fm:again-q")
            await admin.execute("DEL", "fm:again-q", sub.target("c-again").processing)
            await admin.execute("RPUSH", "fm:again-q", b"a", b"b", b"c")
            kind = "LREM"
        proxy.arm(kind, fault)
        async with open_consumer(proxy.url, name="c-again", shutdown_grace=0.5) as consumer:
            await consumer.mount(sub, handler)
            name = consumer.mounts[0].name
            await eventually(lambda: consumer.stats()[name]["effects"].get("acked", 0) >= 3,
                             timeout=20.0, what="three acked")
            stats = consumer.stats()[name]
            assert "gate_closed" not in stats["effects"] and "failed" not in stats["effects"]
            assert stats["effects"]["acked"] == 3 and stats["finalize_errors"] >= 1
        assert proxy.fired, "the fault never fired"
        if form == "stream":
            assert int((await admin.execute("XPENDING", "fm:again", "g"))[0]) == 0
        else:
            assert await admin.execute("LLEN", sub.target("c-again").processing) == 0
        assert len(seen) == 3


def test_native_kinds_follow_the_capabilities_not_the_server_name() -> None:
    k = Native("xackdel", "XACKDEL", "XDEL")
    assert resolve(k, Capabilities(xackdel=True)) == "XACKDEL"
    assert resolve(k, Capabilities(acked_trim=True)) == "XDEL"
    assert resolve("XACK", Capabilities(xackdel=True)) == "XACK"
    assert str(k) == "XACKDEL|XDEL"


def test_kinds_name_scripts_and_reads() -> None:
    names = script_names()
    assert "stream_copy_ack" in names.values()
    sha = next(s for s, n in names.items() if n == "stream_copy_ack")
    assert kind_of([b"EVALSHA", sha, b"2"], names) == "EVALSHA:stream_copy_ack"
    assert kind_of([b"XREADGROUP", b"GROUP", b"g", b"c", b"STREAMS", b"s", b">"]) == "XREADGROUP>"
    assert kind_of([b"XREADGROUP", b"GROUP", b"g", b"c", b"STREAMS", b"s", b"0"]) == "XREADGROUP0"
    assert kind_of([b"xgroup", b"create", b"s", b"g", b"0"]) == "XGROUP CREATE"
    assert kind_of([b"XPENDING", b"s", b"g", b"IDLE", b"1500", b"-", b"+", b"10", b"w0"]) == "XPENDING IDLE"
    assert kind_of([b"XPENDING", b"s", b"g", b"-", b"+", b"10", b"w1"]) == "XPENDING"


# -- the matrix -------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_node_cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of one master (every slot), for the ``cluster`` workloads."""
    cluster = RedisCluster(masters=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@asynccontextmanager
async def _cluster_proxy(node: RedisServer, flavour: str) -> AsyncIterator[CommandProxy]:
    """A proxy to the one-node cluster's node whose ``CLUSTER SLOTS`` names the
    proxy: the cluster client's connections go through it too."""
    async with serving(CommandProxy(node.port, flavour=flavour)) as p:
        p.rewrites["CLUSTER SLOTS"] = lambda reply: reply.replace(
            b":%d\r\n" % node.port, b":%d\r\n" % p.port)
        yield p


@pytest.mark.parametrize(("workload", "kind", "group"), CASES,
                         ids=[f"{w.id}-{k}-{g}".replace(" ", "_") for w, k, g in CASES])
async def test_fault_matrix(redis_server: RedisServer, proxy: CommandProxy, server_caps: Capabilities,
                            flavour: str, request: pytest.FixtureRequest,
                            workload: Workload, kind: Kind, group: str) -> None:
    kind = resolve(kind, server_caps)  # the native command where the server has it
    async with AsyncExitStack() as stack:
        server = redis_server
        if workload.cluster:
            server = request.getfixturevalue("one_node_cluster").servers[0]
            proxy = await stack.enter_async_context(_cluster_proxy(server, flavour))
        happy = await _happy_kinds(server, proxy, workload, kind)
        assert happy[kind], (f"[{workload.id}] never sends {kind} without a fault (sent: "
                             f"{dict(happy)}): the matrix is out of date")
        problems = await run_case(server, proxy, Case(workload, kind, group))
    assert not problems, "\n".join(problems)
