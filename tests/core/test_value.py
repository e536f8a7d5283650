"""The value-object convention (``_value``): frozen slotted dataclasses that
refuse every assignment and deletion, copy and pickle."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest

from trio_redis_finalize import (
    ACK,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    Backoff,
    ChannelSubscription,
    Delivery,
    PatternSubscription,
    ReliableListSubscription,
    StreamSubscription,
    retry_after,
)
from trio_redis_finalize._core._decode import list_deliveries, payload_deliveries
from trio_redis_finalize._core._types import Effect, Plan, Target
from trio_redis_finalize._core.stream.decode import stream_deliveries
from trio_redis_finalize._delivery import record_error
from trio_redis_finalize._envelope import wrap
from trio_redis_finalize._subscription import Form
from trio_redis_finalize._value import builder, immutable, setters


def _values() -> list[object]:
    return [
        ACK, retry_after(2.5), Backoff(0.2, 3.0),
        ChannelSubscription("a", "b", max_attempts=2), PatternSubscription("p.*", retry_channel="r"),
        Delivery("s", "1-0", {b"k": b"v"}, None, 1, "1-0"), Plan(Effect.ACKED),
        Target(form=Form.CHANNEL, name="channel a"),
    ]


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_every_assignment_and_deletion_is_refused(value: object) -> None:
    field = dataclasses.fields(value)[0].name  # type: ignore[arg-type]
    before = getattr(value, field)
    for name in (field, "not_a_field"):
        with pytest.raises(dataclasses.FrozenInstanceError, match=type(value).__name__):
            setattr(value, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError, match=type(value).__name__):
            delattr(value, name)
    assert getattr(value, field) is before


def _fields(v: object) -> list[object]:
    return [getattr(v, f.name) for f in dataclasses.fields(v)]  # type: ignore[arg-type]


@pytest.mark.parametrize("value", _values(), ids=lambda v: type(v).__name__)
def test_copy_and_pickle_keep_the_fields(value: object) -> None:
    for other in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
        assert type(other) is type(value) and _fields(other) == _fields(value)


def _read_deliveries() -> list[Delivery]:
    """Deliveries as the readers build them (builder twins, a lazy origin id),
    one raised on (its ``error`` set)."""
    stream = StreamSubscription("s", "g").target("c")
    [original], _ = stream_deliveries(stream, [(b"1-0", [b"k", b"v"])])
    [copied], _ = stream_deliveries(stream, [(b"2-0", [b"k", b"v", RETRIES_FIELD, b"1",
                                                       ORIGIN_FIELD, b"1-0"])])
    lists = ReliableListSubscription("q").target("c")
    [foreign, enveloped], _ = list_deliveries(lists, "q", [b"payload", wrap(b"body", 2, "o-1")])
    [payload], _, _ = payload_deliveries(ChannelSubscription("ch").target("c"), {},
                                         [[b"message", b"ch", b"message"]])
    raised = Delivery("s", "3-0", {}, None, 1, "3-0")
    record_error(raised, ValueError("boom"))
    return [original, copied, foreign, enveloped, payload, raised]


def test_read_deliveries_copy_pickle_and_replace_as_deliveries() -> None:
    for d in _read_deliveries():
        assert isinstance(d, Delivery) and type(d).__name__ == "Delivery"
        for other in (copy.copy(d), copy.deepcopy(d), pickle.loads(pickle.dumps(d))):
            assert type(other) is Delivery and _fields(other) == _fields(d)
        again = dataclasses.replace(d, attempt=d.attempt + 1)
        assert isinstance(again, Delivery) and again.attempt == d.attempt + 1
        assert again.error is None  # not an argument: a replaced copy starts without one
        assert [getattr(again, f) for f in ("source", "id", "fields", "data", "origin_id",
                                            "raw", "flat")] == \
            [getattr(d, f) for f in ("source", "id", "fields", "data", "origin_id", "raw", "flat")]
        with pytest.raises(dataclasses.FrozenInstanceError):
            d.attempt = 9  # type: ignore[misc]
    assert [d.error for d in _read_deliveries()] == [None] * 5 + ["ValueError: boom"]


def test_immutable_and_setters_refuse_what_they_cannot_serve() -> None:
    class Plain:
        __slots__ = ("x",)
        x: int

    with pytest.raises(TypeError, match="frozen=True, slots=True"):
        immutable(Plain)
    with pytest.raises(TypeError, match="no slot 'y'"):
        setters(Plain, "x", "y")
    (set_x,) = setters(Plain, "x")
    p = Plain()
    set_x(p, 3)
    assert p.x == 3


def test_the_constructor_built_on_its_twin_gives_an_ordinary_delivery() -> None:
    """``Delivery.__init__`` fills the slots in on the builder twin, then sets
    ``__class__`` back: an ordinary, immutable ``Delivery`` (type, fields,
    defaults, refusals), also when a subclass calls it."""
    args = ("s", "1-0", {b"k": b"v"}, None, 2, "0-1", None, 1, "m", "why", [b"k", b"v", b"k", b"v"])
    made = Delivery(*args)
    assert type(made) is Delivery
    names = ("source", "id", "fields", "data", "attempt", "origin_id", "raw", "retries", "mount",
             "corrupt", "flat")
    assert [getattr(made, n) for n in names] == list(args) and made.error is None
    assert made.field_list == ((b"k", b"v"), (b"k", b"v"))
    assert repr(made) == ("Delivery(source='s', id='1-0', fields={b'k': b'v'}, data=None, "
                          "attempt=2, origin_id='0-1')")
    for name in ("id", "not_a_field"):
        with pytest.raises(dataclasses.FrozenInstanceError, match="Delivery"):
            setattr(made, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError, match="Delivery"):
            delattr(made, name)
    short = Delivery("s", None, {}, b"x", 1, "o")
    assert (short.raw, short.retries, short.mount, short.corrupt, short.flat) == (None, 0, "", None, None)
    [foreign], _ = list_deliveries(ReliableListSubscription("q").target("c"), "q", [b"x"])
    again = dataclasses.replace(foreign, attempt=2)  # a subclass's __init__: its own class kept
    assert type(again) is type(foreign) and again.attempt == 2 and again.origin_id == foreign.origin_id


def test_builder_refuses_what_is_not_a_frozen_slotted_dataclass() -> None:
    @dataclasses.dataclass
    class Loose:
        x: int

    with pytest.raises(TypeError, match="frozen=True, slots=True"):
        builder(Loose)


def test_builder_init_keeps_the_dataclass_signature_and_fills_in_on_the_twin() -> None:
    """``builder(cls, init=True)``: ``cls.__init__`` has the dataclass's own
    signature (names, defaults, annotations), gives the ``init=False``
    fields their default and an ordinary frozen instance; a field it cannot
    fill (a ``default_factory``, an ``init=False`` field without default) is
    refused when the class is made, naming the field."""

    @immutable
    @dataclasses.dataclass(frozen=True, slots=True)
    class Point:
        x: int
        y: int = 2
        tag: str = dataclasses.field(default="t", init=False)

    expected = inspect.signature(Point.__init__)
    twin = builder(Point, init=True)
    assert inspect.signature(Point.__init__) == expected
    assert Point.__init__.__qualname__.endswith("Point.__init__")
    p = Point(1)
    assert (type(p), p.x, p.y, p.tag) == (Point, 1, 2, "t") and not isinstance(p, twin)
    assert Point(x=3, y=4) == Point(3, 4) != p
    with pytest.raises(dataclasses.FrozenInstanceError, match="Point"):
        p.x = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
        Point()  # type: ignore[call-arg]

    @immutable
    @dataclasses.dataclass(frozen=True, slots=True)
    class Bag:
        items: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match=r"Bag\.items: .*default_factory"):
        builder(Bag, init=True)

    @immutable
    @dataclasses.dataclass(frozen=True, slots=True)
    class Hidden:
        x: int = dataclasses.field(init=False)

    with pytest.raises(TypeError, match=r"Hidden\.x: .*needs a default"):
        builder(Hidden, init=True)
