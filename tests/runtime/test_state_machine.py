"""Hypothesis state machines: random histories of produce / read / handle /
fault / crash / restart / reclaim / time, against a real redis-server.

hypothesis-trio does not work with current Hypothesis, so every rule is one
``trio.run`` of its own (with fresh connections) against a server started
once per test; the machine keeps only plain data between rules.

The machines drive the library's own pieces, not the consumer's loop: the
readers' read / recover / claim / move code (with a stub in place of the
mount), the planner, the runtime's command merging, and a fault-injecting
client (``faults.shim``) for the finalization pipelines.  Each machine keeps
a model of what Redis must hold, interpreting every finalization command the
shim let through by the contract (gated scripts: copy first, remove second,
only while the original is pending), and checks after every step:

* the model equals the real server (unread / pending / delayed / dead-letter
  tokens per message, PEL rows with owner and delivery count);
* no loss: every produced message is finalized or physically present
  (runtime delayed copies excepted only across a crash, as documented);
* duplicates only after a fault: two tokens of one message (or a token of a
  finalized one) only for messages a fault or a crash touched;
* attempt counters never go back, and no handler call is past ``max_attempts``.

At the end of every example a real consumer drains what is left; then
nothing may be pending and nothing lost.

``TRF_LONG=1`` selects a long profile (more examples, longer histories).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import anyio
import pytest
import trio
from faults.checks import element_origin, list_state, stream_state
from faults.shim import Crash, FaultClient, FaultMode, open_fault_client
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    DROP,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    RETRY,
    DelayedRetry,
    Delivery,
    Mode,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
    open_consumer,
    retry_after,
)
from trio_redis_finalize._core._batch import batch_singles, is_batched, merge_commands
from trio_redis_finalize._core._decode import list_delivery
from trio_redis_finalize._core._plan import plan
from trio_redis_finalize._core._types import Effect, Plan, Target
from trio_redis_finalize._core.reliable_list.liveness import bumped, heartbeat_key
from trio_redis_finalize._core.reliable_list.scripts import LIST_COPY_REMOVE, LIST_ZADD_REMOVE
from trio_redis_finalize._core.stream.scripts import (
    STREAM_COPY_ACK,
    STREAM_COPY_ONCE,
    STREAM_REMOVE_RECEIPT,
    STREAM_ZADD_ACK,
)
from trio_redis_finalize._envelope import unpack_parts
from trio_redis_finalize._forms.reliable_list.reader import ReliableListReader
from trio_redis_finalize._forms.stream.own_pel import hand_over
from trio_redis_finalize._forms.stream.reader import StreamReader
from trio_redis_finalize._stats import MountStats
from trio_redis_finalize.testing import RedisServer

LONG = os.environ.get("TRF_LONG") == "1"
PROFILE = settings(
    max_examples=300 if LONG else 20,
    stateful_step_count=50 if LONG else 20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
MAX_ATTEMPTS = 4
CONSUMERS = ("w1", "w2")
TERMINAL = {Effect.ACKED, Effect.DROPPED, Effect.EXHAUSTED, Effect.DEAD_LETTERED}
T = TypeVar("T")

OUTCOMES = st.sampled_from(["ack", "drop", "retry", "later-durable", "later-runtime"])
FAULT = st.one_of(  # half of the finalizations get a fault, mostly at their first command
    st.none(),
    st.tuples(st.sampled_from([0, 0, 0, 1, 2]), st.sampled_from([FaultMode.BEFORE, FaultMode.AFTER]),
              st.sampled_from(["resend", "crash"])),
)


def _outcome(kind: str) -> Outcome:
    return {"ack": ACK, "drop": DROP, "retry": RETRY}.get(kind) or retry_after(0.01)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _pairs(flat: Any) -> dict[bytes, bytes]:
    flat = [f if isinstance(f, bytes) else str(f).encode() for f in flat]
    return dict(zip(flat[::2], flat[1::2], strict=True))


class Stub:
    """What the readers need of a mount (``_context.Context``): name, target, client, consumer, in_hand,
    stats, and the two hand-over calls (collected here)."""

    def __init__(self, consumer: str, target: Target, client: FaultClient) -> None:
        self.name = target.name
        self.target = target
        self.client = client
        self.consumer = SimpleNamespace(name=consumer, shutdown_grace=0.0, token=f"sm/0/{consumer}")
        self.takeover = False
        self.in_hand: set[str] = set()
        self.stats = MountStats(subscription=target.name)
        self.concurrency = 1
        self.got: list[Delivery] = []
        self.direct: list[tuple[Delivery, Plan]] = []

    async def deliver(self, deliveries: list[Delivery], direct: list[tuple[Delivery, Plan]] = [],  # noqa: B006
                      *, give_back: bool = False) -> None:
        self.direct.extend(direct)
        self.got.extend(deliveries)

    async def send_plans(self, items: list[tuple[Delivery, Plan]]) -> None:
        self.direct.extend(items)

    def defer(self, d: Delivery, delay: float) -> bool:
        return False  # no Backoff waits here: recovered deliveries go out now

    def disown(self, others: dict[str, str]) -> list[Delivery]:
        self.in_hand.difference_update(others)
        return []

    def backing_off(self) -> list[Delivery]:
        return []


async def send_until_answered(client: FaultClient, commands: list[Any]) -> bool:
    """``commands`` (if any) sent in one pipeline, again while the outcome is
    unknown (what Mount._finalize does), until an answer; True if the armed
    fault crashed the process instead."""
    try:
        while commands:
            try:
                await client.pipeline(commands, raise_on_error=False)
                break
            except rexc.ConnectionError:
                continue  # outcome unknown: send again
    except Crash:
        return True
    return False


class Violation(AssertionError):
    pass


class Base(RuleBasedStateMachine):
    """Shared bookkeeping: the server, the consumers' hands, the origin ledger."""

    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.alive = dict.fromkeys(CONSUMERS, True)
        self.hand: dict[str, list[Delivery]] = {c: [] for c in CONSUMERS}
        self.held: dict[str, list[tuple[str, tuple[Any, ...]]]] = {c: [] for c in CONSUMERS}
        self.produced: list[str] = []
        self.terminal: set[str] = set()
        self.touched: set[str] = set()  # a fault or a crash hit this message
        self.runtime_lost: set[str] = set()  # a runtime copy died with its process
        self.attempts: dict[str, list[int]] = {}
        self.token_attempt: dict[str, int] = {}
        self.faults = 0
        self.serial = 0
        self.run(self._flush)

    async def _flush(self, client: FaultClient) -> None:
        await client.execute("FLUSHALL")

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def main() -> T:
            async with open_fault_client(self.url) as client:
                with anyio.fail_after(10):
                    return await fn(client, *args)

        return trio.run(main)

    # -- rules every form shares ----------------------------------------------------
    @precondition(lambda self: any(self.alive[c] and self.hand[c] for c in CONSUMERS))
    @rule(c=st.sampled_from(CONSUMERS),
          picks=st.lists(st.tuples(st.integers(0, 5), OUTCOMES), min_size=1, max_size=3),
          fault=FAULT)
    def handle(self, c: str, picks: list[tuple[int, str]], fault: tuple[int, FaultMode, str] | None) -> None:
        c = self.pick(c, lambda c: self.alive[c] and bool(self.hand[c]))
        hand = self.hand[c]
        chosen: dict[int, str] = {}
        for i, kind in picks:
            chosen.setdefault(i % len(hand), kind)
        items: list[tuple[Delivery, Plan]] = []
        for i, kind in chosen.items():
            d = hand[i]
            self.call_handler(d)
            way = DelayedRetry.RUNTIME if kind == "later-runtime" else DelayedRetry.DURABLE_ZSET
            p = plan(self.target(c, way), d, _outcome(kind))
            self.check_copy(d, p)
            items.append((d, p))
        self.hand[c] = [d for i, d in enumerate(hand) if i not in chosen]

        async def go(client: FaultClient) -> None:
            await self.send(client, c, items, fault)

        self.run(go)

    @precondition(lambda self: any(self.alive[c] and self.held[c] for c in CONSUMERS))
    @rule(c=st.sampled_from(CONSUMERS), fault=FAULT)
    def publish_held(self, c: str, fault: tuple[int, FaultMode, str] | None) -> None:
        """The scheduler's part: runtime delayed copies go out (resent when unknown)."""
        c = self.pick(c, lambda c: self.alive[c] and bool(self.held[c]))
        held, self.held[c] = self.held[c], []

        async def go(client: FaultClient) -> None:
            await anyio.sleep(0.012)  # every delay is 0.01 s
            commands = [cmd for _, cmds in held for cmd in cmds]
            if fault is not None:
                self.faults += 1
                self.touched.update(o for o, _ in held)
                client.arm(fault[0], fault[1], crash=fault[2] == "crash")
            crashed = await send_until_answered(client, commands)
            client.disarm()
            sent = list(client.sent)
            client.sent.clear()
            for cmd in sent:
                self.apply(cmd)
            if crashed:  # what was sent is a prefix; the rest died with the process
                i = 0
                for origin, cmds in held:
                    if i + len(cmds) > len(sent):
                        self.lose_held(origin)
                    i += len(cmds)
                self.crash(c)

        self.run(go)

    @precondition(lambda self: any(self.alive[c] and (self.hand[c] or self.held[c]) for c in CONSUMERS))
    @rule(c=st.sampled_from(CONSUMERS), restart=st.booleans())
    def kill(self, c: str, restart: bool) -> None:
        """SIGKILL; with ``restart`` a supervisor starts it again at once."""
        c = self.pick(c, lambda c: self.alive[c] and bool(self.hand[c] or self.held[c]))
        self.crash(c)
        if restart:
            self.restart(c)

    @precondition(lambda self: not all(self.alive.values()))
    @rule(c=st.sampled_from(CONSUMERS))
    def revive(self, c: str) -> None:
        self.restart(self.pick(c, lambda c: not self.alive[c]))

    def restart(self, c: str) -> None:
        raise NotImplementedError

    def target(self, c: str, way: DelayedRetry = DelayedRetry.DURABLE_ZSET) -> Target:
        raise NotImplementedError

    def pick(self, c: str, ok: Callable[[str], bool]) -> str:
        """``c`` when it qualifies, else the other consumer (the rule's precondition
        guarantees one does)."""
        if ok(c):
            return c
        other = next(o for o in CONSUMERS if o != c)
        assert ok(other)
        return other

    # -- handler calls and finalization ---------------------------------------
    def call_handler(self, d: Delivery) -> None:
        """The handler runs: attempts never past the limit, never going back.

        Per message while no fault touched it (one lineage), per delivery
        always (a re-read counts up); across the duplicate branches a fault
        made, each copy still counts past its parent (see :meth:`check_copy`).
        """
        if d.attempt > MAX_ATTEMPTS:
            raise Violation(f"handler called at attempt {d.attempt} > max_attempts ({d.origin_id})")
        seen = self.attempts.setdefault(d.origin_id, [])
        if seen and d.attempt < seen[-1] and d.origin_id not in self.touched:
            raise Violation(f"attempt went back from {seen[-1]} to {d.attempt} ({d.origin_id}: {seen})")
        seen.append(d.attempt)
        token = d.id or repr(d.raw)
        last = self.token_attempt.get(token, 0)
        if d.attempt < last:
            raise Violation(f"delivery {token} came back at attempt {d.attempt} after {last}")
        self.token_attempt[token] = d.attempt

    def check_copy(self, d: Delivery, p: Plan) -> None:
        """A copy's retry counter is at least its parent's attempt: the copy's
        attempt (counter + 1) is higher than the parent's."""
        if p.effect not in (Effect.COPIED, Effect.DELAYED, Effect.HELD):
            return  # dead letters keep the counter they arrived with
        for cmd in (*p.commands, *p.later):
            r = self.copy_retries(cmd)
            if r is not None and r < d.attempt:
                raise Violation(f"copy of {d.origin_id} at attempt {d.attempt} carries retries={r}")

    def copy_retries(self, cmd: Any) -> int | None:
        raise NotImplementedError

    def crash(self, c: str) -> None:
        """Process ``c`` dies: what it held in hand and in memory is gone."""
        self.alive[c] = False
        event("crash")
        for d in self.hand[c]:
            self.touched.add(d.origin_id)
        self.hand[c] = []
        for origin, _ in self.held[c]:
            self.lose_held(origin)
            self.touched.add(origin)
        self.held[c] = []

    def lose_held(self, origin: str) -> None:
        """A runtime delayed copy dies with its process (streams: documented loss)."""
        self.runtime_lost.add(origin)

    async def send(self, client: FaultClient, c: str, items: list[tuple[Delivery, Plan]],
                   fault: tuple[int, FaultMode, str] | None) -> bool:
        """Send plans the way the runtime's finalizer does (merged, resent on
        an unknown outcome); the model follows every command that got through.
        Returns False when the process crashed."""
        commands = merge_commands([p.commands for _, p in items])
        before = self.tokens_of(c, items)
        if fault is not None and commands:
            k, mode, then = fault
            self.faults += 1
            for d, _ in items:
                self.touched.add(d.origin_id)
            client.arm(k, mode, crash=then == "crash")
        crashed = await send_until_answered(client, commands)
        client.disarm()
        for cmd in client.sent:
            self.apply(cmd)
        client.sent.clear()
        if fault is not None and client.fired is not None:
            event(f"fault {fault[1].value}/{fault[2]} fired")
        after = self.tokens_of(c, items)
        taken: Counter[Any] = Counter()
        for d, p in items:
            event(f"finalized: {p.effect.value}")
            k = self.key(d)
            if before[k] - after[k] > taken[k]:  # this finalization removed the original
                taken[k] += 1
                if p.effect in TERMINAL:
                    self.terminal.add(d.origin_id)
                if p.later and crashed:  # acknowledged, its copy died with the process
                    self.lose_held(d.origin_id)
                elif p.later:
                    self.held[c].append((d.origin_id, tuple(p.later)))
            elif p.effect is Effect.HELD and p.later and not p.commands and not crashed:
                self.held[c].append((d.origin_id, tuple(p.later)))  # lists: nothing now
        if crashed:
            self.crash(c)
        return not crashed

    def tokens_of(self, c: str, items: list[tuple[Delivery, Plan]]) -> Counter[Any]:
        return Counter({self.key(d): self.count(c, d) for d, _ in items})

    # to be provided by the forms
    def key(self, d: Delivery) -> Any:
        raise NotImplementedError

    def count(self, c: str, d: Delivery) -> int:
        """How many of ``d``'s original are still pending for ``c`` (model)."""
        raise NotImplementedError

    def apply(self, cmd: Any) -> None:
        raise NotImplementedError

    held_counts = True  # is a held runtime copy a token of its own (streams: yes)

    def judge(self, present: Counter[str]) -> None:
        for o in self.produced:
            held = sum(1 for c in CONSUMERS for origin, _ in self.held[c] if origin == o)
            tokens = present[o] + (held if self.held_counts else 0)
            if tokens + held == 0 and o not in self.terminal and o not in self.runtime_lost:
                raise Violation(f"LOST: message {o} is neither finalized nor anywhere in Redis")
            if (tokens > 1 or (tokens and o in self.terminal)) and o not in self.touched:
                raise Violation(f"duplicate of {o} ({tokens} tokens, finalized={o in self.terminal}) "
                                "without a fault")

    def judge_state(self, state: Any) -> None:
        """The dead letters Redis holds are the model's; then :meth:`judge`."""
        if state.dead_letters() != +self.dead:
            raise Violation(f"dead letters: Redis {dict(state.dead_letters())}, model {dict(self.dead)}")
        self.judge(state.present())

    WAITING = ("messages", "waiting")
    """What the form reads, and what the model calls them until then (messages)."""

    def waiting(self) -> int:
        """How many messages wait to be read (the form's own count)."""
        raise NotImplementedError

    async def read_into(self, client: FaultClient, c: str, count: int) -> int:
        """``c`` reads up to ``count`` messages into its hand; how many it read."""
        raise NotImplementedError

    @precondition(lambda self: any(self.alive.values()) and self.waiting() > 0)
    @rule(c=st.sampled_from(CONSUMERS), count=st.integers(1, 3))
    def read(self, c: str, count: int) -> None:
        c = self.pick(c, lambda c: self.alive[c])
        expect = min(count, self.waiting())
        got = self.run(self.read_into, c, count)
        if got != expect:
            what, state = self.WAITING
            raise Violation(f"read {got} {what}, the model has {expect} {state}")

    @precondition(lambda self: any(self.alive.values()) and self.waiting() > 0)
    @rule(c=st.sampled_from(CONSUMERS), outcomes=st.lists(OUTCOMES, min_size=1, max_size=3),
          fault=FAULT)
    def work(self, c: str, outcomes: list[str], fault: tuple[int, FaultMode, str] | None) -> None:
        """A consumer's loop in one step: read, handle all of it, finalize in one batch."""
        c = self.pick(c, lambda c: self.alive[c])
        before = len(self.hand[c])
        self.read(c, len(outcomes))
        if self.alive[c] and len(self.hand[c]) > before:
            self.handle(c, [(before + i, kind) for i, kind in enumerate(outcomes)], fault)

    async def publish_held_at_shutdown(self, client: FaultClient, c: str) -> None:
        """What shutdown does with ``c``'s held runtime copies: publishes them at once."""
        cmds = [cmd for _, later in self.held[c] for cmd in later]
        if cmds:
            await client.pipeline(cmds)

    async def drain(self, sub: Any, drained: Callable[[Any], Awaitable[bool]]) -> set[str]:
        """A real consumer ``drain`` on ``sub`` acknowledges everything until
        ``drained(consumer)`` (within 8 s); the origins it handled."""
        handled: set[str] = set()

        async def ack(d: Delivery) -> Outcome:
            handled.add(d.origin_id)
            return ACK

        async with open_consumer(self.url, name="drain", shutdown_grace=1.0) as consumer:
            await consumer.mount(sub, ack)
            with anyio.fail_after(8):
                while True:
                    await anyio.sleep(0.05)
                    if await drained(consumer):
                        break
        return handled


# -- streams ---------------------------------------------------------------------

S, G, DEAD = "orders", "billing", "dead-orders"
S_DELAYS = "{orders}:delayed"


def _stream_sub(way: DelayedRetry, *, mode: Mode = Mode.PLAIN, min_idle: float = 60.0) -> StreamSubscription:
    sub = StreamSubscription(S, G, mode=mode, delayed_retry=way, max_attempts=MAX_ATTEMPTS,
                             dead_letter=DEAD, min_idle=max(min_idle, 0.01), block=0.05)
    if min_idle < 0.01:  # the readers' claim called directly: claim at once (no lease here)
        object.__setattr__(sub, "min_idle", min_idle)
    return sub


class StreamMachine(Base):
    """One stream, one group, two consumers (w1, w2), durable and runtime delays."""

    def __init__(self) -> None:
        self.unread: Counter[tuple[str, int]] = Counter()
        self.pending: dict[str, tuple[str, int, str, int]] = {}  # id -> consumer, count, origin, retries
        self.delayed: Counter[tuple[str, int]] = Counter()
        self.dead: Counter[str] = Counter()
        self.copy_marks: set[str] = set()  # runtime copies' receipts, once copied (written once)
        self.receipts: set[str] = set()  # runtime retry_afters' receipts: removed by that one
        self.readers = {c: StreamReader(_stream_sub(DelayedRetry.DURABLE_ZSET)) for c in CONSUMERS}
        super().__init__()

    async def _flush(self, client: FaultClient) -> None:
        await client.execute("FLUSHALL")
        await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")

    def target(self, c: str, way: DelayedRetry = DelayedRetry.DURABLE_ZSET) -> Target:
        return _stream_sub(way).target(c)

    def stub(self, c: str, client: FaultClient) -> Stub:
        s = Stub(c, self.target(c), client)
        s.in_hand = {d.id for d in self.hand[c] if d.id is not None}
        return s

    # -- the model's reading of the commands ----------------------------------
    def key(self, d: Delivery) -> Any:
        return d.id

    def count(self, c: str, d: Delivery) -> int:
        return 1 if d.id in self.pending else 0

    def _add(self, key: str, fields: dict[bytes, bytes]) -> None:
        origin = fields[ORIGIN_FIELD].decode()
        retries = int(fields[RETRIES_FIELD])
        if key == S:
            self.unread[origin, retries] += 1
        elif key == DEAD:
            self.dead[origin] += 1
        else:
            raise Violation(f"copy to an unexpected key {key!r}")

    def apply(self, cmd: Any) -> None:
        name = _s(cmd[0]).upper()
        if name == "XACK":
            for eid in cmd[3:]:
                self.pending.pop(_s(eid), None)
        elif name == "XADD":
            self._add(_s(cmd[1]), _pairs(cmd[3:]))
        elif name == "EVALSHA" and is_batched(cmd):
            for single in batch_singles(cmd):  # each delivery as its own script, in order
                self.apply(single)
        elif name == "EVALSHA" and cmd[1] == STREAM_COPY_ONCE.sha:
            # a runtime copy, written once: its marker makes a resend write nothing
            # (only while its receipt says its removal removed the original)
            keys, argv = [_s(k) for k in cmd[3:5]], list(cmd[5:])
            if keys[1] in self.receipts and keys[1] not in self.copy_marks:
                self.copy_marks.add(keys[1])
                self._add(keys[0], _pairs(argv[2:]))
        elif name == "EVALSHA" and cmd[1] == STREAM_REMOVE_RECEIPT.sha:
            # a runtime retry_after's removal: gated, leaves its receipt
            receipt, eid = _s(cmd[4]), _s(cmd[6])
            if eid in self.pending:
                del self.pending[eid]
                self.receipts.add(receipt)
        elif name == "EVALSHA":
            n = int(cmd[2])
            keys, argv = [_s(k) for k in cmd[3:3 + n]], list(cmd[3 + n:])
            eid = _s(argv[1])
            if eid not in self.pending:
                return  # the gate is closed: nothing happens
            if cmd[1] == STREAM_COPY_ACK.sha:
                self._add(keys[1], _pairs(argv[2:]))
            elif cmd[1] == STREAM_ZADD_ACK.sha:
                fields = _pairs(unpack_parts(argv[3])[1:])
                self.delayed[fields[ORIGIN_FIELD].decode(), int(fields[RETRIES_FIELD])] += 1
            else:
                raise Violation(f"unexpected script in a finalization: {cmd[:3]!r}")
            del self.pending[eid]
        else:
            raise Violation(f"unexpected finalization command {name}")

    def copy_retries(self, cmd: Any) -> int | None:
        if _s(cmd[0]).upper() == "XADD":
            return int(_pairs(cmd[3:])[RETRIES_FIELD])
        if _s(cmd[0]).upper() != "EVALSHA":
            return None
        argv = list(cmd[3 + int(cmd[2]):])
        if cmd[1] == STREAM_COPY_ACK.sha or cmd[1] == STREAM_COPY_ONCE.sha:  # (fields from 3rd arg)
            return int(_pairs(argv[2:])[RETRIES_FIELD])
        if cmd[1] == STREAM_ZADD_ACK.sha:
            return int(_pairs(unpack_parts(argv[3])[1:])[RETRIES_FIELD])
        return None

    def _took(self, c: str, stub: Stub, claimed: bool) -> None:
        """Entries a reader handed over (read, re-read or claimed) by ``c``."""
        for d in [*stub.got, *(d for d, _ in stub.direct)]:
            assert d.id is not None
            if d.id in self.pending:
                owner, count, origin, retries = self.pending[d.id]
                if not claimed and owner != c:
                    raise Violation(f"{c} re-read {d.id} owned by {owner}")
                self.pending[d.id] = (c, count + 1, origin, retries)
            else:
                key = (d.origin_id, d.retries)
                if self.unread[key] <= 0:
                    raise Violation(f"{c} read {d.id} {key}, which the model has no unread token for")
                self.unread[key] -= 1
                self.pending[d.id] = (c, 1, d.origin_id, d.retries)
            _, count, _, retries = self.pending[d.id]
            if d.attempt != retries + count:
                raise Violation(f"{d.id}: attempt {d.attempt}, expected {retries} + {count}")
        self.hand[c].extend(stub.got)

    async def _finalize_direct(self, client: FaultClient, c: str, stub: Stub) -> None:
        if stub.direct:
            await self.send(client, c, stub.direct, None)

    # -- rules -------------------------------------------------------------------
    @precondition(lambda self: sum(self.unread.values()) < 6)
    @rule(n=st.integers(1, 3))
    def produce(self, n: int) -> None:
        async def go(client: FaultClient) -> list[str]:
            replies = await client.pipeline([("XADD", S, "*", "n", str(self.serial + i)) for i in range(n)])
            return [_s(r) for r in replies]

        for eid in self.run(go):
            self.produced.append(eid)
            self.unread[eid, 0] += 1
        self.serial += n

    async def read_into(self, client: FaultClient, c: str, count: int) -> int:
        stub = self.stub(c, client)
        async with await client.connect() as conn:
            reply = await conn.execute("XREADGROUP", "GROUP", G, c, "COUNT", count,
                                       "STREAMS", S, ">")
        entries = reply[0][1] if reply else []
        await hand_over(stub, entries)
        self._took(c, stub, claimed=False)
        await self._finalize_direct(client, c, stub)
        return len(entries)

    WAITING = ("entries", "unread")

    def waiting(self) -> int:
        return sum(self.unread.values())

    def restart(self, c: str) -> None:
        """The same name comes back: re-read its own PEL (XREADGROUP ... 0)."""
        self.alive[c] = True
        self.readers[c] = StreamReader(_stream_sub(DelayedRetry.DURABLE_ZSET))
        mine = {i for i, row in self.pending.items() if row[0] == c}

        async def go(client: FaultClient) -> None:
            stub = self.stub(c, client)
            async with await client.connect() as conn:
                await self.readers[c].own_pel.recover(conn, stub)
            got = {d.id for d in [*stub.got, *(d for d, _ in stub.direct)]}
            if got != mine:
                raise Violation(f"{c} recovered {sorted(map(str, got))}, its PEL holds {sorted(mine)}")
            self._took(c, stub, claimed=False)
            await self._finalize_direct(client, c, stub)

        self.run(go)

    @precondition(lambda self: not any(self.hand.values()) and any(self.alive.values())
                  and bool(self.pending))
    @rule(c=st.sampled_from(CONSUMERS))
    def reclaim(self, c: str) -> None:
        """XAUTOCLAIM (reclaim mode, min_idle 0) while nobody has work in hand:
        takes over what dead consumers left pending."""
        c = self.pick(c, lambda c: self.alive[c])
        reader = StreamReader(_stream_sub(DelayedRetry.DURABLE_ZSET, mode=Mode.RECLAIM, min_idle=0.0))

        async def go(client: FaultClient) -> None:
            stub = self.stub(c, client)
            async with await client.connect() as conn:
                await reader.own_pel.claim(conn, stub)
            self._took(c, stub, claimed=True)
            await self._finalize_direct(client, c, stub)

        self.run(go)

    @precondition(lambda self: sum(self.delayed.values()) > 0)
    @rule()
    def advance_time(self) -> None:
        """Delays are over: the reader's move of due copies (one script)."""
        async def go(client: FaultClient) -> None:
            await anyio.sleep(0.012)
            c = next((c for c in CONSUMERS if self.alive[c]), CONSUMERS[0])
            await StreamReader(_stream_sub(DelayedRetry.DURABLE_ZSET))._move_due(
                self.stub(c, client))

        self.run(go)
        self.unread.update(self.delayed)
        self.delayed.clear()

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def model_matches_redis_and_nothing_is_lost(self) -> None:
        state = self.run(lambda client: stream_state(client, S, G, delay_key=S_DELAYS, dead_letter=DEAD))
        unread = Counter((e.origin, e.retries) for e in state.unread())
        if unread != +self.unread:
            raise Violation(f"unread entries: Redis {dict(unread)}, model {dict(+self.unread)}")
        model_pel = {i: (c, n) for i, (c, n, _, _) in self.pending.items()}
        if state.pending != model_pel:
            raise Violation(f"PEL: Redis {state.pending}, model {model_pel}")
        delayed = Counter((f[ORIGIN_FIELD].decode(), int(f[RETRIES_FIELD])) for f in state.delayed)
        if delayed != +self.delayed:
            raise Violation(f"delay set: Redis {dict(delayed)}, model {dict(+self.delayed)}")
        self.judge_state(state)

    def teardown(self) -> None:
        """A graceful end, then a real consumer drains: nothing pending, nothing lost."""
        if not self.produced:
            return

        async def go(client: FaultClient) -> None:
            for c in CONSUMERS:
                await self.publish_held_at_shutdown(client, c)

            async def empty(consumer: Any) -> bool:
                state = await stream_state(client, S, G, delay_key=S_DELAYS, dead_letter=DEAD)
                return not state.present() and not any(m.in_hand for m in consumer.mounts)

            sub = _stream_sub(DelayedRetry.DURABLE_ZSET, mode=Mode.RECLAIM, min_idle=0.05)
            drained = await self.drain(sub, empty)
            state = await stream_state(client, S, G, delay_key=S_DELAYS, dead_letter=DEAD)
            assert not state.pending, f"stranded after the drain: {state.pending}"
            dead = state.dead_letters()  # past max_attempts: dead-lettered unhandled
            lost = [o for o in self.produced if o not in self.terminal and o not in drained
                    and o not in self.runtime_lost and not dead[o]]
            assert not lost, f"LOST after the drain: {lost}"

        self.run(go)


# -- reliable lists -----------------------------------------------------------------

Q, Q_DEAD, Q_DELAYS = "jobs", "dead-jobs", "{jobs}:delayed"


def _list_sub(way: DelayedRetry = DelayedRetry.DURABLE_ZSET, heartbeat: float = 3600.0
              ) -> ReliableListSubscription:
    return ReliableListSubscription(Q, delayed_retry=way, max_attempts=MAX_ATTEMPTS,
                                    dead_letter=Q_DEAD, block=0.05, heartbeat=heartbeat)


def _proc(c: str) -> str:
    return _list_sub().processing_key(c)


class ListMachine(Base):
    """One reliable list, two consumers with processing lists, heartbeats and
    the reaper, durable and runtime delays."""

    held_counts = False  # a held runtime copy stands for the original still in processing

    def __init__(self) -> None:
        self.queue: Counter[bytes] = Counter()
        self.processing: dict[str, Counter[bytes]] = {c: Counter() for c in CONSUMERS}
        self.delayed: Counter[bytes] = Counter()
        self.dead: Counter[str] = Counter()
        self.readers = {c: ReliableListReader(_list_sub()) for c in CONSUMERS}
        super().__init__()

    async def _flush(self, client: FaultClient) -> None:
        await client.execute("FLUSHALL")
        for c in CONSUMERS:
            await client.pipeline([self.readers[c]._liveness.beat(self.stub(c, client), 3600.0)])

    def target(self, c: str, way: DelayedRetry = DelayedRetry.DURABLE_ZSET) -> Target:
        return _list_sub(way).target(c)

    def stub(self, c: str, client: FaultClient) -> Stub:
        return Stub(c, self.target(c), client)

    def lose_held(self, origin: str) -> None:
        pass  # the original is still in the processing list: recovered, not lost

    # -- the model's reading of the commands ----------------------------------
    def key(self, d: Delivery) -> Any:
        return d.raw

    def count(self, c: str, d: Delivery) -> int:
        assert d.raw is not None
        return self.processing[c][d.raw]

    def _owner(self, key: Any) -> str:
        for c in CONSUMERS:
            if _s(key) == _proc(c):
                return c
        raise Violation(f"finalization on an unexpected processing list {key!r}")

    def _remove(self, c: str, raw: bytes) -> bool:
        if self.processing[c][raw] > 0:
            self.processing[c][raw] -= 1
            return True
        return False

    def _push(self, key: str, element: bytes) -> None:
        if key == Q:
            self.queue[element] += 1
        elif key == Q_DEAD:
            self.dead[element_origin(element)[0]] += 1
        else:
            raise Violation(f"copy to an unexpected key {key!r}")

    def apply(self, cmd: Any) -> None:
        name = _s(cmd[0]).upper()
        if name == "LREM":
            self._remove(self._owner(cmd[1]), cmd[3])
        elif name == "LPUSH":
            for e in cmd[2:]:
                self._push(_s(cmd[1]), e)
        elif name == "EVALSHA":
            n = int(cmd[2])
            keys, argv = [_s(k) for k in cmd[3:3 + n]], list(cmd[3 + n:])
            c = self._owner(keys[0])
            if self.processing[c][argv[0]] <= 0:
                return  # the gate is closed: nothing happens
            if cmd[1] == LIST_COPY_REMOVE.sha:
                self._push(keys[1], argv[1])
            elif cmd[1] == LIST_ZADD_REMOVE.sha:
                self.delayed[unpack_parts(argv[2])[1]] += 1
            else:
                raise Violation(f"unexpected script in a finalization: {cmd[:3]!r}")
            self._remove(c, argv[0])
        else:
            raise Violation(f"unexpected finalization command {name}")

    def copy_retries(self, cmd: Any) -> int | None:
        if _s(cmd[0]).upper() != "EVALSHA":
            return None
        argv = list(cmd[3 + int(cmd[2]):])
        if cmd[1] == LIST_COPY_REMOVE.sha:
            return element_origin(argv[1])[1]
        if cmd[1] == LIST_ZADD_REMOVE.sha:
            return element_origin(unpack_parts(argv[2])[1])[1]
        return None

    def _took(self, c: str, built: list[tuple[Delivery, Plan | None]]) -> list[tuple[Delivery, Plan]]:
        direct: list[tuple[Delivery, Plan]] = []
        for d, p in built:
            if d.attempt != d.retries + 1:
                raise Violation(f"list element at attempt {d.attempt} with retries {d.retries}")
            if p is None:
                self.hand[c].append(d)
            else:
                direct.append((d, p))
        return direct

    # -- rules -------------------------------------------------------------------
    @precondition(lambda self: sum(self.queue.values()) < 6)
    @rule(n=st.integers(1, 3))
    def produce(self, n: int) -> None:
        elements = [f"job-{self.serial + i}".encode() for i in range(n)]
        self.serial += n

        async def go(client: FaultClient) -> None:
            await client.execute("LPUSH", Q, *elements)

        self.run(go)
        for e in elements:
            self.queue[e] += 1
            self.produced.append(element_origin(e)[0])

    async def read_into(self, client: FaultClient, c: str, count: int) -> int:
        """The reader's BLMOVE/LMOVE batch, then the library's delivery building."""
        reader = self.readers[c]
        stub = self.stub(c, client)
        async with await client.connect() as conn:
            moved = await conn.pipeline([("LMOVE", Q, _proc(c), "RIGHT", "LEFT")] * count)
        built = []
        for raw in moved:
            if raw is None:
                continue
            if self.queue[raw] <= 0:
                raise Violation(f"{c} read {raw!r}, which the model has no queued token for")
            self.queue[raw] -= 1
            self.processing[c][raw] += 1
            reader._recovery.hold(raw)
            built.append(list_delivery(stub.target, Q, raw))
        direct = self._took(c, built)
        if direct:
            await self.send(client, c, direct, None)
        return len(built)

    WAITING = ("elements", "queued")

    def waiting(self) -> int:
        return sum(self.queue.values())

    def restart(self, c: str) -> None:
        """The same name comes back: heartbeat, then a re-scan of its processing
        list (each element's counter bumped in place: a crash counts)."""
        self.alive[c] = True
        reader = self.readers[c] = ReliableListReader(_list_sub())
        expected = Counter({(bumped(e) or e): n for e, n in self.processing[c].items() if n > 0})

        async def go(client: FaultClient) -> None:
            stub = self.stub(c, client)
            await client.pipeline([reader._liveness.beat(stub, 3600.0)])
            async with await client.connect() as conn:
                await reader._recovery.rescan(conn, stub)
            got = Counter(d.raw for d in [*stub.got, *(d for d, _ in stub.direct)])
            if got != expected:
                raise Violation(f"{c} re-delivered {dict(got)}, its processing list holds "
                                f"{dict(expected)}")
            self.processing[c] = Counter(expected)
            direct = self._took(c, [*((d, None) for d in stub.got), *stub.direct])
            if direct:
                await self.send(client, c, direct, None)

        self.run(go)

    @precondition(lambda self: any(self.alive.values()) and any(
        not self.alive[c] and +self.processing[c] for c in CONSUMERS))
    @rule(c=st.sampled_from(CONSUMERS))
    def reclaim(self, c: str) -> None:
        """The dead consumer's heartbeat has expired: a live one's reaper moves
        its processing list back onto the queue (counters bumped)."""
        c = self.pick(c, lambda c: self.alive[c])
        dead = [o for o in CONSUMERS if not self.alive[o]]

        async def go(client: FaultClient) -> int:
            for o in dead:
                await client.execute("DEL", heartbeat_key(Q, o))
            return await self.readers[c]._liveness.reap(self.stub(c, client))

        moved = self.run(go)
        expect = 0
        for o in dead:
            for e, n in self.processing[o].items():
                self.queue[bumped(e) or e] += n
                expect += n
            self.processing[o].clear()
        if moved != expect:
            raise Violation(f"the reaper moved {moved} elements, the model {expect}")

    @precondition(lambda self: sum(self.delayed.values()) > 0)
    @rule()
    def advance_time(self) -> None:
        """Delays are over: the reader's move of due copies (one script)."""
        async def go(client: FaultClient) -> None:
            await anyio.sleep(0.012)
            await ReliableListReader(_list_sub())._move_due(self.stub(CONSUMERS[0], client))

        self.run(go)
        self.queue.update(self.delayed)
        self.delayed.clear()

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def model_matches_redis_and_nothing_is_lost(self) -> None:
        state = self.run(lambda client: list_state(client, Q, [_proc(c) for c in CONSUMERS],
                                                   delay_key=Q_DELAYS, dead_letter=Q_DEAD))
        if Counter(state.queue) != +self.queue:
            raise Violation(f"queue: Redis {dict(Counter(state.queue))}, model {dict(+self.queue)}")
        for c in CONSUMERS:
            real = Counter(state.processing[_proc(c)])
            if real != +self.processing[c]:
                raise Violation(f"processing of {c}: Redis {dict(real)}, model {dict(+self.processing[c])}")
        if Counter(state.delayed) != +self.delayed:
            raise Violation(f"delay set: Redis {dict(Counter(state.delayed))}, model {dict(+self.delayed)}")
        self.judge_state(state)

    def teardown(self) -> None:
        """A graceful end, then a real consumer drains (its reaper takes over the
        processing lists): nothing left anywhere, nothing lost."""
        if not self.produced:
            return

        async def go(client: FaultClient) -> None:
            for c in CONSUMERS:
                await self.publish_held_at_shutdown(client, c)
                await client.execute("DEL", heartbeat_key(Q, c))
            procs = [_proc(c) for c in (*CONSUMERS, "drain")]

            async def empty(consumer: Any) -> bool:
                state = await list_state(client, Q, procs, delay_key=Q_DELAYS, dead_letter=Q_DEAD)
                return not state.present()

            drained = await self.drain(_list_sub(heartbeat=0.3), empty)
            state = await list_state(client, Q, procs, delay_key=Q_DELAYS, dead_letter=Q_DEAD)
            assert not state.present(), f"left after the drain: {state}"
            dead = state.dead_letters()
            lost = [o for o in self.produced if o not in self.terminal and o not in drained
                    and not dead[o]]
            assert not lost, f"LOST after the drain: {lost}"

        self.run(go)


def _run_machine(machine: type[Base], server: RedisServer) -> None:
    machine.url = server.url
    run_state_machine_as_test(machine, settings=PROFILE)


@pytest.mark.timeout(3600 if LONG else 600)  # shrinking a failure takes minutes
def test_stream_state_machine(redis_server: RedisServer) -> None:
    _run_machine(StreamMachine, redis_server)


@pytest.mark.timeout(3600 if LONG else 600)  # shrinking a failure takes minutes
def test_reliable_list_state_machine(redis_server: RedisServer) -> None:
    _run_machine(ListMachine, redis_server)


# -- histories through the whole consumer, on the wire ---------------------------
#
# The machines above drive the readers' pieces with a fault shim.  These drive
# the real consumer (open_consumer, mount) through the command-aware proxy
# (``faults.cmdproxy``), with the data and faults crash tests cannot see:
# identical payloads in a reliable list (the same element pushed twice),
# repeated field names (``item a item b``), two groups on one stream, a group
# destroyed mid-run (XGROUP DESTROY), injected transient error replies, lost
# replies, and real OOM periods (``CONFIG SET maxmemory 1``).  One history is
# one ``trio.run``: its steps run against a live consumer, then the consumer
# drains, shuts down, and the history is judged:
#
# * no loss: every message is finalized by each group (its handler returned
#   ACK for it) or still physically in Redis;
# * duplicates only from faults: handler calls per message and group are what
#   the handler asked for, plus one per fault that can duplicate (a lost
#   reply), plus, for a destroyed group, what it had pending at the destroy;
# * copies keep the original field list byte for byte (order, repeats);
# * identical elements: each push is finalized once.

from faults.cmdproxy import LOST, TRANSIENT_ERRORS, CommandProxy, error  # noqa: E402
from hypothesis import example, given  # noqa: E402

from trio_redis_finalize._core._types import content_origin  # noqa: E402

H_STREAM, H_GA, H_GB = "hist", "ga", "gb"
H_QUEUE = "hjobs"
H_PROFILE = settings(
    max_examples=60 if LONG else 4,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
_WIRE_ERRORS = [c for c in TRANSIENT_ERRORS if c != "NOSCRIPT"]
_STREAM_KINDS = ["XREADGROUP>", "XACK", "EVALSHA:stream_copy_ack", "EVALSHA:stream_copy_ack_batch",
                 "XADD", "XGROUP CREATE"]
_LIST_KINDS = ["BLMOVE", "LMOVE", "LREM", "EVALSHA:list_copy_remove", "LPUSH", "LRANGE"]


def _steps(kinds: list[str], *, destroy: bool) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    step = st.one_of(
        st.tuples(st.just("produce"), st.integers(1, 3), st.booleans()),
        st.tuples(st.just("fault"), st.sampled_from(kinds),
                  st.sampled_from(["lost", *_WIRE_ERRORS]), st.integers(0, 2)),
        st.tuples(st.just("oom"), st.sampled_from([0.05, 0.15])),
        st.tuples(st.just("wait"), st.sampled_from([0.02, 0.1])),
        *([st.tuples(st.just("destroy"))] if destroy else []),
    )
    return st.lists(step, min_size=2, max_size=8)


def _plan_for(n: int) -> str:
    return ("retry", "later", "ack")[n % 3]


def _first_outcome(todo: str) -> Outcome:
    return {"retry": RETRY, "later": retry_after(0.02)}.get(todo, ACK)


def _user_fields(flat: list[bytes]) -> list[bytes]:
    """The field list without the library's own header fields (``trf-...``)."""
    out: list[bytes] = []
    for f, v in zip(flat[::2], flat[1::2], strict=True):
        if not f.startswith(b"trf-"):
            out += [f, v]
    return out


async def _oom(admin: Any, period: float) -> None:
    await admin.execute("CONFIG", "SET", "maxmemory-policy", "noeviction")
    await admin.execute("CONFIG", "SET", "maxmemory", "1")
    try:
        await anyio.sleep(period)
    finally:
        await admin.execute("CONFIG", "SET", "maxmemory", "0")


async def _apply_fault(proxy: CommandProxy, step: tuple[Any, ...]) -> None:
    _, kind, what, at = step
    proxy.arm(kind, LOST if what == "lost" else error(what), at=at)


async def _history(server: RedisServer, steps: list[tuple[Any, ...]], form: str) -> list[str]:
    """Run one history; returns the problems found."""
    from trio_redis_finalize._transport import open_client

    problems: list[str] = []
    calls: dict[tuple[str, str], list[Outcome]] = {}  # (group, origin) -> outcomes returned
    produced: dict[str, tuple[str, list[bytes], int]] = {}  # origin -> (todo, fields, pushes)
    pending_at_destroy = 0
    serial = 0
    drained: list[str] = []  # what was left at the last look
    orphaned: set[str] = set()  # origins pending in gb when it was destroyed
    async with open_client(server.url) as admin:
        async with anyio.create_task_group() as tg:
            await admin.execute("FLUSHALL")
            await admin.execute("CONFIG", "SET", "maxmemory", "0")
            info = await admin.execute("INFO", "server")
            proxy = CommandProxy(server.port, flavour="valkey" if b"valkey" in info.lower() else "redis")
            await tg.start(proxy.serve)

            def handler(group: str) -> Callable[[Delivery], Awaitable[Outcome]]:
                async def handle(d: Delivery) -> Outcome:
                    seen = calls.setdefault((group, d.origin_id), [])
                    todo = produced.get(d.origin_id, ("ack", [], 1))[0]
                    pushes = produced.get(d.origin_id, ("ack", [], 1))[2]
                    if pushes > 1:
                        # identical elements (plan "retry"): the first call ACKs
                        # at once, the second, still running meanwhile, RETRYs late
                        if len(seen) == 1:
                            seen.append(RETRY)
                            await anyio.sleep(0.2)
                            return RETRY
                        out = ACK
                    else:
                        out = _first_outcome(todo) if not seen else ACK
                    seen.append(out)
                    return out
                return handle

            try:
                with anyio.fail_after(10):
                    async with open_consumer(proxy.url, name="h1", shutdown_grace=0.5) as consumer:
                        if form == "stream":
                            await admin.execute("XGROUP", "CREATE", H_STREAM, H_GA, "0", "MKSTREAM")
                            await admin.execute("XGROUP", "CREATE", H_STREAM, H_GB, "0")
                            for g in (H_GA, H_GB):
                                await consumer.mount(StreamSubscription(H_STREAM, g, block=0.05),
                                                     handler(g), concurrency=2)
                        else:
                            await consumer.mount(ReliableListSubscription(H_QUEUE, block=0.05),
                                                 handler("list"), concurrency=2)
                        for step in steps:
                            if step[0] == "produce":
                                _, n, odd = step
                                for _ in range(n):
                                    serial += 1
                                    todo = _plan_for(serial)
                                    if form == "stream":
                                        fields = ([b"item", b"a", b"item", b"b", b"n", str(serial).encode()]
                                                  if odd else [b"n", str(serial).encode()])
                                        eid = await admin.execute("XADD", H_STREAM, "*", *fields)
                                        produced[eid.decode()] = (todo, fields, 1)
                                    else:
                                        pushes = 2 if odd else 1
                                        todo = "retry" if odd else todo
                                        element = f"{todo}:{serial}".encode()
                                        produced[content_origin(element)] = (todo, [element], pushes)
                                        await admin.execute("LPUSH", H_QUEUE, *[element] * pushes)
                            elif step[0] == "fault":
                                await _apply_fault(proxy, step)
                            elif step[0] == "oom":
                                await _oom(admin, step[1])
                            elif step[0] == "wait":
                                await anyio.sleep(step[1])
                            elif step[0] == "destroy":
                                # what gb holds goes with its PEL: a RETRY of it finds
                                # the gate closed (the operator's doing, not a loss).
                                # The PEL is read in the destroy's own transaction: gb
                                # may read (into it) between two separate commands
                                orphaned.update(o for (g, o), outs in calls.items()
                                                if g == H_GB and ACK not in outs)
                                *_, (rows, _destroyed) = await admin.pipeline([
                                    ("MULTI",), ("XPENDING", H_STREAM, H_GB, "-", "+", 1000),
                                    ("XGROUP", "DESTROY", H_STREAM, H_GB), ("EXEC",),
                                ])
                                if isinstance(rows, rexc.ResponseError):  # destroyed already,
                                    rows = []                             # not yet recreated
                                for r in rows:
                                    got = await admin.execute("XRANGE", H_STREAM, r[0], r[0])
                                    head = _pairs(got[0][1]) if got else {}
                                    orphaned.add(_s(head.get(ORIGIN_FIELD, r[0])))
                                pending_at_destroy += len(rows) + 2  # + in the reader's hands
                        await anyio.sleep(0.1)
                        proxy.disarm()
                        await _drain(admin, form, consumer, drained)
            except TimeoutError:
                problems.append(f"HANG: the history did not drain within 10 s ({drained[-1:]})")
            except BaseException as e:
                problems.append(f"CRASH: {type(e).__name__}: {e}")
            fired = [f"{f.kind}#{f.k}={f.fault.label}" for f in proxy.fired]
            lost_replies = sum(1 for f in proxy.fired if f.fault.action == "lost")
            await proxy.cut_all()
            tg.cancel_scope.cancel()
        problems += await _judge_history(admin, form, produced, calls, lost_replies,
                                         pending_at_destroy, orphaned)
    return [f"{p} (faults fired: {fired or 'none'})" for p in problems]


async def _drain(admin: Any, form: str, consumer: Any, drained: list[str]) -> None:
    """Wait until the consumer is idle and Redis holds nothing unread or pending.

    A group of the history that ``XINFO GROUPS`` does not list is not drained:
    it was destroyed and its reader has not recreated it yet (it may be in a
    backoff after the recreation was refused, OOM ...); what the stream holds
    is still unread for it.  (Before, such a group was simply not looked at,
    the history ended early and its unread entries were judged lost.)
    """
    calm = 0
    while calm < 3:
        await anyio.sleep(0.03)
        sending = getattr(consumer.scheduler, "_sending", None)  # a batch out of the heap
        busy = (len(consumer.scheduler) or (sending is not None and sending.locked())
                or any(m.in_hand or m.stats.in_flight for m in consumer.mounts))
        if form == "stream":
            left = 0
            last = await admin.execute("XREVRANGE", H_STREAM, "+", "-", "COUNT", 1)
            seen: set[str] = set()
            for g in await admin.execute("XINFO", "GROUPS", H_STREAM):
                info = _pairs(g)
                seen.add(_s(info[b"name"]))
                left += int(info[b"pending"]) + (bool(last) and info[b"last-delivered-id"] != last[0][0])
            left += len({H_GA, H_GB} - seen)  # destroyed, not recreated yet
        else:
            left = int(await admin.execute("LLEN", H_QUEUE)) + int(
                await admin.execute("LLEN", "{hjobs}:processing:h1"))
        calm = 0 if (busy or left) else calm + 1
        drained[:] = [f"left: {left} unread/pending in Redis, consumer busy: {bool(busy)}"]


async def _judge_history(admin: Any, form: str, produced: dict[str, tuple[str, list[bytes], int]],
                         calls: dict[tuple[str, str], list[Outcome]], lost_replies: int,
                         pending_at_destroy: int, orphaned: set[str]) -> list[str]:
    problems: list[str] = []
    groups = (H_GA, H_GB) if form == "stream" else ("list",)
    extra: Counter[str] = Counter()
    for origin, (todo, fields, pushes) in produced.items():
        asked = (2 if todo != "ack" else 1) * pushes
        for g in groups:
            outs = calls.get((g, origin), [])
            acks = sum(1 for o in outs if o == ACK)
            if acks < pushes and not (g == H_GB and origin in orphaned):
                where = "still in Redis" if await _present(admin, form, origin, fields) else "LOST"
                if where == "LOST":
                    problems.append(f"LOST: {g}: message {origin} ({todo}, pushed {pushes}x) "
                                    f"finalized {acks} time(s): outcomes {outs}")
            extra[g] += max(0, len(outs) - asked)
    for g, n in extra.items():
        allowed = lost_replies + (pending_at_destroy if g == H_GB else 0)
        if n > allowed:
            problems.append(f"DUPLICATES: {g}: {n} handler calls more than asked for, "
                            f"{allowed} explained by faults")
    if form == "stream":
        for eid, flat in await admin.execute("XRANGE", H_STREAM, "-", "+"):
            header = _pairs(flat)
            origin = header.get(ORIGIN_FIELD)
            if origin is None or origin.decode() not in produced:
                continue
            want = produced[origin.decode()][1]
            if _user_fields(flat) != want:
                problems.append(f"FIELDS: copy {eid.decode()} of {origin.decode()} holds "
                                f"{_user_fields(flat)}, the original {want}")
    return problems


async def _present(admin: Any, form: str, origin: str, fields: list[bytes]) -> bool:
    if form == "stream":
        return False  # drained: nothing unread or pending is left
    return bool(await admin.execute("LPOS", H_QUEUE, fields[0])) or bool(
        await admin.execute("LPOS", "{hjobs}:processing:h1", fields[0]))


async def test_history_drain_waits_for_a_destroyed_group(redis_url: str) -> None:
    """The judge's premise (a drained stream holds nothing unread for any
    group) holds for a group that is gone too: the drain waits while a group
    of the history does not exist, and ends once it is back and has read all."""
    from trio_redis_finalize._transport import open_client

    async with open_client(redis_url) as admin, open_consumer(redis_url, name="idle") as consumer:
        eid = await admin.execute("XADD", H_STREAM, "*", "n", "1")
        await admin.execute("XGROUP", "CREATE", H_STREAM, H_GA, "$")  # ga has read all, gb is gone
        drained: list[str] = []
        with anyio.move_on_after(0.5) as waited:
            await _drain(admin, "stream", consumer, drained)
        assert waited.cancelled_caught, drained
        assert drained == ["left: 1 unread/pending in Redis, consumer busy: False"]
        await admin.execute("XGROUP", "CREATE", H_STREAM, H_GB, eid)
        with anyio.fail_after(2):
            await _drain(admin, "stream", consumer, drained)


@pytest.mark.timeout(3600 if LONG else 300)
@H_PROFILE
@given(steps=_steps(_STREAM_KINDS, destroy=True))
# the histories issue 12 reports, always run: a RETRY copy seen by the other
# group; copies of `item a item b`; a destroyed group; an OOM'd copy script
@example(steps=[("produce", 3, True), ("wait", 0.1)])
@example(steps=[("produce", 2, False), ("wait", 0.02), ("destroy",), ("produce", 2, False)])
@example(steps=[("destroy",), ("destroy",)])
@example(steps=[("fault", "EVALSHA:stream_copy_ack", "OOM", 0), ("produce", 3, False)])
@example(steps=[("fault", "EVALSHA:stream_copy_ack_batch", "lost", 0), ("produce", 3, True),
                ("wait", 0.1)])
# gb destroyed, its recreation refused (OOM) into a backoff that outlasted the
# history: the drain did not wait for it and judged its unread entry lost
@example(steps=[("destroy",), ("oom", 0.15), ("produce", 1, False),
                ("fault", "XGROUP CREATE", "OOM", 0)])
# gb reads entries (into the PEL the destroy takes) right between the history's
# look at its PEL and the XGROUP DESTROY: their RETRY finds the gate closed
@example(steps=[("destroy",), ("destroy",), ("produce", 3, False), ("destroy",)])
def test_stream_history_two_groups_repeated_fields_destroy_errors(
    redis_server: RedisServer, steps: list[tuple[Any, ...]]
) -> None:
    problems = trio.run(_history, redis_server, steps, "stream")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(3600 if LONG else 300)
@H_PROFILE
@given(steps=_steps(_LIST_KINDS, destroy=False))
# issue 12: the same element twice, the first LREM's reply lost; an OOM'd copy
@example(steps=[("fault", "LREM", "lost", 0), ("produce", 1, True), ("wait", 0.1)])
@example(steps=[("fault", "EVALSHA:list_copy_remove", "OOM", 0), ("produce", 1, True)])
def test_reliable_list_history_identical_elements_errors(
    redis_server: RedisServer, steps: list[tuple[Any, ...]]
) -> None:
    problems = trio.run(_history, redis_server, steps, "list")
    assert not problems, "\n".join(problems)
