"""The sans-IO planner against the table of DESIGN §1 and §4 (no Redis).

Every cell form x outcome x attempt x max_attempts x dead letter x cluster
is drawn by Hypothesis and checked against an independent rendering of the
table: command names, keys and order, the effect, the copies' headers, the
gated flag and the dead-letter / exhaustion rules.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_redis_finalize import (
    ACK,
    DROP,
    ORIGIN_FIELD,
    REJECT,
    RETRIES_FIELD,
    RETRY,
    AckError,
    AckUnsupported,
    ChannelSubscription,
    DelayedRetry,
    Delivery,
    ListSubscription,
    Mode,
    Outcome,
    PatternSubscription,
    Rejected,
    ReliableListSubscription,
    StreamSubscription,
    reject,
    retry_after,
)
from trio_redis_finalize._core import _lua
from trio_redis_finalize._core._plan import RECEIPT_SUFFIX, plan, plan_dead, plan_foreign, plan_lost, why_key
from trio_redis_finalize._core._types import (
    DEAD_ATTEMPT,
    DEAD_GROUP,
    DEAD_ID,
    DEAD_REASON,
    DEAD_SOURCE,
    DEAD_TIME,
    RECEIPTED,
    Effect,
    Plan,
    Target,
    attempt_of,
    content_origin,
)
from trio_redis_finalize._core._writes import plan_writes
from trio_redis_finalize._core.reliable_list import scripts as list_scripts
from trio_redis_finalize._core.stream import scripts as stream_scripts
from trio_redis_finalize._envelope import GROUP_FIELD, unpack_parts, unwrap, wrap
from trio_redis_finalize._keys import same_slot
from trio_redis_finalize._outcome import OutcomeKind
from trio_redis_finalize._subscription import Form, Retention

SETTINGS = settings(max_examples=400, deadline=None)

STREAM = "orders"
GROUP = "billing"
QUEUE = "jobs"
LIST = "inbox"
CHANNELS = ("news", "alerts")
PATTERN = "news.*"
RETRY_CHANNEL = "news.retry"
CONSUMER = "c1"
DEAD_SAME = {STREAM: "{orders}:dead", QUEUE: "{jobs}:dead"}
DEAD_OTHER = {STREAM: "dead-orders", QUEUE: "dead-jobs"}


def test_dead_letter_fixtures_are_what_they_claim() -> None:
    for src in (STREAM, QUEUE):
        assert same_slot(src, DEAD_SAME[src])
        assert not same_slot(src, DEAD_OTHER[src])


# -- forms -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Form_:
    kind: str  # stream, rlist, list, channel, pattern
    mode: Mode | None = None
    delayed: DelayedRetry | None = None
    retry_channel: str | None = None

    def __repr__(self) -> str:
        return f"{self.kind}({self.mode}, {self.delayed}, {self.retry_channel})"


FORMS = [
    *(Form_("stream", m, dr) for m in Mode for dr in (None, *DelayedRetry)),
    *(Form_("rlist", None, dr) for dr in (None, *DelayedRetry)),
    Form_("list"),
    Form_("channel"),
    Form_("pattern"),
    Form_("pattern", retry_channel=RETRY_CHANNEL),
]


def make_target(
    f: Form_, max_attempts: int | None, dead: str | None, cluster: bool
) -> Target:
    if f.kind == "stream":
        return StreamSubscription(
            STREAM, GROUP, mode=f.mode or Mode.PLAIN, delayed_retry=f.delayed,
            max_attempts=max_attempts, dead_letter=dead,
        ).target(CONSUMER, cluster=cluster)
    if f.kind == "rlist":
        return ReliableListSubscription(
            QUEUE, delayed_retry=f.delayed, max_attempts=max_attempts, dead_letter=dead,
        ).target(CONSUMER, cluster=cluster)
    if f.kind == "list":
        return ListSubscription(LIST, max_attempts=max_attempts).target(CONSUMER, cluster=cluster)
    if f.kind == "channel":
        return ChannelSubscription(*CHANNELS, max_attempts=max_attempts).target(
            CONSUMER, cluster=cluster)
    return PatternSubscription(
        PATTERN, retry_channel=f.retry_channel, max_attempts=max_attempts
    ).target(CONSUMER, cluster=cluster)


def make_delivery(
    f: Form_, *, attempt: int, retries: int, fields: Mapping[bytes, bytes], body: bytes,
    entry_id: str = "1700000000000-7", field_list: Sequence[tuple[bytes, bytes]] | None = None,
) -> Delivery:
    """A delivery; a stream's ``field_list`` (repeated names) makes its ``fields``."""
    if f.kind == "stream":
        origin = "1600000000000-0" if retries else entry_id
        if field_list is not None:
            return Delivery(source=STREAM, id=entry_id, fields=dict(field_list), data=None,
                            attempt=attempt, origin_id=origin, retries=retries, mount="m",
                            flat=[x for kv in field_list for x in kv])
        return Delivery(source=STREAM, id=entry_id, fields=dict(fields), data=None,
                        attempt=attempt, origin_id=origin, retries=retries, mount="m")
    origin = content_origin(body) if not retries else "1-1"
    raw = wrap(body, retries, origin) if retries else body
    source = {"rlist": QUEUE, "list": LIST, "channel": CHANNELS[1], "pattern": "news.sport"}[f.kind]
    return Delivery(source=source, id=None, fields={}, data=body, attempt=attempt,
                    origin_id=origin, raw=raw, retries=retries, mount="m")


# -- helpers to read plans ---------------------------------------------------------

def evalsha(cmd: Sequence[Any]) -> tuple[bytes, list[Any], list[Any]]:
    """(sha, keys, args) of an EVALSHA command."""
    assert cmd[0] == b"EVALSHA"
    n = int(cmd[2])
    return cmd[1], list(cmd[3 : 3 + n]), list(cmd[3 + n :])


def pairs(flat: Sequence[Any]) -> list[tuple[Any, Any]]:
    assert len(flat) % 2 == 0
    return list(zip(flat[::2], flat[1::2], strict=True))


def shape(p: Plan) -> list[tuple[Any, ...]]:
    """Command names and keys: ("XACK", key) / ("EVALSHA", script name, keys...)."""
    out: list[tuple[Any, ...]] = []
    for c in p.commands:
        if c[0] == b"EVALSHA":
            _, keys, _ = evalsha(c)
            out.append(("EVALSHA", SCRIPT_NAMES[c[1]], *keys))
        else:
            out.append((c[0], c[1]))
    return out


SCRIPT_NAMES: dict[Any, str] = {
    s.sha: s.name for s in (
        stream_scripts.STREAM_COPY_ACK, stream_scripts.STREAM_ZADD_ACK, list_scripts.LIST_COPY_REMOVE,
        list_scripts.LIST_DEAD_PUSH, list_scripts.LIST_ZADD_REMOVE, stream_scripts.MOVE_DUE_TO_STREAM,
        list_scripts.MOVE_DUE_TO_LIST, stream_scripts.STREAM_XADD, stream_scripts.STREAM_REMOVE_RECEIPT,
    )
}


def own_fields(d: Delivery) -> list[bytes]:
    """The entry's field list as read, flat (repeated names included)."""
    return [x for kv in d.field_list for x in kv]


def check_stream_copy(fields_flat: Sequence[Any], d: Delivery, retries: int) -> None:
    """A stream copy: the entry's field list byte for byte, then the three
    headers (the copy is addressed to the group that wrote it)."""
    own = own_fields(d)
    n = len(own)
    assert list(fields_flat[:n]) == own
    assert pairs(fields_flat[n:]) == [
        (RETRIES_FIELD, str(retries).encode()), (ORIGIN_FIELD, d.origin_id.encode()),
        (GROUP_FIELD, GROUP.encode()),
    ]


def check_list_copy(element: Any, d: Delivery, retries: int) -> None:
    assert unwrap(element) == (d.data, retries, d.origin_id)


def check_member(member: bytes) -> list[bytes]:
    parts = unpack_parts(member)
    assert len(parts[0]) == 16  # unique id
    return parts[1:]


def ms(delay: float) -> int:
    return round(delay * 1000)


# -- the table ----------------------------------------------------------------------

OUTCOMES = st.one_of(
    st.sampled_from([ACK, RETRY, DROP]),
    st.floats(0, 3600, allow_nan=False).map(retry_after),
)


@st.composite
def cells(draw: st.DrawFn) -> dict[str, Any]:
    f = draw(st.sampled_from(FORMS))
    outcome = draw(OUTCOMES)
    attempt = draw(st.integers(1, 10))
    # header retries: attempt - 1 for header-counted forms; reclaim/claiming may
    # carry a server delivery count higher than the header says
    if f.kind == "stream" and f.mode is not Mode.PLAIN:
        retries = draw(st.integers(0, attempt - 1))
    else:
        retries = attempt - 1
    max_attempts = draw(st.one_of(st.none(), st.integers(1, 5)))
    dead = None
    if max_attempts is not None and f.kind in ("stream", "rlist"):
        src = STREAM if f.kind == "stream" else QUEUE
        dead = draw(st.sampled_from([None, DEAD_SAME[src], DEAD_OTHER[src]]))
    cluster = draw(st.booleans())
    # a field list: names may repeat (a few short names make repeats likely)
    names = st.one_of(st.sampled_from([b"a", b"b", b""]), st.binary(max_size=8)).filter(
        lambda k: k not in (RETRIES_FIELD, ORIGIN_FIELD, GROUP_FIELD))
    field_list = draw(st.lists(st.tuples(names, st.binary(max_size=16)), max_size=6))
    if f.kind == "stream" and not field_list:
        field_list = [(b"k", b"v")]
    body = draw(st.binary(max_size=32))
    return dict(f=f, outcome=outcome, attempt=attempt, retries=retries,
                max_attempts=max_attempts, dead=dead, cluster=cluster,
                fields=dict(field_list), field_list=field_list, body=body)


@SETTINGS
@given(cells())
def test_table(cell: dict[str, Any]) -> None:
    f: Form_ = cell["f"]
    outcome: Outcome = cell["outcome"]
    t = make_target(f, cell["max_attempts"], cell["dead"], cell["cluster"])
    d = make_delivery(f, attempt=cell["attempt"], retries=cell["retries"], fields=cell["fields"],
                      body=cell["body"], field_list=cell["field_list"])
    check_cell(f, t, d, outcome)


def check_cell(f: Form_, t: Target, d: Delivery, outcome: Outcome) -> None:
    kind = outcome.kind
    no_ack = f.kind in ("list", "channel", "pattern")
    # 1. refusals
    if no_ack and kind is not OutcomeKind.RETRY_AFTER:
        with pytest.raises(AckUnsupported) as info:
            plan(t, d, outcome)
        assert isinstance(info.value, AckError)
        return
    if f.kind == "pattern" and f.retry_channel is None:
        with pytest.raises(AckUnsupported, match="retry_channel"):
            plan(t, d, outcome)
        return

    p = plan(t, d, outcome)
    next_retries = max(d.retries + 1, d.attempt)

    # 2. exhaustion
    if outcome.is_retry and t.max_attempts is not None and d.attempt >= t.max_attempts:
        check_dead(f, t, d, p)
        return
    if p.effect in (Effect.DEAD_LETTERED, Effect.EXHAUSTED):
        pytest.fail(f"not exhausted, yet {p}")

    # 3. the table
    if p.effect is not Effect.HELD:
        assert p.delay is None and p.later == ()
    assert p.warning is None
    if f.kind == "stream":
        if kind is OutcomeKind.ACK or kind is OutcomeKind.DROP:
            assert p.effect is (Effect.ACKED if kind is OutcomeKind.ACK else Effect.DROPPED)
            assert p.commands == (("XACK", STREAM, GROUP, d.id),)
            assert p.gated
            return
        if kind is OutcomeKind.RETRY:
            if f.mode is Mode.CLAIMING:
                assert p == Plan(Effect.LEFT_PENDING)
                return
            assert p.effect is Effect.COPIED and p.gated
            assert shape(p) == [("EVALSHA", "stream_copy_ack", STREAM, STREAM)]
            _, _, args = evalsha(p.commands[0])
            assert args[:2] == [GROUP, d.id]
            check_stream_copy(args[2:], d, next_retries)
            return
        way = f.delayed if f.delayed is not None else (
            None if f.mode is Mode.CLAIMING else DelayedRetry.RUNTIME)
        if way is None:
            assert p == Plan(Effect.LEFT_PENDING)
        elif way is DelayedRetry.DURABLE_ZSET:
            assert p.effect is Effect.DELAYED and p.gated
            assert shape(p) == [("EVALSHA", "stream_zadd_ack", STREAM, "{orders}:delayed")]
            _, _, args = evalsha(p.commands[0])
            assert args[:3] == [GROUP, d.id, ms(outcome.delay)]
            check_stream_copy(check_member(args[3]), d, next_retries)
        else:
            assert p.effect is Effect.HELD
            # the removal: gated, leaving this finalization's receipt (a key of
            # its own, in the stream's slot), never the bare XACK
            (removal,) = p.commands
            sha, keys, args = evalsha(removal)
            assert sha == stream_scripts.STREAM_REMOVE_RECEIPT.sha and keys[0] == STREAM
            receipt = keys[1]
            assert receipt.startswith("{orders}:receipt:") and same_slot(STREAM, receipt)
            assert args == [GROUP, d.id, "0", 0]  # XACK, no writes
            assert p.delay == outcome.delay
            # the later copy: written once, only while the same receipt is there
            (later,) = p.later
            sha, keys, args = evalsha(later)
            assert sha == stream_scripts.STREAM_COPY_ONCE.sha and keys == [STREAM, receipt]
            assert args[:2] == [stream_scripts.COPY_MARK_TTL, 0]
            check_stream_copy(args[2:], d, next_retries)
            assert p.gated  # safe to send again: the receipt answers a resend
        return

    if f.kind == "rlist":
        processing = "{jobs}:processing:c1"
        assert t.processing == processing
        if kind is OutcomeKind.ACK or kind is OutcomeKind.DROP:
            assert p.effect is (Effect.ACKED if kind is OutcomeKind.ACK else Effect.DROPPED)
            assert p.commands == (("LREM", processing, -1, d.raw),)
            assert p.gated
            return
        if kind is OutcomeKind.RETRY:
            assert p.effect is Effect.COPIED and p.gated
            assert shape(p) == [("EVALSHA", "list_copy_remove", processing, QUEUE)]
            _, _, args = evalsha(p.commands[0])
            assert args[0] == d.raw
            check_list_copy(args[1], d, next_retries)
            return
        if f.delayed is DelayedRetry.DURABLE_ZSET:
            assert p.effect is Effect.DELAYED and p.gated
            assert shape(p) == [("EVALSHA", "list_zadd_remove", processing, "{jobs}:delayed")]
            _, _, args = evalsha(p.commands[0])
            assert args[:2] == [d.raw, ms(outcome.delay)]
            (element,) = check_member(args[2])
            check_list_copy(element, d, next_retries)
            return
        # runtime: the original stays in the processing list until the copy is pushed
        assert p.effect is Effect.HELD and p.commands == () and p.delay == outcome.delay
        assert p.gated
        assert shape(dataclasses.replace(p, commands=p.later)) == [
            ("EVALSHA", "list_copy_remove", processing, QUEUE)]
        _, _, args = evalsha(p.later[0])
        assert args[0] == d.raw
        check_list_copy(args[1], d, next_retries)
        return

    # no-ack forms: retry_after is a runtime copy to the list / channel
    assert kind is OutcomeKind.RETRY_AFTER
    assert p.effect is Effect.HELD and p.commands == () and p.delay == outcome.delay
    assert not p.gated
    dest = {"list": ("LPUSH", LIST), "channel": ("PUBLISH", d.source),
            "pattern": ("PUBLISH", RETRY_CHANNEL)}[f.kind]
    assert len(p.later) == 1 and tuple(p.later[0][:2]) == dest
    check_list_copy(p.later[0][2], d, next_retries)


def check_dead(f: Form_, t: Target, d: Delivery, p: Plan) -> None:
    assert p.warning is not None and t.name in p.warning
    assert p.delay is None and p.later == ()
    if f.kind not in ("stream", "rlist"):
        assert p == Plan(Effect.EXHAUSTED, (), warning=p.warning)
        return
    if t.dead_letter is None:
        assert p.effect is Effect.EXHAUSTED and p.gated
        if f.kind == "stream":
            assert p.commands == (("XACK", STREAM, GROUP, d.id),)
        else:
            assert p.commands == (("LREM", t.processing, -1, d.raw),)
        return
    assert p.effect is Effect.DEAD_LETTERED
    src = t.source if f.kind == "stream" else t.processing
    split = t.cluster and not same_slot(src, t.dead_letter)
    if f.kind == "stream":
        if split:  # two commands, copy first
            assert not p.gated
            # the copy: a plain XADD, as a script for the server's time of trf-dead-time
            assert shape(p) == [("EVALSHA", "stream_xadd", t.dead_letter), ("XACK", STREAM)]
            _, _, args = evalsha(p.commands[0])
            assert args[0] == 0  # no cap
            copy_fields = args[1:]
            assert p.commands[1] == ("XACK", STREAM, GROUP, d.id)
        else:
            assert p.gated
            assert shape(p) == [("EVALSHA", "stream_copy_ack", STREAM, t.dead_letter)]
            _, _, args = evalsha(p.commands[0])
            assert args[:2] == [GROUP, d.id]
            copy_fields = args[2:]
        own = own_fields(d)
        n = len(own)
        assert copy_fields[:n] == own
        headers = dict(pairs(copy_fields[n:]))
        assert GROUP_FIELD not in headers  # the dead letter is read by other groups
        assert headers[RETRIES_FIELD] == str(d.retries).encode()
        assert headers[ORIGIN_FIELD] == d.origin_id.encode()
        assert b"max_attempts" in headers[DEAD_REASON]
        assert headers[DEAD_SOURCE] == STREAM.encode()
        assert headers[DEAD_ID] == str(d.id).encode()
        assert headers[DEAD_GROUP] == GROUP.encode()
        assert headers[DEAD_ATTEMPT] == str(d.attempt).encode()
        # last: when, the server's clock (the script writes it in place of the marker)
        assert copy_fields[-2:] == [DEAD_TIME, _lua.SERVER_TIME]
        return
    why = why_key(t.dead_letter)
    if split:  # the copy with its reason record, then the removal
        assert not p.gated
        assert shape(p) == [("EVALSHA", "list_dead_push", t.dead_letter, why),
                            ("LREM", t.processing)]
        _, _, args = evalsha(p.commands[0])
        assert p.commands[1] == ("LREM", t.processing, -1, d.raw)
    else:
        assert p.gated
        assert shape(p) == [("EVALSHA", "list_copy_remove", t.processing, t.dead_letter, why)]
        _, _, args = evalsha(p.commands[0])
        assert args[0] == d.raw
        args = args[1:]
    assert args[0] == d.raw  # the element as read
    record = json.loads(args[1])
    assert "max_attempts" in record["reason"] and record["attempt"] == d.attempt
    assert record["source"] == t.source and record["processing"] == t.processing
    assert record["origin"] == d.origin_id


# -- every cell at least once, deterministically --------------------------------------

ALL_OUTCOMES = [ACK, RETRY, DROP, retry_after(2.5)]


@pytest.mark.parametrize("f", FORMS, ids=repr)
@pytest.mark.parametrize("outcome", ALL_OUTCOMES, ids=repr)
@pytest.mark.parametrize("limit", ["none", "left", "exhausted-dead-same", "exhausted-dead-other",
                                   "exhausted-no-dead"])
@pytest.mark.parametrize("cluster", [False, True])
def test_every_cell(f: Form_, outcome: Outcome, limit: str, cluster: bool) -> None:
    src = STREAM if f.kind == "stream" else QUEUE
    max_attempts = {"none": None, "left": 3}.get(limit, 2)
    dead = None
    if f.kind in ("stream", "rlist"):
        dead = {"exhausted-dead-same": DEAD_SAME[src], "exhausted-dead-other": DEAD_OTHER[src]}.get(
            limit)
    t = make_target(f, max_attempts, dead, cluster)
    d = make_delivery(f, attempt=2, retries=1, fields={b"a": b"1", b"b\x00": b"\xff"}, body=b"x")
    check_cell(f, t, d, outcome)
    # the same with a field list that repeats a name
    d = make_delivery(f, attempt=2, retries=1, fields={}, body=b"x",
                      field_list=[(b"a", b"1"), (b"b\x00", b"\xff"), (b"a", b"2")])
    check_cell(f, t, d, outcome)


def test_cross_slot_dead_letter_is_copy_then_remove() -> None:
    t = StreamSubscription(STREAM, GROUP, max_attempts=1, dead_letter="dead").target(
        CONSUMER, cluster=True)
    d = make_delivery(FORMS[0], attempt=1, retries=0, fields={b"f": b"v"}, body=b"")
    p = plan(t, d, RETRY)
    assert shape(p) == [("EVALSHA", "stream_xadd", "dead"), ("XACK", STREAM)]  # a plain XADD
    assert p.effect is Effect.DEAD_LETTERED and not p.gated
    # same keys on one node (no cluster): the gated script
    p = plan(dataclasses.replace(t, cluster=False), d, RETRY)
    assert shape(p) == [("EVALSHA", "stream_copy_ack", STREAM, "dead")] and p.gated


def test_claiming_retry_after_with_durable_zset() -> None:
    t = StreamSubscription(STREAM, GROUP, mode=Mode.CLAIMING,
                           delayed_retry=DelayedRetry.DURABLE_ZSET).target(CONSUMER)
    d = make_delivery(FORMS[0], attempt=3, retries=0, fields={b"f": b"v"}, body=b"")
    p = plan(t, d, retry_after(120))
    assert p.effect is Effect.DELAYED
    assert shape(p) == [("EVALSHA", "stream_zadd_ack", STREAM, "{orders}:delayed")]
    # the copy counts from the attempt (server delivery count), not the header
    member = evalsha(p.commands[0])[2][3]
    fields = dict(pairs(check_member(member)))
    assert fields[RETRIES_FIELD] == b"3"
    assert plan(t, d, RETRY) == Plan(Effect.LEFT_PENDING)


def test_copy_counter_never_goes_backwards() -> None:
    """Reclaim: header says 0 retries, the server counted 4 deliveries."""
    t = StreamSubscription(STREAM, GROUP, mode=Mode.RECLAIM).target(CONSUMER)
    d = Delivery(source=STREAM, id="5-0", fields={b"f": b"v"}, data=None,
                 attempt=attempt_of(0, 4), origin_id="5-0", retries=0)
    p = plan(t, d, RETRY)
    fields = dict(pairs(evalsha(p.commands[0])[2][2:]))
    next_attempt = attempt_of(int(fields[RETRIES_FIELD]), 1)
    assert next_attempt == 5 > d.attempt


@pytest.mark.parametrize("kind", ["stream", "rlist"])
def test_durable_members_are_unique_for_identical_payloads(kind: str) -> None:
    f = Form_(kind, Mode.PLAIN if kind == "stream" else None, DelayedRetry.DURABLE_ZSET)
    t = make_target(f, None, None, False)
    d = make_delivery(f, attempt=1, retries=0, fields={b"f": b"v"}, body=b"same")
    members = set()
    for _ in range(50):
        p = plan(t, d, retry_after(1))
        members.add(evalsha(p.commands[0])[2][-1])
    assert len(members) == 50
    # ...and they differ only in the unique id
    assert len({tuple(unpack_parts(m)[1:]) for m in members}) == 1


@pytest.mark.parametrize("f", [Form_("list"), Form_("channel"), Form_("pattern"),
                               Form_("pattern", retry_channel="r")], ids=repr)
@pytest.mark.parametrize("outcome", [ACK, RETRY, DROP], ids=repr)
def test_no_ack_forms_refuse(f: Form_, outcome: Outcome) -> None:
    t = make_target(f, 3, None, False)
    d = make_delivery(f, attempt=3, retries=2, fields={}, body=b"p")
    with pytest.raises(AckUnsupported) as info:
        plan(t, d, outcome)
    assert isinstance(info.value, AckError)
    assert t.name in str(info.value)


@pytest.mark.parametrize("attempt", [1, 2, 5])
def test_pattern_without_retry_channel_refuses_retry_after(attempt: int) -> None:
    """Refused whatever the attempt, exhausted or not (the contract is unconditional)."""
    for max_attempts in (None, 1, 2):
        t = PatternSubscription("p.*", max_attempts=max_attempts).target(CONSUMER)
        d = make_delivery(Form_("pattern"), attempt=attempt, retries=attempt - 1, fields={},
                          body=b"x")
        with pytest.raises(AckUnsupported, match="retry_channel"):
            plan(t, d, retry_after(1))


def test_channel_copy_goes_to_the_concrete_channel() -> None:
    t = ChannelSubscription("a", "b").target(CONSUMER)
    d = Delivery(source="b", id=None, fields={}, data=b"m", attempt=1,
                 origin_id=content_origin(b"m"), raw=b"m")
    p = plan(t, d, retry_after(0))
    assert p.later == (("PUBLISH", "b", wrap(b"m", 1, content_origin(b"m"))),)


def test_huge_delays_are_capped_not_overflowing() -> None:
    t = StreamSubscription(STREAM, GROUP, delayed_retry=DelayedRetry.DURABLE_ZSET).target(CONSUMER)
    d = make_delivery(FORMS[0], attempt=1, retries=0, fields={b"f": b"v"}, body=b"")
    small = evalsha(plan(t, d, retry_after(0.0004)).commands[0])[2][2]
    assert small == 0
    big = evalsha(plan(t, d, retry_after(1e300)).commands[0])[2][2]
    biggest = evalsha(plan(t, d, retry_after(1.7e308)).commands[0])[2][2]
    assert big == biggest and isinstance(big, int) and 10**12 < big <= 10**15
    # exact below the cap
    assert evalsha(plan(t, d, retry_after(86400 * 365)).commands[0])[2][2] == 86400 * 365 * 1000


def test_plan_dead_and_lost() -> None:
    t = StreamSubscription(STREAM, GROUP, max_attempts=3, dead_letter="{orders}:dead").target(CONSUMER)
    d = make_delivery(FORMS[0], attempt=1, retries=0, fields={b"f": b"v"}, body=b"")
    p = plan_dead(t, d, "corrupt header")
    assert p.effect is Effect.DEAD_LETTERED and "corrupt header" in (p.warning or "")
    fields = dict(pairs(evalsha(p.commands[0])[2][2:]))
    assert fields[DEAD_REASON] == b"corrupt header"
    lost = plan_lost(t, d)
    assert lost == Plan(Effect.LOST_BEFORE_HANDLING, (("XACK", STREAM, GROUP, str(d.id)),))
    foreign = plan_foreign(t, d)
    assert foreign == Plan(Effect.FOREIGN_COPY, (("XACK", STREAM, GROUP, str(d.id)),))
    # reliable list: the element goes to the dead letter as read (envelope kept)
    tl = ReliableListSubscription(QUEUE, max_attempts=1, dead_letter="{jobs}:dead").target(CONSUMER)
    dl = make_delivery(Form_("rlist"), attempt=2, retries=1, fields={}, body=b"b")
    p = plan_dead(tl, dl, "bad")
    assert evalsha(p.commands[0])[2][:2] == [dl.raw, dl.raw]
    assert json.loads(evalsha(p.commands[0])[2][2])["reason"] == "bad"  # with its reason record
    # no-ack forms: nothing to do but warn
    tc = ChannelSubscription("c").target(CONSUMER)
    assert plan_dead(tc, dl, "bad").effect is Effect.EXHAUSTED


def test_exhaustion_boundary() -> None:
    t = StreamSubscription(STREAM, GROUP, max_attempts=3, dead_letter=None).target(CONSUMER)
    for attempt, effect in [(1, Effect.COPIED), (2, Effect.COPIED), (3, Effect.EXHAUSTED),
                            (4, Effect.EXHAUSTED)]:
        d = make_delivery(FORMS[0], attempt=attempt, retries=attempt - 1, fields={b"f": b"v"},
                          body=b"")
        assert plan(t, d, RETRY).effect is effect
        assert plan(t, d, retry_after(1)).effect is (
            Effect.HELD if effect is Effect.COPIED else effect)
        # ACK and DROP are never diverted
        assert plan(t, d, ACK).effect is Effect.ACKED
        assert plan(t, d, DROP).effect is Effect.DROPPED


# -- attempt_of, content_origin ---------------------------------------------------------

@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_attempt_of(retries: int, count: int) -> None:
    a = attempt_of(retries, count)
    assert a == retries + max(count, 1)
    assert a >= 1 and a >= retries + 1 and a >= count
    # every delivery of the entry counts, a copy's too (a crash bumps the server count)
    assert attempt_of(retries + 1, count) == a + 1 and attempt_of(retries, max(count, 1) + 1) == a + 1


def test_attempt_of_default_count() -> None:
    assert attempt_of(0) == 1 and attempt_of(4) == 5


@given(st.binary(), st.binary())
def test_content_origin(a: bytes, b: bytes) -> None:
    assert content_origin(a) == content_origin(bytes(a))
    assert content_origin(a).startswith("sha1:")
    if a != b:
        assert content_origin(a) != content_origin(b)


# -- outcomes ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, math.inf, -math.inf])
def test_retry_after_rejects(bad: float) -> None:
    with pytest.raises(ValueError, match="delay"):
        retry_after(bad)


@given(st.floats(0, 1e12, allow_nan=False))
def test_retry_after_accepts(delay: float) -> None:
    o = retry_after(delay)
    assert o.kind is OutcomeKind.RETRY_AFTER and o.delay == delay and o.is_retry
    assert o == retry_after(delay) and hash(o) == hash(retry_after(delay))


def test_retry_after_ints() -> None:
    assert retry_after(2) == retry_after(2.0)
    assert isinstance(retry_after(2).delay, float)
    assert retry_after(0) != ACK


def test_outcome_equality_and_hash() -> None:
    outcomes = [ACK, RETRY, DROP, retry_after(0), retry_after(1), retry_after(1.5)]
    for i, a in enumerate(outcomes):
        for j, b in enumerate(outcomes):
            assert (a == b) is (i == j)
    assert len(set(outcomes)) == len(outcomes)
    assert {retry_after(1): "x"}[retry_after(1.0)] == "x"
    assert Outcome(OutcomeKind.ACK) == ACK
    assert ACK != "ACK" and ACK.__eq__(object()) is NotImplemented
    assert [repr(o) for o in outcomes[:4]] == ["ACK", "RETRY", "DROP", "retry_after(0.0)"]
    assert RETRY.is_retry and not ACK.is_retry and not DROP.is_retry


def test_outcome_is_immutable() -> None:
    o = retry_after(3)
    with pytest.raises(AttributeError):
        o.delay = 0
    with pytest.raises(AttributeError):
        ACK.kind = OutcomeKind.DROP
    with pytest.raises(AttributeError):
        del o.delay
    with pytest.raises(AttributeError):
        o.extra = 1
    assert o.delay == 3.0 and ACK.kind is OutcomeKind.ACK


def test_outcome_copy_and_pickle() -> None:
    for o in (ACK, RETRY, DROP, retry_after(7.25)):
        assert copy.copy(o) == o and copy.deepcopy(o) == o
        assert pickle.loads(pickle.dumps(o)) == o


def test_plan_is_frozen() -> None:
    p = Plan(Effect.ACKED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.effect = Effect.DROPPED  # type: ignore[misc]


def test_form_names_in_refusals() -> None:
    t = ListSubscription("l").target(CONSUMER)
    d = make_delivery(Form_("list"), attempt=1, retries=0, fields={}, body=b"x")
    with pytest.raises(AckUnsupported, match="list"):
        plan(t, d, RETRY)
    assert t.form is Form.LIST


def test_crafted_huge_counter_still_plans() -> None:
    t = ReliableListSubscription(QUEUE).target(CONSUMER)
    raw = wrap(b"x", 2**32 - 1, "o")
    d = Delivery(source=QUEUE, id=None, fields={}, data=b"x", attempt=2**32, origin_id="o",
                 raw=raw, retries=2**32 - 1)
    p = plan(t, d, RETRY)
    assert unwrap(evalsha(p.commands[0])[2][1])[1] == 2**32 - 1


# -- the finalizer's fast path equals the per-delivery plans ------------------------

@settings(max_examples=60, deadline=None)
@given(
    f=st.sampled_from([f for f in FORMS if f.kind in ("stream", "rlist")]),
    n=st.integers(1, 20),
    max_attempts=st.none() | st.integers(1, 5),
    attempt=st.integers(1, 6),
    bodies=st.lists(st.binary(max_size=8), min_size=20, max_size=20),
)
def test_removal_fast_path_is_what_the_plans_say(
    f: Form_, n: int, max_attempts: int | None, attempt: int, bodies: list[bytes]
) -> None:
    from trio_redis_finalize._core._batch import merge_commands
    from trio_redis_finalize._core._plan import plain_removals, removal_commands

    t = make_target(f, max_attempts, None, False)
    ds = [
        make_delivery(f, attempt=attempt, retries=0, fields={b"k": b"v"}, body=bodies[i],
                      entry_id=f"1700000000000-{i}")
        for i in range(n)
    ]
    kinds = plain_removals(t)
    assert set(kinds) == {OutcomeKind.ACK, OutcomeKind.DROP}
    for kind, effect in kinds.items():
        outcome = ACK if kind is OutcomeKind.ACK else DROP
        plans = [plan(t, d, outcome) for d in ds]
        for d, p in zip(ds, plans, strict=True):
            assert p == Plan(effect, tuple(removal_commands(t, [d])))
        merged = [tuple(c) for c in merge_commands([p.commands for p in plans])]
        assert merged == [tuple(c) for c in removal_commands(t, ds)]


def test_fast_path_removes_nothing_where_nothing_is_removed() -> None:
    """Simple lists and Pub/Sub: an ACK or a DROP is done without a command,
    as the finalizer counts the refused plan (Effect.NOTHING)."""
    from trio_redis_finalize._core._plan import plain_removals, removal_commands

    for f in FORMS:
        if f.kind in ("list", "channel", "pattern"):
            t = make_target(f, None, None, False)
            assert plain_removals(t) == {OutcomeKind.ACK: Effect.NOTHING,
                                         OutcomeKind.DROP: Effect.NOTHING}
            d = make_delivery(f, attempt=1, retries=0, fields={}, body=b"x")
            assert removal_commands(t, [d]) == []
            for outcome in (ACK, DROP):
                with pytest.raises(AckUnsupported, match="nothing to acknowledge"):
                    plan(t, d, outcome)


# -- a stream RETRY, taken first in plan(), is the general copy ----------------------

@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(list(Mode)),
    retention=st.sampled_from([None, *Retention]),
    copy_maxlen=st.none() | st.integers(0, 10**6),
    max_attempts=st.none() | st.integers(1, 5),
    cluster=st.booleans(),
    group=st.sampled_from(["", GROUP, "{orders}g"]),
    attempt=st.integers(1, 7),
    retries=st.integers(0, 6),
    flat=st.booleans(),
    field_list=st.lists(st.tuples(st.binary(max_size=4), st.binary(max_size=8)), min_size=1,
                        max_size=4),
)
def test_stream_retry_is_the_general_copy(
    mode: Mode, retention: Retention | None, copy_maxlen: int | None, max_attempts: int | None,
    cluster: bool, group: str, attempt: int, retries: int, flat: bool,
    field_list: list[tuple[bytes, bytes]],
) -> None:
    """``plan()`` takes a RETRY on a stream first: the dead letter at the last
    attempt, the PEL when claiming, else the general ``_stream_copy`` of
    ``_stream_copy_fields`` -- whose gated command, built in one tuple, is
    ``STREAM_COPY_ACK.command(...)`` byte for byte."""
    from trio_redis_finalize._core._plan import plan_dead
    from trio_redis_finalize._core.stream.cells import _stream_copy
    from trio_redis_finalize._core.stream.cells import stream_copy_fields as _stream_copy_fields
    from trio_redis_finalize._core.stream.scripts import STREAM_COPY_ACK

    t = dataclasses.replace(
        StreamSubscription(STREAM, GROUP, mode=mode, max_attempts=max_attempts).target(
            CONSUMER, cluster=cluster),
        retention=retention, copy_maxlen=copy_maxlen, group=group)
    d = Delivery(source=STREAM, id="1700000000000-7", fields=dict(field_list), data=None,
                 attempt=attempt, origin_id="1600000000000-0", retries=retries, mount="m",
                 flat=[x for kv in field_list for x in kv] if flat else None)
    expected = _stream_copy(t, d, t.source, _stream_copy_fields(d, t.group), Effect.COPIED,
                            t.copy_maxlen)
    if not cluster and copy_maxlen is None and retention is not Retention.DELETE_ON_FINALIZE:
        fields = _stream_copy_fields(d, t.group)
        assert expected.commands == (
            STREAM_COPY_ACK.command((t.source, t.source), (t.group, d.id, *fields)),)
    got = plan(t, d, RETRY)
    if max_attempts is not None and attempt >= max_attempts:
        reason = f"max_attempts={max_attempts} reached at attempt {attempt}"
        assert got == plan_dead(t, d, reason)
    elif mode is Mode.CLAIMING:
        assert got == Plan(Effect.LEFT_PENDING)
    else:
        assert got == expected


# -- REJECT / reject(reason): the dead letter now ---------------------------------

REJECTS = [REJECT, reject("malformed order")]


@pytest.mark.parametrize("f", [f for f in FORMS if f.kind in ("stream", "rlist")], ids=repr)
@pytest.mark.parametrize("outcome", REJECTS, ids=repr)
@pytest.mark.parametrize("dead", ["same", "other"])
@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("max_attempts", [None, 1, 5])
def test_reject_dead_letters_at_any_attempt(f: Form_, outcome: Outcome, dead: str,
                                            cluster: bool, max_attempts: int | None) -> None:
    """REJECT is the dead letter's gated copy-then-remove at attempt 1 already
    (whatever max_attempts: even None, the dead letter given), the reason in it."""
    src = STREAM if f.kind == "stream" else QUEUE
    dl = (DEAD_SAME if dead == "same" else DEAD_OTHER)[src]
    if max_attempts is None:  # a dead letter needs max_attempts: given through the Target
        t = dataclasses.replace(make_target(f, 3, dl, cluster), max_attempts=None)
    else:
        t = make_target(f, max_attempts, dl, cluster)
    d = make_delivery(f, attempt=1, retries=0, fields={b"a": b"1"}, body=b"x")
    p = plan(t, d, outcome)
    reason = f"rejected: {outcome.reason}" if outcome.reason else "rejected"
    assert p == plan_dead(t, d, reason)
    assert p.effect is Effect.DEAD_LETTERED
    assert p.gated is (not cluster or same_slot(t.processing or t.source, dl))
    flat = [a for c in p.commands for a in c if isinstance(a, bytes)]
    if f.kind == "stream":
        assert DEAD_REASON in flat and reason.encode() in flat
    else:
        assert any(isinstance(a, bytes) and reason.encode() in a for a in flat)


@pytest.mark.parametrize("f", [f for f in FORMS if f.kind in ("stream", "rlist")], ids=repr)
@pytest.mark.parametrize("outcome", REJECTS, ids=repr)
def test_reject_carries_writes_in_its_gated_step(f: Form_, outcome: Outcome) -> None:
    src = STREAM if f.kind == "stream" else QUEUE
    t = make_target(f, 3, DEAD_SAME[src], False)
    d = make_delivery(f, attempt=1, retries=0, fields={b"a": b"1"}, body=b"x")
    w = outcome.with_writes(("HINCRBY", "{orders}:totals", "eur", 5))
    assert w.kind is OutcomeKind.REJECT and w.reason == outcome.reason
    p = plan_writes(t, d, w)
    assert p.effect is Effect.DEAD_LETTERED and p.gated and len(p.commands) == 1
    script = stream_scripts.STREAM_WRITES if f.kind == "stream" else list_scripts.LIST_WRITES
    assert p.commands[0][:2] == (b"EVALSHA", script.sha)
    assert DEAD_SAME[src] in p.commands[0] and "{orders}:totals" in p.commands[0]
    assert "HINCRBY" in p.commands[0]


@pytest.mark.parametrize("f", [f for f in FORMS if f.kind not in ("stream", "rlist")], ids=repr)
@pytest.mark.parametrize("outcome", REJECTS, ids=repr)
def test_reject_refused_without_a_dead_letter_no_ack_forms(f: Form_, outcome: Outcome) -> None:
    t = make_target(f, 3, None, False)
    d = make_delivery(f, attempt=1, retries=0, fields={}, body=b"p")
    with pytest.raises(AckUnsupported, match="no dead letter") as info:
        plan(t, d, outcome)
    assert t.name in str(info.value)


@pytest.mark.parametrize("f", [f for f in FORMS if f.kind in ("stream", "rlist")], ids=repr)
@pytest.mark.parametrize("max_attempts", [None, 3])
def test_reject_refused_with_dead_letter_none(f: Form_, max_attempts: int | None) -> None:
    t = make_target(f, max_attempts, None, False)
    assert t.dead_letter is None
    d = make_delivery(f, attempt=1, retries=0, fields={b"a": b"1"}, body=b"x")
    with pytest.raises(AckUnsupported, match="dead_letter=None"):
        plan(t, d, reject("bad"))
    with pytest.raises(AckUnsupported, match="dead_letter=None"):
        plan_writes(t, d, reject("bad").with_writes(("SET", "k", "v")))


def test_reject_values() -> None:
    assert reject("x") == reject("x") != reject("y")
    assert reject("x") != REJECT and REJECT.kind is reject("x").kind is OutcomeKind.REJECT
    assert repr(REJECT) == "REJECT" and repr(reject("bad")) == "reject('bad')"
    assert not REJECT.is_retry
    with pytest.raises(ValueError, match="reason"):
        reject(3)  # type: ignore[arg-type]
    assert issubclass(Rejected, Exception) and str(Rejected("why")) == "why"
    w = reject("bad").with_writes(("SET", "k", "v"))
    assert w.reason == "bad" and repr(w).startswith("reject('bad').with_writes(")

@pytest.mark.parametrize("source", ["orders", "{app}.orders", "a}b", ""])
def test_a_runtime_retry_after_s_receipt_is_its_own_key_in_the_stream_s_slot(source: str) -> None:
    """Every runtime ``retry_after`` finalization gets a receipt key of its
    own (two plans of one delivery never share one: a racing finalization
    cannot read the other's), in the source's hash slot (one script holds
    both); its removal and its copy name the same one."""
    t = StreamSubscription(source, "g").target("c1") if source else dataclasses.replace(
        StreamSubscription("x", "g").target("c1"), source="")
    d = Delivery(source=source, id="1-0", fields={b"k": b"v"}, data=None, attempt=1,
                 origin_id="1-0")
    receipts = set()
    for _ in range(3):
        p = plan(t, d, retry_after(1.0))
        (removal,) = p.commands
        (copy,) = p.later
        assert removal[1] == stream_scripts.STREAM_REMOVE_RECEIPT.sha
        assert copy[1] == stream_scripts.STREAM_COPY_ONCE.sha and copy[4] == removal[4]
        assert RECEIPT_SUFFIX.strip(":") in removal[4] and same_slot(source, removal[4])
        receipts.add(removal[4])
        assert {removal[1]} == RECEIPTED
    assert len(receipts) == 3


def test_every_form_has_its_row() -> None:
    """``plan()`` is one lookup in ``CELLS``: every form has a row there, and
    the facts the rest of the core asks of it (no ``Form`` test elsewhere)."""
    from trio_redis_finalize._core._plan import CELLS, CELLS_OF, cells_of

    assert set(CELLS) == set(Form)
    assert {f._value_: c for f, c in CELLS.items()} == CELLS_OF
    facts = {f: (c.gated, c.by_id, c.counted, c.noun) for f, c in CELLS.items()}
    assert facts == {
        Form.STREAM: (True, True, False, "stream"),
        Form.RELIABLE_LIST: (True, False, True, "reliable list"),
        Form.LIST: (False, False, False, "list"),
        Form.CHANNEL: (False, False, False, "channel"),
        Form.PATTERN: (False, False, False, "pattern"),
    }
    assert all(c.noun == f.value for f, c in CELLS.items())  # refusals name the form as before
    t = StreamSubscription(STREAM, GROUP).target(CONSUMER)
    assert cells_of(t) is CELLS[Form.STREAM]
