"""Crash-point enumeration: every finalization path, a fault at every command.

For each path (form x outcome x delay way x dead letter) the happy path is
run once to count its finalization commands K (the copy's own finalization
included).  Then, for every k < K and every fault (see ``faults.shim``):

* ``before`` / ``after``: command k fails before it is sent, or is applied
  and its reply lost; the consumer lives on and its finalizer sends the
  finalization again (the gated resend);
* ``crash-before`` / ``crash-after``: the same, and the process dies there;
* ``cancel-before`` / ``cancel-after``: the finalizer is cancelled while it
  waits at command k (its request unsent / applied), by the shutdown deadline;

then recovery runs: a restarted consumer with the same name, which re-reads
its PEL / processing list and finalizes again.  The checker then reads what
Redis physically holds: nothing lost (the message was finalized, or a copy
of it exists), nothing stranded, at most one copy for gated paths, attempt
counters never going back, ``max_attempts`` never exceeded by a handler call.

The retention variants (``Retention.DELETE_ON_FINALIZE``: every removal
deletes the original, in the gated script or as ``XDEL`` after ``XACK`` --
on Redis 8.2 as one ``XACKDEL ... ACKED``, which the session's server then
gets) run the same enumeration; copies are counted from what the handler
was given (they are deleted once handled), and after recovery and one
all-groups trim the stream must be empty: a crash between an ``XACK`` and
its ``XDEL`` leaves an acknowledged entry that the trim removes, nothing
else may stay.  Each case checks that the path it enumerated is the one the
server's capabilities choose (``XACKDEL`` there, ``XDEL`` elsewhere).

Handlers are deterministic: a stream handler returns the path's outcome for
the original entry (whatever its attempt: recovery resends the same
finalization) and ACK for copies; a reliable-list handler returns the path's
outcome on the first call for the message and ACK afterwards (a copy and a
re-delivered original look alike there).

Batches (``n > 1``): three messages produced at once and finalized in one
batched script call (streams: copies, delays, dead letters, ACKs and DROPs
carrying writes; a reliable list: ACKs and DROPs carrying writes, in one
``LIST_WRITES_REMOVE_BATCH``, also of three identical elements, gated on
the copies left: each copy's write applied once); the checker judges each
message of the batch.

The negative control builds the forbidden order (XACK, then XADD the copy, as
two commands; for lists LREM then LPUSH) and shows the same checker reports
the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from _procs import quick_finalize_timers

from faults.checks import ListState, StreamState, list_state, stream_state
from faults.shim import Crash, FaultClient, FaultMode, open_fault_client
from trio_redis_finalize import (
    ACK,
    DROP,
    ORIGIN_FIELD,
    RETRY,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    Retention,
    StreamSubscription,
    _handlers,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core import _finalize as _core_finalize
from trio_redis_finalize._core import _plan, _types
from trio_redis_finalize._core import _writes as _core_writes
from trio_redis_finalize._core._batch import batch_replies, batch_singles, is_batched
from trio_redis_finalize._core._caps import Capabilities
from trio_redis_finalize._core._types import Effect, Plan
from trio_redis_finalize._core.reliable_list.scripts import LIST_COPY_REMOVE, LIST_ZADD_REMOVE
from trio_redis_finalize._core.stream.retention import TRIM_ACKED, parse_trim
from trio_redis_finalize._envelope import wrap
from trio_redis_finalize._forms.reliable_list import reader as _reliable_list
from trio_redis_finalize._keys import same_slot
from trio_redis_finalize._transport import Client, open_client

NAME = "w1"
S, G = "orders", "billing"
Q = "jobs"
DEAD = "dead-letters"  # another hash slot than the sources: the cluster split plans
assert not same_slot(S, DEAD) and not same_slot(Q, DEAD)
S_DELAYS, Q_DELAYS = "{orders}:delayed", "{jobs}:delayed"
PROCESSING = "{jobs}:processing:" + NAME

FAULTS = ["before", "after", "crash-before", "crash-after", "cancel-before", "cancel-after"]


def effects_key(path: Path) -> str:
    """The hash the ``writes`` paths' handlers count each message's effect in
    (in the source's hash slot, so the Cluster-split plans can carry it)."""
    return "{orders}:effects" if path.form == "stream" else "{jobs}:effects"


@pytest.fixture(autouse=True)
def _quick_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_finalize_timers(monkeypatch)


# -- paths --------------------------------------------------------------------

Planner = Callable[[_types.Target, Delivery, Outcome], Plan]


@dataclasses.dataclass(frozen=True)
class Path:
    """One finalization path and what it must leave behind."""

    id: str
    form: str  # "stream" or "list"
    outcome: Outcome
    expect: str  # "gone" (ACK/DROP/exhausted), "copy", "dead", "runtime" (copy in memory)
    gated: bool = True
    sub: dict[str, Any] = dataclasses.field(default_factory=dict)
    preset_retries: int = 0  # the original arrives carrying this retry counter
    planner: Planner | None = None  # replaces the planner (cluster split, broken order)
    n: int = 1  # messages produced (n > 1: finalized in one batched script call; a list's
    # n > 1 only for paths that leave no copy: its copies are counted, not told apart)
    identical: bool = False  # a list's n > 1: the same bytes n times (counted gates n, ..., 1)
    raced: bool = False  # streams, n > 1: the second is finalized by another party just before
    # its batch (a racing finalizer): the batched call is half gated-closed
    writes: bool = False  # the message's last outcome carries a write (exactly-once effects)
    batch: bool = False  # mounted with batch=True: the handler takes a read's deliveries at once

    def subscription(self) -> StreamSubscription | ReliableListSubscription:
        if self.form == "stream":
            return StreamSubscription(S, G, **{"block": 0.05, "min_idle": 0.1, **self.sub})
        return ReliableListSubscription(Q, **{"block": 0.05, **self.sub})

    @property
    def deletes(self) -> bool:
        return self.sub.get("retention") is Retention.DELETE_ON_FINALIZE

    @property
    def max_attempts(self) -> int | None:
        limit: int | None = self.sub.get("max_attempts")
        return limit


def _cluster_split(t: _types.Target, d: Delivery, o: Outcome) -> Plan:
    """The plan Redis Cluster gets when the dead letter lives on another slot."""
    return _plan.plan(dataclasses.replace(t, cluster=True), d, o)


def _remove_then_copy(t: _types.Target, d: Delivery, o: Outcome) -> Plan:
    """The forbidden order: remove the original, then add the copy (two commands)."""
    if o != RETRY:
        return _plan.plan(t, d, o)
    if d.id is not None:
        return Plan(Effect.COPIED, (("XACK", t.source, t.group, d.id),
                                    ("XADD", t.source, "*", *_plan.stream_copy_fields(d))),
                    gated=False)
    assert d.raw is not None
    return Plan(Effect.COPIED, (("LREM", t.processing, -1, d.raw),
                                ("LPUSH", t.source, _types.list_copy(d))), gated=False)


DURABLE = {"delayed_retry": DelayedRetry.DURABLE_ZSET}
DEAD3 = {"max_attempts": 3, "dead_letter": DEAD}


def every_form_paths(form: str, runtime_lands: str) -> list[Path]:
    """The paths both forms have; ``runtime_lands``: what the form's runtime
    ``retry_after`` must leave behind (its ``expect``)."""
    return [
        Path("ack", form, ACK, "gone"),
        Path("drop", form, DROP, "gone"),
        Path("retry", form, RETRY, "copy"),
        Path("retry-after-durable", form, retry_after(0.02), "copy", sub=DURABLE),
        Path("retry-after-runtime", form, retry_after(0.02), runtime_lands),
        Path("dead-letter", form, RETRY, "dead", preset_retries=2, sub=DEAD3),
        Path("dead-letter-cluster-split", form, RETRY, "dead", gated=False, preset_retries=2,
             sub=DEAD3, planner=_cluster_split),
        Path("exhausted-no-dead-letter", form, RETRY, "gone", preset_retries=2,
             sub={"max_attempts": 3, "dead_letter": None}),
    ]


STREAM_PATHS = [
    *every_form_paths("stream", "runtime"),
    Path("claiming-retry", "stream", RETRY, "gone", sub={"mode": Mode.CLAIMING}),
    Path("reclaim-retry", "stream", RETRY, "copy", sub={"mode": Mode.RECLAIM}),
    # batches of two-step deliveries: one batched script call each
    Path("retry-batch", "stream", RETRY, "copy", n=3),
    Path("retry-batch-half-closed", "stream", RETRY, "copy", n=3, raced=True),
    Path("retry-after-durable-batch-half-closed", "stream", retry_after(0.02), "copy",
         sub=DURABLE, n=3, raced=True),
    Path("dead-letter-batch", "stream", RETRY, "dead", preset_retries=2, sub=DEAD3, n=3),
]
LIST_PATHS = every_form_paths("list", "copy")
DELETE = {"retention": Retention.DELETE_ON_FINALIZE}
RETENTION_PATHS = [
    Path("ack", "stream", ACK, "gone", sub=DELETE),
    Path("drop", "stream", DROP, "gone", sub=DELETE),
    Path("retry-capped", "stream", RETRY, "copy", sub={**DELETE, "copy_maxlen": 1000}),
    Path("retry-after-durable", "stream", retry_after(0.02), "copy", sub={**DURABLE, **DELETE}),
    Path("retry-after-runtime", "stream", retry_after(0.02), "runtime", sub=DELETE),
    Path("dead-letter-capped", "stream", RETRY, "dead", preset_retries=2,
         sub={**DEAD3, **DELETE, "dead_letter_maxlen": 1000}),
    Path("dead-letter-cluster-split", "stream", RETRY, "dead", gated=False, preset_retries=2,
         sub={**DEAD3, **DELETE}, planner=_cluster_split),
    Path("exhausted-no-dead-letter", "stream", RETRY, "gone", preset_retries=2,
         sub={"max_attempts": 3, "dead_letter": None, **DELETE}),
    Path("retry-capped-batch-half-closed", "stream", RETRY, "copy", n=3, raced=True,
         sub={**DELETE, "copy_maxlen": 1000}),
    Path("retry-after-durable-batch", "stream", retry_after(0.02), "copy", n=3,
         sub={**DURABLE, **DELETE}),
    Path("dead-letter-capped-batch", "stream", RETRY, "dead", preset_retries=2, n=3,
         sub={**DEAD3, **DELETE, "dead_letter_maxlen": 1000}),
]
# Exactly-once effects: the message's last outcome carries a write (one per
# cell; the batched copies are left out, a copy with writes goes alone), and
# batches of ACKs and DROPs carrying writes: one STREAM_WRITES_ACK_BATCH call each
WRITES_PATHS = [
    *[dataclasses.replace(p, id=f"{p.form}{'-delete' if p.deletes else ''}-{p.id}-writes",
                          writes=True)
      for p in [*STREAM_PATHS, *RETENTION_PATHS, *LIST_PATHS] if p.n == 1],
    Path("stream-ack-batch-writes", "stream", ACK, "gone", n=3, writes=True),
    Path("stream-ack-batch-half-closed-writes", "stream", ACK, "gone", n=3, raced=True,
         writes=True),
    Path("stream-delete-drop-batch-writes", "stream", DROP, "gone", n=3, writes=True, sub=DELETE),
    # one LIST_WRITES_REMOVE_BATCH call each (three distinct elements)
    Path("list-ack-batch-writes", "list", ACK, "gone", n=3, writes=True),
    Path("list-drop-batch-writes", "list", DROP, "gone", n=3, writes=True),
    # ... three copies of one element: each gated on the copies left (3, 2, 1), its write
    # applied once per copy
    Path("list-ack-identical-batch-writes", "list", ACK, "gone", n=3, writes=True,
         identical=True),
]
# The batch handler (mount(..., batch=True)): the same finalizations, the
# outcomes of one call handed on together (a list of them; one for all when
# they are the same)
BATCH_PATHS = [
    dataclasses.replace(p, id=f"{p.id if p.writes else f'{p.form}-{p.id}'}-batch-handler",
                        batch=True)
    for p in [*STREAM_PATHS, *LIST_PATHS, *WRITES_PATHS]
    if p.id in ("ack", "retry", "retry-after-runtime", "dead-letter", "retry-batch",
                "retry-batch-half-closed", "dead-letter-batch", "stream-ack-writes",
                "stream-retry-writes", "list-ack-writes", "stream-ack-batch-half-closed-writes",
                "list-ack-batch-writes", "list-ack-identical-batch-writes")
]
BROKEN_STREAM = Path("broken-ack-then-copy", "stream", RETRY, "copy", gated=False,
                     planner=_remove_then_copy)
BROKEN_LIST = Path("broken-lrem-then-lpush", "list", RETRY, "copy", gated=False,
                   planner=_remove_then_copy)


# -- the harness ----------------------------------------------------------------

@dataclasses.dataclass
class Call:
    id: str | None
    origin: str
    attempt: int
    outcome: Outcome


@dataclasses.dataclass
class Case:
    path: Path
    k: int | None
    fault: str
    original: str = ""  # the stream entry id of the original (the first one, n > 1)
    origin: str = ""
    originals: list[str] = dataclasses.field(default_factory=list)  # streams: every original
    raced: str = ""  # the original a racing finalizer acknowledged (Path.raced)
    racer: Client | None = None
    batched: list[Any] = dataclasses.field(default_factory=list)  # replies to batched calls
    calls: list[Call] = dataclasses.field(default_factory=list)
    crashed: bool = False
    list_copies: int = 0
    leaked: int = 0  # retention: entries left in the stream after recovery and a trim
    names: set[str] = dataclasses.field(default_factory=set)  # the commands sent (first life)
    effects: dict[str, int] = dataclasses.field(default_factory=dict)  # writes paths: per origin

    @property
    def label(self) -> str:
        return f"{self.path.form} {self.path.id} k={self.k} {self.fault}"

    def outcome_for(self, d: Delivery) -> Outcome:
        path = self.path
        if path.form == "stream":
            if path.sub.get("mode") is Mode.CLAIMING:
                return path.outcome if d.attempt == 1 else ACK
            return path.outcome if d.id in self.originals else ACK
        if path.n > 1:  # each element's first delivery
            return path.outcome if all(c.origin != d.origin_id for c in self.calls) else ACK
        return path.outcome if not self.calls else ACK

    def ends(self, d: Delivery, outcome: Outcome) -> bool:
        """Whether ``outcome`` finalizes the message for good (ACK, DROP, the
        last attempt's RETRY: dead letter or dropped)."""
        limit = self.path.max_attempts
        return outcome in (ACK, DROP) or (limit is not None and d.attempt >= limit)

    def handler(self) -> Callable[[Any], Awaitable[Any]]:
        one = self.handler_of_one()
        if not self.path.batch:
            return one

        async def handle_all(ds: list[Delivery]) -> Outcome | list[Outcome]:
            outcomes = [await one(d) for d in ds]
            if len(set(outcomes)) == 1 and not outcomes[0].writes:
                return outcomes[0]  # one outcome for all
            return outcomes

        return handle_all

    def handler_of_one(self) -> Callable[[Delivery], Awaitable[Outcome]]:
        async def handle(d: Delivery) -> Outcome:
            outcome = plain = self.outcome_for(d)
            if self.path.writes and self.ends(d, outcome):
                # the message's one effect, committed with its last finalization
                outcome = outcome.with_writes(("HINCRBY", effects_key(self.path), d.origin_id, 1))
            if (self.path.raced and self.racer is not None and not self.raced
                    and d.id == self.originals[1]):
                # another finalizer got there first: this one's gate is closed
                self.raced = d.id
                await self.racer.execute("XACK", S, G, d.id)
                if self.path.deletes:
                    await self.racer.execute("XDEL", S, d.id)
            self.calls.append(Call(d.id, d.origin_id, d.attempt, plain))
            return outcome

        return handle


async def _settled(client: Client, consumer: Any, form: str) -> bool:
    """Nothing left to do: no pending, nothing unread, nothing delayed or held."""
    if len(consumer.scheduler) or any(m.in_hand or m.stats.in_flight for m in consumer.mounts):
        return False
    if form == "list":
        lens = await client.pipeline([("LLEN", Q), ("LLEN", PROCESSING), ("ZCARD", Q_DELAYS)])
        return not any(lens)
    summary = await client.execute("XPENDING", S, G)
    if int(summary[0]) or int(await client.execute("ZCARD", S_DELAYS)):
        return False
    last = await client.execute("XREVRANGE", S, "+", "-", "COUNT", 1)
    info = {g[1]: g[7] for g in await client.execute("XINFO", "GROUPS", S)}
    return not last or info.get(G.encode()) == last[0][0]


async def _unsettled(client: Client, consumer: Any, form: str) -> str:
    """What :func:`_settled` still finds to do (a failure's message)."""
    held = {m.name: (len(m.in_hand), m.stats.in_flight) for m in consumer.mounts}
    gates = ""
    if form == "list":
        left = await client.pipeline([("LLEN", Q), ("LLEN", PROCESSING), ("ZCARD", Q_DELAYS)])
        # what each reader's gates hold, by element: in hand, left over, delayed
        gates = ", gates " + repr([(dict(g.in_hand), g.leftover, g.delayed)
                                   for g in (m.reader.gates for m in consumer.mounts)])
    else:
        left = [await client.execute("XPENDING", S, G), await client.execute("ZCARD", S_DELAYS),
                await client.execute("XINFO", "GROUPS", S)]
    return (f"scheduled {len(consumer.scheduler)}, (in hand, in flight) {held}, "
            f"Redis {left!r}{gates}")


def _not_collateral(e: BaseException) -> bool:
    collateral = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.get_cancelled_exc_class())
    return not isinstance(e, (BaseExceptionGroup, *collateral))


async def _run(client: FaultClient, case: Case, *, stop_when_fired: bool, budget: float = 20.0) -> None:
    """One consumer life: until settled twice in a row, until the fault fired
    (cancel: then shut down), or until it crashed.

    ``budget`` is a bound, not an expectation: a life takes well under a
    second on a quiet machine; CI's five runs side by side on two cores once
    took a life past 5 s (the finalizer's 0.3 s request timeout, see
    ``quick_finalize_timers``, ran out on resend after resend).  Past it the
    failure says what was still unsettled."""
    try:
        async with open_consumer(client, name=NAME, shutdown_grace=0.0) as consumer:
            await consumer.mount(case.path.subscription(), case.handler(), batch=case.path.batch)
            calm = 0
            with anyio.move_on_after(budget) as bound:
                while calm < 2:
                    await anyio.sleep(0.015)
                    if stop_when_fired and client.fired is not None:
                        return
                    calm = calm + 1 if await _settled(client, consumer, case.path.form) else 0
            if bound.cancelled_caught:
                raise AssertionError(f"{case.label}: not settled within {budget} s: "
                                     f"{await _unsettled(client, consumer, case.path.form)}")
    except BaseExceptionGroup as eg:
        crash, rest = eg.split(Crash)
        if crash is None:
            raise
        case.crashed = True
        # the simulated death closes channels under the other tasks: that
        # collateral is all that may come with it
        if rest is not None and rest.subgroup(_not_collateral) is not None:
            raise


async def _produce(client: Client, case: Case) -> None:
    path = case.path
    if path.form == "stream":
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
        for i in range(path.n):
            fields: list[str] = ["n", str(i + 1)]
            if path.preset_retries:
                fields += ["trf-retries", str(path.preset_retries)]
            case.originals.append((await client.execute("XADD", S, "*", *fields)).decode())
        case.original = case.origin = case.originals[0]
        return
    if path.n > 1:  # foreign elements, pushed at once: one read
        elements = ([b"job"] * path.n if path.identical
                    else [f"job-{i + 1}".encode() for i in range(path.n)])
        case.originals = list(dict.fromkeys(map(_types.content_origin, elements)))
        case.origin = case.originals[0]
        await client.execute("LPUSH", Q, *elements)
        return
    case.origin = "job-1"
    element = wrap(b"job", path.preset_retries, case.origin) if path.preset_retries else b"job"
    if not path.preset_retries:
        case.origin = _types.content_origin(element)
    await client.execute("LPUSH", Q, element)


async def _state(client: Client, form: str) -> StreamState | ListState:
    if form == "stream":
        return await stream_state(client, S, G, delay_key=S_DELAYS, dead_letter=DEAD)
    return await list_state(client, Q, [PROCESSING], delay_key=Q_DELAYS, dead_letter=DEAD)


@dataclasses.dataclass
class Report:
    case: Case
    problems: list[str]
    copies: int
    dead: int


def judge(case: Case, state: StreamState | ListState) -> Report:
    """The checker: what Redis holds after recovery, against what the path
    promises, for each message (a path of n > 1: each of the batch)."""
    if case.path.n == 1 or case.path.identical:
        return _judge_one(case, state, case.origin)
    problems: list[str] = []
    copies: list[int] = []
    dead: list[int] = []
    for origin in case.originals:
        r = _judge_one(case, state, origin)
        problems += [f"message {origin}: {p}" for p in r.problems]
        if origin != case.raced:
            copies.append(r.copies)
            dead.append(r.dead)
    if case.path.raced and not case.raced:
        problems.append("the racing finalizer never ran")
    return Report(case, problems, min(copies), min(dead))


def _judge_one(case: Case, state: StreamState | ListState, origin: str) -> Report:
    path = case.path
    problems: list[str] = []
    if origin == case.raced:
        # acknowledged by the racer, no copy: its gate was closed in the batch
        assert isinstance(state, StreamState)
        copies, dead = state.copies()[origin], state.dead_letters()[origin]
        if copies or dead or state.present()[origin]:
            problems.append(f"raced: {copies} copies, {dead} dead letters, "
                            f"{state.present()[origin]} tokens left (the gate was closed)")
        return Report(case, problems, copies, dead)
    calls = ([c for c in case.calls if c.origin == origin] if path.form == "stream" or path.n > 1
             else case.calls)
    if path.form == "stream":
        assert isinstance(state, StreamState)
        copies = state.copies()[origin]
        if path.deletes:  # handled copies are deleted: count what the handler was given too
            handed = {c.id for c in calls if c.id not in case.originals}
            kept = {e.id for e in state.entries if e.is_copy and e.origin == origin}
            copies = len(handed | kept) + sum(
                1 for f in state.delayed if f.get(ORIGIN_FIELD, b"").decode() == origin)
    else:
        assert isinstance(state, ListState)
        copies = case.list_copies
    dead = state.dead_letters()[origin]
    present = state.present()[origin]
    if present:
        problems.append(f"stranded: {present} token(s) of the message still pending/unread/delayed")
    limit = path.max_attempts
    handled_to_the_end = any(  # ACK, DROP, or the last allowed attempt (exhausted)
        c.outcome in (ACK, DROP) or (limit is not None and c.attempt >= limit) for c in calls
    )
    finalized = {
        "gone": handled_to_the_end or bool(dead),
        "copy": copies >= 1 or handled_to_the_end,
        "dead": dead >= 1,
        "runtime": copies >= 1,
    }[path.expect]
    if path.form == "stream" and path.expect == "copy":
        finalized = copies >= 1  # the original's finalization is resent: a copy must exist
    documented = path.expect == "runtime" and case.crashed  # a runtime copy dies with its process
    if not finalized and not present and not documented:
        problems.append(f"LOST: no {path.expect} successor and nothing left in Redis")
    if path.gated and (copies > 1 or dead > 1):
        problems.append(f"gated path made {copies} copies and {dead} dead letters")
    if path.expect in ("gone", "dead") and copies:
        problems.append(f"{copies} unexpected copies")
    if path.expect != "dead" and dead:
        problems.append(f"{dead} unexpected dead letters")
    # attempt counters: never back, never past max_attempts
    seen = 0
    for c in calls:
        if limit is not None and c.attempt > limit:
            problems.append(f"handler called at attempt {c.attempt} > max_attempts={limit}")
        if c.attempt < seen:
            problems.append(f"attempt went back from {seen} to {c.attempt}")
        seen = max(seen, c.attempt)
    if case.leaked:
        problems.append(f"leaked: {case.leaked} entries left in the stream after recovery and a trim")
    if path.writes:
        problems += _judge_writes(case, origin, present=bool(present),
                                  lost=not finalized and documented)
    if not calls:
        problems.append("the handler never ran")
    return Report(case, problems, copies, dead)


def _judge_writes(case: Case, origin: str, *, present: bool, lost: bool) -> list[str]:
    """Exactly-once effects: the message's write was committed exactly once
    with its last finalization (identical elements: once per copy) -- never
    twice, whatever was resent, crashed or cancelled; none while it is still
    in Redis to be handled (or lost with a runtime copy, as documented).  One
    exception, no double count: after a crash or a cancelled shutdown, the
    restart counts the interrupted attempt, and a message then past
    ``max_attempts`` is dead-lettered (or dropped) without a handler call, so
    without the write."""
    wanted = case.path.n if case.path.identical else 1
    applied = case.effects.get(origin, 0)
    if applied > wanted:
        return [f"writes applied {applied} times (exactly {wanted} wanted)"]
    if present or lost:
        return [f"writes applied {applied} times to a message not finalized"] if applied else []
    interrupted = case.fault.startswith(("crash", "cancel"))
    if applied < wanted and not (interrupted and case.path.max_attempts is not None):
        return [f"the message was finalized but its writes were applied {applied} of "
                f"{wanted} times"]
    return []


def list_copies(applied: list[tuple[Any, Any]]) -> int:
    """Copies of a list element that Redis made (gate open), dead letters aside.

    A copy cannot be told from a re-delivered original by its bytes once it is
    consumed, so they are counted from the replies of the copy commands.
    """
    n = 0
    for cmd, reply in applied:
        name = cmd[0]
        if name == b"EVALSHA" and cmd[1] in (LIST_COPY_REMOVE.sha, LIST_ZADD_REMOVE.sha):
            if cmd[4] != DEAD and reply is not None and not isinstance(reply, Exception):
                n += 1
        elif name == "LPUSH" and cmd[1] == Q:
            n += 1
    return n


async def run_case(url: str, path: Path, k: int | None, fault: str,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[Report, int]:
    """Run one case and recovery; returns the report and the number of
    finalization commands the first run sent (``k=None``: the happy path)."""
    if path.planner is not None:
        monkeypatch.setattr(_core_finalize, "plan", path.planner)  # the finalizer core's planner
        monkeypatch.setattr(_core_writes, "plan", path.planner)  # ... and the one under writes
    if path.n > 1:
        # one finalizer batch of the n outcomes whatever the machine's speed: a
        # handler call slower than _SLOW_CALL (the racer's round trip, under
        # load) would otherwise hand the outcomes before it on at once
        monkeypatch.setattr(_handlers, "_SLOW_CALL", 60.0)
        monkeypatch.setattr(_handlers, "_FLUSH_EVERY", 60.0)
        if path.form == "list":
            # ... read at once: the reader's first read is of one element
            # (its prefetch grows from 1), so it starts at n here
            start = _reliable_list.ReliableListReader.__init__

            def prefetch_n(self: Any, sub: Any) -> None:
                start(self, sub)
                self._batch = path.n

            monkeypatch.setattr(_reliable_list.ReliableListReader, "__init__", prefetch_n)
    case = Case(path, k, fault)
    async with open_client(url) as admin:
        case.racer = admin
        await admin.execute("FLUSHALL")
        await _produce(admin, case)
        async with open_fault_client(url) as client:
            if k is not None:
                mode = FaultMode.AFTER if fault.endswith("after") else FaultMode.BEFORE
                client.arm(k, mode, crash=fault.startswith("crash"), cancel=fault.startswith("cancel"))
            await _run(client, case, stop_when_fired=fault.startswith("cancel"))
            sent = len(client.sent)
            case.names |= {str(c[0]).upper() for c in client.sent}
            case.list_copies += list_copies(client.applied)
            # (each delivery's element, as the core reads them)
            case.batched += [batch_replies(r, len(batch_singles(c))) or r
                             for c, r in client.applied if is_batched(c)]
        # recovery: the restarted process, same consumer name
        async with open_fault_client(url) as client:
            await _run(client, case, stop_when_fired=False)
            case.list_copies += list_copies(client.applied)
        if path.deletes:
            # the periodic trim's step, run to the end: removes what a crash left
            # acknowledged between XACK and XDEL; anything else left is a leak
            while parse_trim(await admin.evalsha(TRIM_ACKED, (S,), (100,))).more:
                pass
            case.leaked = int(await admin.execute("XLEN", S))
        if path.writes:
            got = await admin.execute("HGETALL", effects_key(path))
            case.effects = {k.decode(): int(v) for k, v in zip(got[::2], got[1::2], strict=True)}
        return judge(case, await _state(admin, path.form)), sent


_STEPS: dict[tuple[str, str, bool], int] = {}


async def _caps_of(url: str) -> Capabilities:
    async with open_client(url) as client:
        return await client.capabilities_for(S)


async def enumerate_path(url: str, path: Path, fault: str,
                         monkeypatch: pytest.MonkeyPatch) -> list[Report]:
    """The happy path once per path (K, and its own soundness), then k < K."""
    steps = _STEPS.get((path.form, path.id, path.deletes))
    if steps is None:
        happy, steps = await run_case(url, path, None, "none", monkeypatch)
        assert not happy.problems, happy.problems
        assert steps >= 1
        if path.deletes and path.expect == "gone" and path.planner is None and not path.writes:
            # the removal the server's capabilities choose (not its name; with writes it
            # runs inside the writes script, which test_writes checks)
            caps = await _caps_of(url)
            want, never = ("XACKDEL", "XDEL") if caps.xackdel else ("XDEL", "XACKDEL")
            assert want in happy.case.names and never not in happy.case.names, happy.case.names
        if path.n > 1:  # the batch went in one batched script call
            assert any(isinstance(r, list) and len(r) == path.n for r in happy.case.batched), (
                happy.case.batched)
        if path.raced:  # ... half gated-closed
            assert any(isinstance(r, list) and None in r and any(x is not None for x in r)
                       for r in happy.case.batched), happy.case.batched
        _STEPS[path.form, path.id, path.deletes] = steps
    return [(await run_case(url, path, k, fault, monkeypatch))[0] for k in range(steps)]


def _problems(reports: list[Report]) -> list[str]:
    return [f"{r.case.label}: {p}" for r in reports for p in r.problems]


def _assert_sound(path: Path, reports: list[Report]) -> None:
    assert not _problems(reports)
    if path.gated and path.expect == "dead":
        assert all(r.dead == 1 for r in reports)
    if path.gated and path.expect == "copy" and path.form == "stream":
        assert all(r.copies == 1 for r in reports)


def over_faults(paths: list[Path]) -> Callable[[Any], Any]:
    """Parametrize a test over ``paths`` (by id) and every fault."""

    def mark(test: Any) -> Any:
        by_path = pytest.mark.parametrize("path", paths, ids=lambda p: p.id)(test)
        return pytest.mark.parametrize("fault", FAULTS)(by_path)

    return mark


def crash_points_test(paths: list[Path]) -> Any:
    """A test of every crash point of every path of ``paths``, under every fault:
    what is left is sound."""

    @over_faults(paths)
    async def test(redis_url: str, path: Path, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
        _assert_sound(path, await enumerate_path(redis_url, path, fault, monkeypatch))

    return test


test_stream_crash_points = crash_points_test(STREAM_PATHS)
test_stream_delete_on_finalize_crash_points = crash_points_test(RETENTION_PATHS)
test_reliable_list_crash_points = crash_points_test(LIST_PATHS)


@over_faults(WRITES_PATHS)
async def test_writes_crash_points(redis_url: str, path: Path, fault: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every finalization path with its last outcome carrying a write, a fault
    at every command: the write is applied exactly once per finalized message."""
    reports = await enumerate_path(redis_url, path, fault, monkeypatch)
    _assert_sound(path, reports)
    if fault in ("before", "after"):  # the consumer lives on: every case applied its writes
        assert all(r.case.effects for r in reports)


@over_faults(BATCH_PATHS)
async def test_batch_handler_crash_points(redis_url: str, path: Path, fault: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_sound(path, await enumerate_path(redis_url, path, fault, monkeypatch))


@pytest.mark.parametrize("path", [BROKEN_STREAM, BROKEN_LIST], ids=lambda p: p.form)
async def test_negative_control_remove_then_copy_is_caught_as_a_loss(
    redis_url: str, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same enumeration and checker, on the order the contract forbids."""
    lost = []
    for fault in ("crash-after", "crash-before"):
        for r in await enumerate_path(redis_url, path, fault, monkeypatch):
            if any(p.startswith("LOST") for p in r.problems):
                lost.append(r.case.label)
    # the original removed, the process dies before the copy: the message is gone
    assert f"{path.form} {path.id} k=0 crash-after" in lost
    assert f"{path.form} {path.id} k=1 crash-before" in lost
