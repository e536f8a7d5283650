"""``testing.check_exactly_once``: the crash-point enumeration, pointed at a user's handler.

One case is one life of a consumer (and, after a fault, the restarted one)
over the same messages.  The happy path runs first: it counts the
finalization commands its consumer sends (``K``) and records what the
handler's work leaves in Redis.  Then, for every ``k < K`` and every fault,
a case runs with the fault at the k-th finalization command:

* ``before``: the command never reaches Redis (a lost request), the
  consumer lives on and sends the finalization again;
* ``after``: the command is applied and its reply lost (an unknown
  outcome), the consumer lives on and sends it again;
* ``crash-before`` / ``crash-after``: the same, and the process dies there;
  a consumer with the same name takes over (it re-reads its own pending
  entries / processing list).

Each case ends when nothing is left to do (nothing pending, unread,
delayed or held).  Its result must equal the happy path's:

* the *user state* -- every key but the subscription's own (the source,
  its delay set, processing lists, heartbeats, registries and receipts) and
  the dead letter -- has the same types and values (stream entries compared
  by their fields, not their ids);
* the dead letter holds as many entries;
* every message was finalized (nothing left in the source, nothing lost).

A handler that writes outside ``Outcome.with_writes`` (its own client,
before returning) applies its write again when a crash makes the message
be handled again: the user state differs, and the report says where.

What is reported per message: the handler calls and the number of times
writes carried by its outcomes were committed (a probe ``HINCRBY`` added to
each outcome's writes, so it commits exactly when they do).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from ._consumer import open_consumer
from ._core._types import content_origin
from ._delivery import Delivery
from ._fault_client import Crash, FaultClient, FaultMode, open_fault_client
from ._forms.reliable_list import ReliableListSubscription
from ._forms.stream import StreamSubscription
from ._keys import derived
from ._outcome import Outcome, OutcomeKind
from ._subscription import DelayedRetry
from ._transport import Client, open_client

__all__ = ["FAULTS", "CaseReport", "ExactlyOnceError", "ExactlyOnceReport", "MessageReport",
           "check_arguments", "prove"]

FAULTS = ("before", "after", "crash-before", "crash-after")
"""The faults every finalization command is put through."""

_NAME = "trf-proof"
_LIBRARY_WORDS = (":delayed", ":processing", ":consumers", ":heartbeat", ":receipt", ":copy",
                  ":trf", ":proof")
"""The subscription's own keys: ``derived(source, word)`` prefixes."""

Handler = Callable[[Delivery], Awaitable[Outcome]]
Message = Mapping[str | bytes, str | bytes | int | float] | str | bytes


class ExactlyOnceError(AssertionError):
    """A case left Redis otherwise than the happy path: a write committed
    twice (or not at all), a message lost.  ``report`` has every case."""

    def __init__(self, message: str, report: ExactlyOnceReport) -> None:
        super().__init__(message)
        self.report = report


@dataclasses.dataclass(frozen=True)
class MessageReport:
    """One message in one case."""

    index: int
    """Its position in ``messages`` (identical list elements share the first's)."""
    calls: int
    """How many times the handler was called with it (or a copy of it)."""
    committed: int
    """How many times writes its outcomes carried were committed."""


@dataclasses.dataclass(frozen=True)
class CaseReport:
    """One case: the happy path or one fault at one finalization command."""

    label: str
    messages: tuple[MessageReport, ...]
    state: Mapping[str, Any]
    """The user state it left (key -> ``(type, value)``)."""
    dead_letters: int
    left: int
    """Messages still in the source when it settled (0 unless one is stranded)."""
    crashed: bool = False
    held: bool = False
    """A ``retry_after`` copy was held in process memory (``DelayedRetry.RUNTIME``)."""
    problems: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ExactlyOnceReport:
    """Every case of a :func:`check_exactly_once` run, the happy path first."""

    cases: tuple[CaseReport, ...]

    @property
    def ok(self) -> bool:
        return not any(c.problems for c in self.cases)

    @property
    def failed(self) -> tuple[CaseReport, ...]:
        return tuple(c for c in self.cases if c.problems)

    def __str__(self) -> str:
        lines = [f"{len(self.cases)} cases, {len(self.failed)} failed"]
        for case in self.failed:
            lines.append(f"  {case.label}:")
            lines += [f"    {p}" for p in case.problems]
        return "\n".join(lines)


def _library_prefixes(source: str) -> tuple[str, ...]:
    return tuple(derived(source, word) for word in _LIBRARY_WORDS)


def _probe_key(source: str) -> str:
    return derived(source, ":proof")


@dataclasses.dataclass
class _Case:
    label: str
    index_of: dict[str, int]  # origin -> message index
    calls: dict[int, int] = dataclasses.field(default_factory=dict)
    crashed: bool = False
    delayed: bool = False  # a handler returned retry_after


class _Form:
    """What the check needs of a subscription's form."""

    def __init__(self, subscription: StreamSubscription | ReliableListSubscription) -> None:
        self.sub = subscription
        if isinstance(subscription, StreamSubscription):
            self.stream = True
            self.source = subscription.stream
            self.delay_key = subscription.delay_key or derived(self.source, ":delayed")
        else:
            self.stream = False
            self.source = subscription.queue
            self.delay_key = subscription.delay_key or derived(self.source, ":delayed")
        self.dead_letter = subscription.dead_letter
        self.runtime = subscription.delayed_retry in (None, DelayedRetry.RUNTIME)

    async def produce(self, client: Client, messages: Sequence[Message]) -> dict[str, int]:
        """Write the messages; returns origin -> message index."""
        index_of: dict[str, int] = {}
        if self.stream:
            assert isinstance(self.sub, StreamSubscription)
            await client.execute("XGROUP", "CREATE", self.source, self.sub.group, "0", "MKSTREAM")
            for i, message in enumerate(messages):
                if not isinstance(message, Mapping):
                    raise ValueError(f"messages[{i}]: a stream message is a mapping of fields")
                flat = [v for kv in message.items() for v in kv]
                entry = await client.execute("XADD", self.source, "*", *flat)
                index_of[entry.decode()] = i
            return index_of
        for i, message in enumerate(messages):
            if isinstance(message, Mapping):
                raise ValueError(f"messages[{i}]: a list message is bytes or str")
            data = message.encode() if isinstance(message, str) else bytes(message)
            index_of.setdefault(content_origin(data), i)
            await client.execute("LPUSH", self.source, data)
        return index_of

    async def settled(self, client: Client, consumer: Any) -> bool:
        """Nothing left to do: nothing pending, unread, delayed or held."""
        if len(consumer.scheduler) or any(m.in_hand or m.stats.in_flight for m in consumer.mounts):
            return False
        if int(await client.execute("ZCARD", self.delay_key)):
            return False
        if self.stream:
            assert isinstance(self.sub, StreamSubscription)
            if int((await client.execute("XPENDING", self.source, self.sub.group))[0]):
                return False
            last = await client.execute("XREVRANGE", self.source, "+", "-", "COUNT", 1)
            groups = {g[1]: g[7] for g in await client.execute("XINFO", "GROUPS", self.source)}
            return not last or groups.get(self.sub.group.encode()) == last[0][0]
        assert isinstance(self.sub, ReliableListSubscription)
        lens = await client.pipeline([("LLEN", self.source),
                                      ("LLEN", self.sub.processing_key(_NAME))])
        return not any(lens)

    async def left(self, client: Client) -> int:
        if self.stream:
            assert isinstance(self.sub, StreamSubscription)
            return int((await client.execute("XPENDING", self.source, self.sub.group))[0])
        assert isinstance(self.sub, ReliableListSubscription)
        lens = await client.pipeline([("LLEN", self.source),
                                      ("LLEN", self.sub.processing_key(_NAME))])
        return sum(int(n) for n in lens)

    def origin(self, d: Delivery) -> str:
        return d.origin_id if self.stream else (d.origin_id or content_origin(d.data or b""))


async def _value(client: Client, key: bytes, kind: str) -> Any:
    if kind == "string":
        return await client.execute("GET", key)
    if kind == "hash":
        flat = await client.execute("HGETALL", key)
        return dict(sorted(zip(flat[::2], flat[1::2], strict=True)))
    if kind == "list":
        return await client.execute("LRANGE", key, 0, -1)
    if kind == "set":
        return sorted(await client.execute("SMEMBERS", key))
    if kind == "zset":
        flat = await client.execute("ZRANGE", key, 0, -1, "WITHSCORES")
        return list(zip(flat[::2], flat[1::2], strict=True))
    if kind == "stream":  # entry ids differ from run to run: the fields, in order
        return [fields for _, fields in await client.execute("XRANGE", key, "-", "+")]
    return await client.execute("DUMP", key)


async def _user_state(client: Client, form: _Form) -> dict[str, Any]:
    prefixes = _library_prefixes(form.source)
    skip = {form.source, form.dead_letter}
    state: dict[str, Any] = {}
    cursor = b"0"
    keys: list[bytes] = []
    while True:
        cursor, batch = await client.execute("SCAN", cursor, "COUNT", 1000)
        keys += batch
        if cursor in (b"0", 0, "0"):
            break
    for key in sorted(set(keys)):
        name = key.decode(errors="backslashreplace")
        if name in skip or name.startswith(prefixes):
            continue
        kind = (await client.execute("TYPE", key)).decode()
        state[name] = (kind, await _value(client, key, kind))
    return state


async def _dead_letters(client: Client, form: _Form) -> int:
    if form.dead_letter is None:
        return 0
    kind = (await client.execute("TYPE", form.dead_letter)).decode()
    if kind == "stream":
        return int(await client.execute("XLEN", form.dead_letter))
    if kind == "list":
        return int(await client.execute("LLEN", form.dead_letter))
    return 0


def _not_collateral(e: BaseException) -> bool:
    collateral = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.get_cancelled_exc_class())
    return not isinstance(e, (BaseExceptionGroup, *collateral))


async def _life(client: FaultClient, form: _Form, handler: Handler, case: _Case,
                budget: float) -> None:
    """One consumer life: until settled twice in a row, or until it crashed."""
    try:
        async with open_consumer(client, name=_NAME, shutdown_grace=0.0) as consumer:
            await consumer.mount(form.sub, handler)
            calm = 0
            with anyio.fail_after(budget):
                while calm < 2:
                    await anyio.sleep(0.02)
                    calm = calm + 1 if await form.settled(client, consumer) else 0
    except BaseExceptionGroup as eg:
        crash, rest = eg.split(Crash)
        if crash is None:
            if eg.subgroup(TimeoutError) is not None:
                raise TimeoutError(f"{case.label}: the consumer did not settle within {budget} s "
                                   "(a message still pending, delayed or held)") from eg
            raise
        case.crashed = True
        if rest is not None and rest.subgroup(_not_collateral) is not None:
            raise


def _wrap(handler: Handler, form: _Form, case: _Case) -> Handler:
    probe = _probe_key(form.source)

    async def handle(d: Delivery) -> Outcome:
        index = case.index_of.get(form.origin(d), -1)
        case.calls[index] = case.calls.get(index, 0) + 1
        outcome = await handler(d)
        case.delayed |= outcome.kind is OutcomeKind.RETRY_AFTER
        if outcome.writes:
            outcome = outcome.with_writes(("HINCRBY", probe, str(index), 1))
        return outcome

    return handle


async def _run_case(url: str, form: _Form, handler: Handler, messages: Sequence[Message],
                    label: str, fault: str | None, k: int, budget: float) -> tuple[CaseReport, int]:
    async with open_client(url) as admin:
        await admin.execute("FLUSHDB")
        case = _Case(label, await form.produce(admin, messages))
        wrapped = _wrap(handler, form, case)
        async with open_fault_client(url, name=_NAME) as client:
            if fault is not None:
                mode = FaultMode.AFTER if fault.endswith("after") else FaultMode.BEFORE
                client.arm(k, mode, crash=fault.startswith("crash"))
            await _life(client, form, wrapped, case, budget)
            sent = len(client.sent)
            if client.fired is not None:
                case.label = f"{label} ({_describe(client.fired)})"
        if case.crashed:  # the restarted process, same consumer name
            async with open_fault_client(url, name=_NAME) as client:
                await _life(client, form, wrapped, case, budget)
        flat = await admin.execute("HGETALL", _probe_key(form.source))
        committed = {int(i): int(n) for i, n in zip(flat[::2], flat[1::2], strict=True)}
        indices = sorted(set(case.index_of.values()))
        report = CaseReport(
            label=case.label,
            messages=tuple(MessageReport(i, case.calls.get(i, 0), committed.get(i, 0))
                           for i in indices),
            state=await _user_state(admin, form),
            dead_letters=await _dead_letters(admin, form),
            left=await form.left(admin),
            crashed=case.crashed,
            held=case.delayed and form.runtime,
        )
        return report, sent


def _describe(cmd: Sequence[object]) -> str:
    words = [w.decode(errors="backslashreplace") if isinstance(w, bytes) else str(w) for w in cmd[:4]]
    return " ".join(words) + (" ..." if len(cmd) > 4 else "")


def _diff(happy: CaseReport, case: CaseReport) -> tuple[str, ...]:
    problems: list[str] = []
    for key in sorted(happy.state.keys() | case.state.keys()):
        want, got = happy.state.get(key), case.state.get(key)
        if want != got:
            problems.append(f"key {key!r}: happy path {_show(want)}, here {_show(got)}")
    if case.dead_letters != happy.dead_letters:
        problems.append(f"dead letters: happy path {happy.dead_letters}, here {case.dead_letters}")
    if case.left:
        problems.append(f"{case.left} message(s) left in the source, never finalized")
    if problems:  # what the messages saw, to read the difference by
        for want, got in zip(happy.messages, case.messages, strict=True):
            if (want.calls, want.committed) != (got.calls, got.committed):
                problems.append(f"message {got.index}: handler calls {got.calls} (happy path "
                                f"{want.calls}), writes committed {got.committed} (happy path "
                                f"{want.committed})")
        if case.crashed and case.held:
            problems.append("(a runtime retry_after keeps its copy in process memory: a crash before "
                            "its delay loses it; DelayedRetry.DURABLE_ZSET keeps it in Redis)")
    return tuple(problems)


def _show(value: Any) -> str:
    if value is None:
        return "absent"
    kind, data = value
    return f"{kind} {data!r}"


def check_arguments(subscription: object, messages: Sequence[Message], faults: Sequence[str],
                    timeout: float) -> None:
    """``check_exactly_once``'s refusals (see there)."""
    if not isinstance(subscription, StreamSubscription | ReliableListSubscription):
        raise ValueError("subscription must be a StreamSubscription or a ReliableListSubscription "
                         f"(got {type(subscription).__name__}: it finalizes nothing to prove)")
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"faults: unknown {unknown!r} (known: {', '.join(FAULTS)})")
    if not messages:
        raise ValueError("messages must not be empty")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


async def prove(url: str, handler: Handler, messages: Sequence[Message], *,
                subscription: StreamSubscription | ReliableListSubscription,
                faults: Sequence[str], timeout: float) -> ExactlyOnceReport:
    """``check_exactly_once`` on the server at ``url`` (checked arguments)."""
    form = _Form(dataclasses.replace(subscription, block=min(subscription.block, 0.05)))
    return await _check(url, form, handler, messages, faults, timeout)


async def _check(url: str, form: _Form, handler: Handler, messages: Sequence[Message],
                 faults: Sequence[str], timeout: float) -> ExactlyOnceReport:
    happy, steps = await _run_case(url, form, handler, messages, "happy path", None, 0, timeout)
    if happy.left:
        raise ExactlyOnceError(f"happy path: {happy.left} message(s) never finalized",
                               ExactlyOnceReport((happy,)))
    cases = [happy]
    for fault in faults:
        for k in range(steps):
            label = f"{fault} finalization command #{k}"
            case, _ = await _run_case(url, form, handler, messages, label, fault, k, timeout)
            cases.append(dataclasses.replace(case, problems=_diff(happy, case)))
    report = ExactlyOnceReport(tuple(cases))
    if not report.ok:
        raise ExactlyOnceError(f"exactly once does not hold: {report}", report)
    return report
