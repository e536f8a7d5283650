"""Stream entries and list elements turned into deliveries, sans-IO (no Redis): ``_core._decode``."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from _procs import assert_immutable
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_redis_finalize import (
    GROUP_FIELD,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    ReliableListSubscription,
    StreamSubscription,
)
from trio_redis_finalize._core._decode import list_deliveries, list_delivery
from trio_redis_finalize._core._plan import _entry_fields
from trio_redis_finalize._core._types import Effect, Target, content_origin
from trio_redis_finalize._core.stream.decode import Entry, id_key, read_entries, stream_deliveries
from trio_redis_finalize._delivery import Delivery, record_error, trace_fields
from trio_redis_finalize._envelope import MAGIC, wrap

HEADERS = (RETRIES_FIELD, ORIGIN_FIELD, GROUP_FIELD)
TRACE = (b"traceparent", b"tracestate")
TARGET = StreamSubscription("s", "g", max_attempts=3, dead_letter="dead").target("c")


def test_an_original_is_its_field_list_at_attempt_one() -> None:
    flat = [b"a", b"1", b"b", b"2", b"a", b"3"]
    [d], direct = stream_deliveries(TARGET, [(b"5-1", flat)])
    assert direct == []
    assert (d.source, d.id, d.origin_id, d.attempt, d.retries, d.mount) == (
        "s", "5-1", "5-1", 1, 0, TARGET.name)
    assert d.fields == {b"a": b"3", b"b": b"2"}  # a repeated name: its last value
    assert d.field_list == ((b"a", b"1"), (b"b", b"2"), (b"a", b"3"))


def test_a_copy_of_this_group_counts_its_retries() -> None:
    flat = [b"x", b"1", RETRIES_FIELD, b"1", ORIGIN_FIELD, b"1-0", GROUP_FIELD, b"g"]
    [d], direct = stream_deliveries(TARGET, [(b"9-0", flat)])
    assert direct == []
    assert (d.attempt, d.retries, d.origin_id, d.field_list) == (2, 1, "1-0", ((b"x", b"1"),))


def test_what_no_handler_sees() -> None:
    entries: list[Entry] = [
        (b"1-0", [b"x", b"1", GROUP_FIELD, b"other"]),  # another group's copy
        (b"2-0", [b"x", b"1", RETRIES_FIELD, b"-1"]),  # corrupt counter
        (b"3-0", [b"x", b"1", RETRIES_FIELD, b"3"]),  # attempt 4 > max_attempts 3
        (b"4-0", [b"x", b"1"]),  # server count 4 > max_attempts 3
        (b"5-0", None),  # deleted while pending
    ]
    ready, direct = stream_deliveries(TARGET, entries, {b"4-0": 4})
    assert ready == []
    assert [(d.id, p.effect) for d, p in direct] == [
        ("1-0", Effect.FOREIGN_COPY), ("2-0", Effect.DEAD_LETTERED), ("3-0", Effect.DEAD_LETTERED),
        ("4-0", Effect.DEAD_LETTERED), ("5-0", Effect.LOST_BEFORE_HANDLING)]
    assert direct[1][0].corrupt is not None


def test_the_trace_context_is_not_the_handlers_but_copies_keep_it() -> None:
    """``traceparent`` / ``tracestate`` (the publisher writes them inside a
    span): not in ``fields`` nor ``field_list``; in the fields a copy
    writes, in place; found by ``trace_fields`` (the OpenTelemetry side)."""
    tp = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    flat = [b"n", b"1", b"traceparent", tp, b"tracestate", b"k=v", b"m", b"2"]
    copy = [*flat, RETRIES_FIELD, b"1", ORIGIN_FIELD, b"1-0", GROUP_FIELD, b"g"]
    [orig, again], direct = stream_deliveries(TARGET, [(b"1-0", list(flat)), (b"2-0", copy)])
    assert direct == []
    for d in (orig, again):
        assert d.fields == {b"n": b"1", b"m": b"2"}
        assert d.field_list == ((b"n", b"1"), (b"m", b"2"))
        assert _entry_fields(d) == flat  # what a RETRY copy or a dead letter writes
        assert trace_fields(d) == {b"traceparent": tp, b"tracestate": b"k=v"}
    [alone], _ = stream_deliveries(TARGET, [(b"3-0", [b"traceparent", tp])])
    assert (alone.fields, alone.field_list, _entry_fields(alone)) == ({}, (), [b"traceparent", tp])


def test_counts_set_the_attempt() -> None:
    [a, b], _ = stream_deliveries(TARGET, [(b"1-0", [b"x", b"1"]), (b"2-0", [b"x", b"1"])],
                                  {b"2-0": 2})
    assert (a.attempt, b.attempt) == (1, 2)


def test_read_entries_and_id_key() -> None:
    assert read_entries(None) == [] and read_entries([]) == []
    assert read_entries([[b"s", [(b"1-0", [b"a", b"b"])]]]) == [(b"1-0", [b"a", b"b"])]
    assert id_key(b"10-2") > id_key("9-30") > id_key("9")


_NAMES = st.sampled_from([b"a", b"b", b"", *HEADERS, *TRACE])
_VALUES = st.sampled_from([b"0", b"1", b"2", b"g", b"h", b"x", b"-1"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=6), st.integers(1, 5), st.booleans())
def test_against_a_plain_reference(pairs: list[tuple[bytes, bytes]], count: int,
                                   plain_read: bool) -> None:
    """Fields, field list, retries, origin and attempt as the header rules say
    (``plain_read``: no counts, as after ``XREADGROUP``, when the count is 1)."""
    _against_the_reference(pairs, count, plain_read)


_TAILS = st.sampled_from([
    [(RETRIES_FIELD, b"1"), (ORIGIN_FIELD, b"1-0")],
    [(RETRIES_FIELD, b"2"), (ORIGIN_FIELD, b"1-0"), (GROUP_FIELD, b"g")],
    [(RETRIES_FIELD, b"1"), (ORIGIN_FIELD, b"1-0"), (GROUP_FIELD, b"h")],
    [(RETRIES_FIELD, b"x"), (ORIGIN_FIELD, b"1-0")],
    [(ORIGIN_FIELD, b"1-0"), (RETRIES_FIELD, b"1")],  # not the library's order
])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=5), _TAILS, st.integers(1, 5))
def test_a_copy_as_the_library_writes_it_against_the_reference(
    body: list[tuple[bytes, bytes]], tail: list[tuple[bytes, bytes]], count: int,
) -> None:
    """A copy's headers last, as ``_plan`` writes them (the decoder's fast path:
    the body sliced off), header names in the body or not: the same rules."""
    _against_the_reference([*body, *tail], count, False)


def _against_the_reference(pairs: list[tuple[bytes, bytes]], count: int, plain_read: bool) -> None:
    flat = [x for kv in pairs for x in kv]
    counts = None if plain_read and count == 1 else {b"7-0": count}
    ready, direct = stream_deliveries(TARGET, [(b"7-0", flat)], counts)
    [d] = ready + [d for d, _ in direct]
    assert isinstance(d, Delivery) and type(d).__name__ == "Delivery"
    assert d.id == "7-0" and d.source == TARGET.source
    assert (d.data, d.raw, d.mount) == (None, None, TARGET.name)
    body = [(n, v) for n, v in pairs if n not in HEADERS]  # what copies carry
    own = [(n, v) for n, v in body if n not in TRACE]  # what the handler sees
    headers = {n: v for n, v in pairs if n in HEADERS}  # the last value of each
    assert d.field_list == tuple(own)
    assert dict(d.fields) == dict(own)
    assert _entry_fields(d) == [x for kv in body for x in kv]
    assert trace_fields(d) == {n: v for n, v in body if n in TRACE}
    raw = headers.get(RETRIES_FIELD)
    valid = raw is None or (raw.isdigit())
    retries = int(raw) if raw is not None and valid else 0
    assert (d.retries, d.corrupt is None) == (retries, valid)
    assert d.origin_id == (headers[ORIGIN_FIELD].decode() if ORIGIN_FIELD in headers else "7-0")
    assert d.attempt == retries + max(count, 1)  # the header's retries, then each delivery
    foreign = headers.get(GROUP_FIELD, b"g") != b"g"
    handled = not foreign and valid and d.attempt <= 3
    assert bool(ready) == handled


def test_an_originals_field_map_is_made_when_read() -> None:
    """An original read once leaves its field map (made from its field list)
    unset until read; then an ordinary slot, frozen; the rest as any delivery."""
    flat = [b"a", b"1", b"b", b"2"]
    [d], _ = stream_deliveries(TARGET, [(b"5-1", flat)])
    with pytest.raises(AttributeError):
        Delivery.__dict__["fields"].__get__(d)  # the slot: not made yet
    assert (d.data, d.raw, d.corrupt, d.error, d.retries) == (None, None, None, None, 0)
    assert d.fields == {b"a": b"1", b"b": b"2"} and d.fields is d.fields
    assert Delivery.__dict__["fields"].__get__(d) is d.fields  # now an ordinary slot
    assert d.flat is flat and d.field_list == ((b"a", b"1"), (b"b", b"2"))
    assert_immutable(d, ("fields", "data", "id", "not_a_field"))
    [e], _ = stream_deliveries(TARGET, [(b"5-2", flat)])
    record_error(e, ValueError("boom"))
    assert e.error == "ValueError: boom" and d.error is None
    [f], _ = stream_deliveries(TARGET, [(b"5-3", [])])
    assert f.fields == {} and f.field_list == ()


def test_an_original_copies_and_pickles_as_a_delivery() -> None:
    plain = Delivery("s", "5-1", {b"a": b"1"}, None, 1, "5-1", mount=TARGET.name,
                     flat=[b"a", b"1"])
    for c in (copy.copy, copy.deepcopy, lambda d: pickle.loads(pickle.dumps(d))):
        [d], _ = stream_deliveries(TARGET, [(b"5-1", [b"a", b"1"])])
        other = c(d)
        assert type(other) is Delivery and repr(other) == repr(d) == repr(plain)
        assert _same(other, plain) and other.error is None
        record_error(d, ValueError("x"))
        assert c(d).error == "ValueError: x"
    [d], _ = stream_deliveries(TARGET, [(b"5-1", [b"a", b"1"])])
    moved = dataclasses.replace(d, attempt=2)
    assert (moved.attempt, moved.fields, moved.origin_id) == (2, {b"a": b"1"}, "5-1")
    other = dataclasses.replace(d, fields={b"b": b"2"})
    assert other.fields == {b"b": b"2"} and d.fields == {b"a": b"1"}


# -- list elements ---------------------------------------------------------------

LIST = ReliableListSubscription("q", max_attempts=3, dead_letter="dead").target("c")
LISTS = st.sampled_from([LIST, ReliableListSubscription("q").target("c"),
                         ReliableListSubscription("q", max_attempts=1).target("c")])

_ELEMENTS = st.one_of(
    st.binary(max_size=12),  # foreign (or, starting with 0xff, corrupt)
    st.builds(wrap, st.binary(max_size=8), st.integers(0, 5), st.text(max_size=6)),
    st.builds(lambda e, cut: e[:cut], st.builds(wrap, st.binary(max_size=4), st.integers(0, 5),
                                                 st.text(max_size=4)), st.integers(0, 14)),
)


def _same(a: Delivery, b: Delivery) -> bool:
    names = ("source", "id", "fields", "data", "attempt", "origin_id", "raw", "retries", "mount",
             "corrupt", "flat")
    return all(getattr(a, n) == getattr(b, n) for n in names)


@settings(max_examples=300, deadline=None)
@given(LISTS, st.lists(_ELEMENTS, max_size=8))
def test_list_deliveries_is_list_delivery_of_each(target: Target, raws: list[bytes]) -> None:
    """The batch (the reader's hot path, foreign elements and envelopes within
    max_attempts inlined) builds what ``list_delivery`` builds element by
    element, split into handled / direct."""
    ready, direct = list_deliveries(target, "q", raws)
    one = [list_delivery(target, "q", raw) for raw in raws]
    assert len(ready) == sum(p is None for _, p in one)
    assert all(_same(a, b) for a, (b, p) in zip(ready, [x for x in one if x[1] is None], strict=True))
    assert [(p.effect, p.commands) for _, p in direct] == [
        (p.effect, p.commands) for _, p in one if p is not None]
    assert all(_same(a, b) for (a, _), (b, _) in zip(direct, [x for x in one if x[1] is not None],
                                                      strict=True))
    for d in ready:
        assert d.raw is not None
        if d.raw[:1] != MAGIC[:1]:
            assert (d.data, d.attempt, d.origin_id) == (d.raw, 1, content_origin(d.raw))
