"""The hot path of ACKs and DROPs carrying writes (``_core._hot_writes``) is
the slow path without a plan per delivery: same calls, same settlement.

Each batch is finalized twice, sans-IO: once by a core with the hot path and
once by the same core with it off (every such outcome planned by
``plan_writes``, put in batched calls by ``first_round``).  Both are driven
round by round with the same fate for each delivery (written and removed, a
closed gate, a refusal that did not run, a final error; a round trip lost
now and then), rendered as each path's commands ask (a batched call's short
reply, or a single script's); both must end with the same effects, the same
ids forgotten and the same effect per delivery.  The first round's calls
must carry the very single-script calls the slow path's plans make.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rexc

from trio_redis_finalize import (
    ACK,
    DROP,
    RETRY,
    Delivery,
    Outcome,
    ReliableListSubscription,
    StreamSubscription,
)
from trio_redis_finalize._core._batch import batch_replies, batch_singles, is_batched
from trio_redis_finalize._core._commands import Command, Spliced
from trio_redis_finalize._core._finalize import FinalizeBatch, FinalizerCore
from trio_redis_finalize._core._hot_writes import HotWrites
from trio_redis_finalize._core._lua_writes import SAME_WRITES
from trio_redis_finalize._core._replies import NotRunError
from trio_redis_finalize._core._types import Target
from trio_redis_finalize._core._writes import plan_writes
from trio_redis_finalize._core.reliable_list.gates import ListGates
from trio_redis_finalize._core.reliable_list.scripts import LIST_WRITES, LIST_WRITES_REMOVE_BATCH
from trio_redis_finalize._core.stream.batches import gate_range
from trio_redis_finalize._core.stream.scripts import STREAM_WRITES, STREAM_WRITES_ACK_BATCH

S, G = "{orders}", "billing"
WRITES = [
    ("HINCRBY", "{orders}:totals", "n", 1),
    ("SADD", "{orders}:seen", "x"),
    ("SET", "{orders}:last", "v"),
    ("EXPIRE", "{orders}:seen", 60),
]
SHARED = [ACK.with_writes(WRITES[0]), DROP.with_writes(WRITES[1], WRITES[2]),
          ACK.with_writes(*WRITES)]
OOM = NotRunError("OOM command not allowed when used memory > 'maxmemory'.")
WRONGTYPE = rexc.ResponseError("WRONGTYPE write 1 of the outcome: nothing written")
LOST = rexc.ConnectionError("Connection lost")


def target(how: str = "plain") -> Target:
    kw: dict[str, Any] = {}
    if how == "delete":
        from trio_redis_finalize import Retention
        kw["retention"] = Retention.DELETE_ON_FINALIZE
    return StreamSubscription(S, G, **kw).target("c1")


def entry(n: int, seq: int = 0) -> Delivery:
    return Delivery(source=S, id=f"{1_700_000_000_000 + n}-{seq}", fields={b"k": b"v"},
                    data=None, attempt=1, origin_id=f"{n}-0", mount="m")


def test_a_forms_writes_calls_says_whether_its_cells_build_them() -> None:
    """``Cells.writes_calls`` (what ``HotWrites.applies`` reads) is whether
    the form's ``ack_writes_calls`` builds batched calls; Redis Cluster
    plans every one (each write's hash slot checked)."""
    from trio_redis_finalize import ChannelSubscription, ListSubscription, PatternSubscription
    from trio_redis_finalize._core._hot_writes import encode
    from trio_redis_finalize._core._plan import cells_of

    subs = [StreamSubscription(S, G), ReliableListSubscription("{jobs}"), ListSubscription("q"),
            ChannelSubscription("ch"), PatternSubscription("p.*")]
    built = []
    for sub in subs:
        t = sub.target("c1")
        cells = cells_of(t)
        built.append(cells.writes_calls)
        assert cells.writes_calls == (cells.ack_writes_calls(t, [], encode) is not None)
        assert HotWrites.applies(cells, t) == cells.writes_calls
        assert not HotWrites.applies(cells, sub.target("c1", cluster=True))
    assert built == [True, True, False, False, False]


def cores(t: Target) -> tuple[FinalizerCore, FinalizerCore]:
    hot, slow = FinalizerCore(t), FinalizerCore(t)
    assert hot._hot
    slow._hot = False
    return hot, slow


# -- the first round -------------------------------------------------------------------------


def test_the_hot_calls_carry_the_slow_paths_single_scripts() -> None:
    t = target()
    items = [(entry(i), SHARED[i % 3]) for i in range(250)]
    hot, slow = cores(t)
    calls = [c for c in hot.batch(items).commands() if is_batched(c)]
    assert len(calls) == 3  # at most STREAM_BATCH_MAX (100) deliveries a call
    assert all(isinstance(c, Spliced) for c in calls)
    singles = [s for c in calls for s in batch_singles(c)]
    assert singles == [plan_writes(t, d, o).commands[0] for d, o in items]
    # ... and the calls themselves are the slow path's first round's
    assert calls == [tuple(c) for c in slow.batch(items).commands() if is_batched(c)]


def _same_writes_parts(call: Command, same: Callable[[Any, Any], bool]) -> list[Any]:
    """The parts of a batched call whose deliveries are ``batch_singles(call)``,
    each one's writes ``SAME_WRITES`` where ``same(its single, the one before)``."""
    want: list[Any] = []
    before: Any = None
    for x in batch_singles(call):
        writes = x[3 + int(x[2]) + 5:]  # (after group, id, op, how, cap; no own values)
        again = before is not None and same(x, before)
        want += [STREAM_WRITES.field(x, "id"), *([SAME_WRITES] if again else writes)]
        before = x
    return want


@pytest.mark.parametrize("layout", ["one object", "runs", "equal objects"])
def test_writes_the_delivery_before_carried_go_once(layout: str) -> None:
    """A delivery that returned the outcome object of the delivery before it
    in the call carries ``SAME_WRITES`` instead of its writes (the first of
    each call in full); the slow path sends it for equal writes of any
    objects (it has no objects); both calls' singles are each delivery's
    own ``STREAM_WRITES`` call."""
    t = target()
    if layout == "one object":
        outs = [SHARED[2]] * 250
    elif layout == "runs":
        outs = [SHARED[i // 7 % 3] for i in range(250)]
    else:
        outs = [ACK.with_writes(*WRITES) for _ in range(250)]
    items = [(entry(i), o) for i, o in enumerate(outs)]
    outcome_of = {d.id: o for d, o in items}
    hot, slow = cores(t)
    singles = [plan_writes(t, d, o).commands[0] for d, o in items]
    for core, same in (
            (hot, lambda x, y: outcome_of[STREAM_WRITES.field(x, "id")]
             is outcome_of[STREAM_WRITES.field(y, "id")]),
            (slow, lambda x, y: x[3 + int(x[2]) + 5:] == y[3 + int(y[2]) + 5:])):
        calls = [c for c in core.batch(items).commands() if is_batched(c)]
        assert len(calls) == 3  # (100 deliveries a call at most)
        assert [s for c in calls for s in batch_singles(c)] == singles
        for c in calls:
            parts = list(STREAM_WRITES_ACK_BATCH.rest(c, "id"))
            assert parts == _same_writes_parts(c, same)
            assert parts[1] != SAME_WRITES  # the first delivery's in full
            assert (SAME_WRITES in parts) == (core is slow or layout != "equal objects")


def test_one_delivery_goes_as_a_batched_call_read_the_same_way() -> None:
    t = target()
    (call,) = FinalizerCore(t).batch([(entry(1), SHARED[0])]).commands()
    assert STREAM_WRITES_ACK_BATCH.calls(call)
    assert batch_singles(call) == [plan_writes(t, entry(1), SHARED[0]).commands[0]]
    assert STREAM_WRITES.calls(batch_singles(call)[0])


def test_a_clean_reply_settles_every_delivery_at_once() -> None:
    items = [(entry(i), SHARED[0]) for i in range(5)] + [(entry(9), SHARED[1])]
    b = FinalizerCore(target()).batch(items)
    assert len(b.commands()) == 1
    b.receive([[6]])
    assert b.commands() == []
    done = b.result()
    assert done.effects == {"acked": 5, "dropped": 1, "writes": 5 + 2}
    assert sorted(done.forget()) == sorted(str(d.id) for d, _ in items)
    assert Counter(e for _, e in done.deliveries()) == {"acked": 5, "dropped": 1}
    assert b.outcomes == {"ack": 5, "drop": 1}


def test_mixed_batches_keep_the_plain_removals_first() -> None:
    items = [(entry(1), ACK), (entry(2), SHARED[0]), (entry(3), RETRY), (entry(4), ACK)]
    cmds = FinalizerCore(target()).batch(items).commands()
    assert cmds[0][0] == "XACK" and STREAM_WRITES_ACK_BATCH.calls(cmds[1])
    assert len(cmds) == 3  # the XACK, the writes' call, the RETRY's copy


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), min_size=1, max_size=60))
def test_gate_range_is_the_smallest_and_largest_id(parts: list[tuple[int, int]]) -> None:
    """Exact (a wider range lets other consumers' pending entries take the
    rows its COUNT allows), also for seq parts of several lengths, one ms or many."""
    ids = [f"{1_700_000_000_000 + ms}-{10 ** (seq // 3) + seq}" for ms, seq in parts]

    def order(i: str) -> tuple[int, int]:
        ms, seq = i.split("-")
        return int(ms), int(seq)

    assert gate_range(ids) == (min(ids, key=order), max(ids, key=order), 2 * len(ids))
    one_ms = [f"1700000000000-{seq}" for _, seq in parts]
    assert gate_range(one_ms)[:2] == (min(one_ms, key=order), max(one_ms, key=order))
    assert gate_range([*ids, "5-1"])[0] == "5-1"  # ms parts of other lengths too


# -- the two paths driven alike ------------------------------------------------------------

FATES = ["ok", "ok", "ok", "closed", "oom", "final", "lost"]


def _reply(cmd: Any, fate: dict[str, str], round_no: int) -> Any:
    """The reply to ``cmd`` when each delivery (by entry id) meets its fate,
    as this command asks: a batched call's short reply, a single script's."""
    if cmd[0] == "XACK":
        return len(cmd) - 3
    if cmd[0] == "LREM":
        return 1
    if is_batched(cmd):
        singles = batch_singles(cmd)
        elements = [_single(s, fate, round_no) for s in singles]
        out: list[Any] = [len(elements)]
        for at, e in enumerate(elements, 1):
            if e is not _WRITTEN:
                out += [at, e]
        return out
    r = _single(cmd, fate, round_no)
    return 1 if r is _WRITTEN else r


_WRITTEN = object()


def _single(cmd: Any, fate: dict[str, str], round_no: int) -> Any:
    key = (str(STREAM_WRITES.field(cmd, "id")) if STREAM_WRITES.calls(cmd)
           else repr(LIST_WRITES.field(cmd, "element")) if LIST_WRITES.calls(cmd) else None)
    if key is not None:
        what = fate.get(key, "ok")
        if what == "closed":
            return False
        if what == "oom" and round_no == 0:  # refused once: not run, sent again
            return OOM
        if what == "final":
            return WRONGTYPE
    return _WRITTEN


def _drive(b: FinalizeBatch, fate: dict[str, str], lost: int) -> list[int]:
    """Every round answered; the round ``lost`` (if any) lost once."""
    errors = []
    round_no = 0
    while cmds := b.commands():
        if round_no == lost:
            lost = -1
            errors.append(b.failed(LOST).errors)
            continue
        replies = [_reply(c, fate, round_no) for c in cmds]
        for c, r in zip(cmds, replies, strict=True):
            if is_batched(c) and isinstance(r, list):
                assert batch_replies(r, len(batch_singles(c))) is not None
        errors.append(b.receive(replies).errors)
        round_no += 1
        assert round_no < 20
    return errors


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["shared0", "shared1", "shared2", "fresh", "ACK",
                                           "RETRY"]),
                          st.sampled_from(FATES)), min_size=1, max_size=130),
       st.integers(-1, 2), st.sampled_from(["plain", "delete"]), st.randoms())
def test_the_hot_path_settles_as_the_slow_path(
    spec: list[tuple[str, str]], lost: int, how: str, rnd: random.Random
) -> None:
    t = target(how)
    items: list[tuple[Delivery, Outcome]] = []
    fate: dict[str, str] = {}
    for i, (kind, what) in enumerate(spec):
        d = entry(i, seq=rnd.choice([0, 0, 7, 12]))
        o: Outcome = {"shared0": SHARED[0], "shared1": SHARED[1], "shared2": SHARED[2],
                      "ACK": ACK, "RETRY": RETRY}.get(kind) or rnd.choice([ACK, DROP]).with_writes(
            ("HINCRBY", "{orders}:c", str(i), i))
        items.append((d, o))
        assert d.id is not None
        fate[d.id] = what
    hot, slow = cores(t)
    results = []
    for core in (hot, slow):
        b = core.batch(items)
        errors = _drive(b, fate, lost)
        done = b.result()
        results.append((b.outcomes, sum(errors), done.effects, sorted(done.forget()),
                        sorted((d.id, e) for d, e in done.deliveries())))
    assert results[0] == results[1]


def test_every_is_told_in_c_and_refuses_a_mix() -> None:
    removable = FinalizerCore(target())._kinds
    items: Sequence[tuple[Delivery, object]] = [(entry(1), SHARED[0]), (entry(2), SHARED[1])]
    assert HotWrites.every(items, removable)
    assert not HotWrites.every([*items, (entry(3), ACK)], removable)
    assert not HotWrites.every([(entry(3), RETRY.with_writes(WRITES[0]))], removable)
    assert not HotWrites.every([(entry(3), ACK.with_writes())], removable)


# -- a reliable list: its counted gates number the hot calls as the slow path's -----------


def element(i: int, body: bytes) -> Delivery:
    return Delivery(source="{jobs}", id=None, fields={}, data=body, attempt=1,
                    origin_id=f"o-{i}", raw=body, mount="m")


def list_core(t: Target, raws: Sequence[bytes]) -> FinalizerCore:
    gates = ListGates()
    gates.target = t
    for r in raws:
        gates.hold(r)
    return FinalizerCore(t, gates=gates)


def test_a_reliable_lists_hot_calls_carry_its_single_scripts() -> None:
    t = ReliableListSubscription("{jobs}").target("c1")
    items = [(element(i, b"same" if i % 4 == 0 else b"job-%d" % i), SHARED[i % 3])
             for i in range(120)]
    hot = list_core(t, [d.raw or b"" for d, _ in items])
    assert hot._hot
    calls = [c for c in hot.batch(items).commands() if LIST_WRITES_REMOVE_BATCH.calls(c)]
    assert len(calls) == 2
    singles = [s for c in calls for s in batch_singles(c)]
    # each identical element's removal numbered on the copies held (30, 29, ... 1)
    assert [LIST_WRITES.field(s, "n") for s in singles if LIST_WRITES.field(s, "element") == b"same"] \
        == list(range(30, 0, -1))
    plain = [s for s in singles if LIST_WRITES.field(s, "element") != b"same"]
    assert plain == [plan_writes(t, d, o).commands[0] for d, o in items if d.raw != b"same"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["shared0", "shared1", "fresh", "ACK", "RETRY"]),
                          st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"]),
                          st.sampled_from(FATES)), min_size=1, max_size=120),
       st.integers(-1, 2))
def test_a_reliable_lists_hot_path_settles_as_the_slow_path(
    spec: list[tuple[str, bytes, str]], lost: int
) -> None:
    t = ReliableListSubscription("{jobs}").target("c1")
    items: list[tuple[Delivery, Outcome]] = []
    fate: dict[str, str] = {}
    for i, (kind, body, what) in enumerate(spec):
        o: Outcome = {"shared0": SHARED[0], "shared1": SHARED[1], "ACK": ACK,
                      "RETRY": RETRY}.get(kind) or ACK.with_writes(("INCRBY", "{jobs}:n", i))
        if kind in ("ACK", "RETRY"):
            # other bytes than the writes': counted gates number removals in the
            # order sent, and the plain ones go first on either path
            body = b"plain-" + body
        items.append((element(i, body), o))
        fate.setdefault(repr(body), what)  # (identical elements: one fate)
    raws = [d.raw or b"" for d, _ in items]
    hot, slow = list_core(t, raws), list_core(t, raws)
    slow._hot = False
    results = []
    for core in (hot, slow):
        b = core.batch(items)
        errors = _drive(b, fate, lost)
        done = b.result()
        g = core.gates
        assert isinstance(g, ListGates)
        results.append((b.outcomes, sum(errors), done.effects, done.forget(),
                        sorted((d.origin_id, e) for d, e in done.deliveries()),
                        dict(g.in_hand), dict(g.unsent), g.leftover, g.rescan_wanted))
    assert results[0] == results[1]


def test_an_element_not_run_in_a_batched_call_is_settled_by_its_resend_only() -> None:
    """A batched call of removals with writes whose element did not run (OOM
    in the script) sends that element again alone: only the resend's reply
    settles its counted gate (once; before, the batched reply's error counted
    too: one copy forgotten twice, a leftover that was none)."""
    t = ReliableListSubscription("{jobs}").target("c1")
    items: list[tuple[Delivery, Outcome]] = [(element(0, b"x"), SHARED[0]),
                                             (element(1, b"x"), SHARED[0]),
                                             (element(2, b"x"), SHARED[0])]
    core = list_core(t, [b"x", b"x", b"x", b"x"])  # one more copy held by another handler
    b = core.batch(items)
    assert len(b.commands()) == 1
    b.receive([[3, 2, OOM]])
    (single,) = b.commands()
    assert LIST_WRITES.calls(single)
    b.receive([1])
    assert b.commands() == []
    done = b.result()
    assert done.effects == {"acked": 3, "writes": 3}
    g = core.gates
    assert isinstance(g, ListGates)
    assert g.in_hand == {b"x": 1} and g.leftover == {} and not g.rescan_wanted


# -- an outcome's writes encoded once, as they are checked --------------------------------

_VALUE = st.one_of(st.text(max_size=6), st.binary(max_size=6), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=False, allow_infinity=False, width=32))
_WRITE = st.one_of(
    st.tuples(st.sampled_from(["HINCRBY", "hincrby", b"HINCRBY"]), st.text(min_size=1, max_size=5),
              st.text(max_size=3), st.integers(-9, 9)),
    st.tuples(st.sampled_from(["SADD", "ZREM", "LPUSH"]), st.text(min_size=1, max_size=5), _VALUE,
              _VALUE),
    st.tuples(st.sampled_from(["DEL", "UNLINK"]), st.text(min_size=1, max_size=5),
              st.text(min_size=1, max_size=5)),
    st.tuples(st.just("SET"), st.binary(min_size=1, max_size=5), _VALUE),
    st.tuples(st.just("EXPIRE"), st.text(min_size=1, max_size=5), st.integers(1, 10**6)),
)


@given(st.lists(_WRITE, min_size=1, max_size=6), st.lists(_WRITE, max_size=4))
def test_an_outcomes_writes_are_encoded_as_the_script_reads_them(
    first: list[tuple[Any, ...]], more: list[tuple[Any, ...]]
) -> None:
    from trio_redis_finalize._core._writes import encode_writes
    from trio_redis_finalize._writes import check_writes, write_keys

    try:
        writes = check_writes([*first, *more])
    except ValueError:  # (writes refused together: added to an outcome, refused as well)
        with pytest.raises(ValueError):
            ACK.with_writes(*first).with_writes(*more)
        return
    o = ACK.with_writes(*first)
    if more:
        o = o.with_writes(*more)
    assert o.writes == writes
    assert list(o.write_parts) == encode_writes(writes)  # (their count first)
    assert list(o.write_keys) == write_keys(writes)
    assert o == ACK.with_writes(*first, *more)  # (the encodings compare as nothing)


def test_writes_added_to_an_outcome_are_checked_with_its_own() -> None:
    """``with_writes`` on an outcome carrying writes checks them all, as one
    call would: a write whose key the outcome's earlier writes make another
    type is refused (it would fail once those ran), and the bounds count
    every write (here ``HINCRBY k`` then ``SADD k``, and 64 + 1 writes)."""
    from trio_redis_finalize._writes import MAX_WRITES

    with pytest.raises(ValueError, match=r"writes\[1\]: SADD 'k' needs a set, but .* is a hash"):
        ACK.with_writes(("HINCRBY", "k", "f", 1)).with_writes(("SADD", "k", "m"))
    with pytest.raises(ValueError, match=f"at most {MAX_WRITES} writes"):
        ACK.with_writes(*[("INCR", "n")] * MAX_WRITES).with_writes(("INCR", "n"))
    o = ACK.with_writes(("HSET", "k", "f", 1)).with_writes(("HINCRBY", "k", "f", 2))
    assert o == ACK.with_writes(("HSET", "k", "f", 1), ("HINCRBY", "k", "f", 2))
