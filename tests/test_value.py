"""The value-object convention (``_value``): frozen slotted dataclasses that
refuse every assignment and deletion, copy and pickle."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from trio_redis_finalize import (
    ACK,
    Backoff,
    ChannelSubscription,
    Delivery,
    PatternSubscription,
    retry_after,
)
from trio_redis_finalize._core._plan import Effect, Plan, Target
from trio_redis_finalize._delivery import make_delivery
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


@pytest.mark.parametrize("value", [v for v in _values() if not isinstance(v, Delivery)],
                         ids=lambda v: type(v).__name__)
def test_copy_and_pickle_keep_the_fields(value: object) -> None:
    def fields(v: object) -> list[object]:
        return [getattr(v, f.name) for f in dataclasses.fields(v)]  # type: ignore[arg-type]

    for other in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
        assert type(other) is type(value) and fields(other) == fields(value)


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


def test_make_delivery_builds_what_the_constructor_builds() -> None:
    """The readers' fast path (a builder twin, then ``__class__``) gives an
    ordinary, immutable ``Delivery``: same type, fields, repr, refusals."""
    args = ("s", "1-0", {b"k": b"v"}, None, 2, "0-1", None, 1, "m", "why", [b"k", b"v", b"k", b"v"])
    made, built = make_delivery(*args), Delivery(*args)
    assert type(made) is Delivery
    assert [getattr(made, f.name, "unset") for f in dataclasses.fields(made)] == [
        getattr(built, f.name, "unset") for f in dataclasses.fields(built)]
    assert repr(made) == repr(built) and made.field_list == built.field_list
    assert getattr(made, "error", None) is None  # unset, as the constructor leaves it
    for name in ("id", "not_a_field"):
        with pytest.raises(dataclasses.FrozenInstanceError, match="Delivery"):
            setattr(made, name, 1)
        with pytest.raises(dataclasses.FrozenInstanceError, match="Delivery"):
            delattr(made, name)
    short = make_delivery("s", None, {}, b"x", 1, "o")
    assert (short.raw, short.retries, short.mount, short.corrupt, short.flat) == (None, 0, "", None, None)


def test_builder_refuses_what_is_not_a_frozen_slotted_dataclass() -> None:
    @dataclasses.dataclass
    class Loose:
        x: int

    with pytest.raises(TypeError, match="frozen=True, slots=True"):
        builder(Loose)
