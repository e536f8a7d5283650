"""The package's one convention for immutable values.

Every value object -- a subscription, a resolved ``Target``, a ``Plan``, a
``Delivery``, an ``Outcome``, a ``Backoff``, a shutdown ``Budget`` -- is a
``@dataclasses.dataclass(frozen=True, slots=True)``: fields declared once,
``copy`` and ``pickle`` through the dataclass machinery, ``dataclasses.fields()``
and ``replace()`` available, assignment and deletion refused with
:class:`dataclasses.FrozenInstanceError` (an ``AttributeError``).  Over the
dataclass decorator, :func:`immutable` makes that refusal hold for every name
(on CPython 3.11 the generated ``__setattr__`` of a ``slots=True`` class raises
``TypeError`` for a name that is not a field).

The generated ``__init__`` (with ``__post_init__`` for validation) is used
where it fits.  Where it does not -- validation that normalises the values
(``Backoff``), a ``*channels`` signature (``ChannelSubscription``), or an
object built for every message read (``Delivery``, ``Plan``: see
:func:`builder` below), whose frozen ``__init__`` would cost one
``object.__setattr__`` per field -- the class says ``init=False`` and its
own ``__init__`` sets the fields with the slot setters :func:`setters`
returns.

Measured on CPython 3.11 (a ``Delivery`` of 11 arguments, ``timeit``): plain
``__slots__`` with ``self.x = v`` about 0.45-0.60 µs, the frozen dataclass's
generated ``__init__`` about 2.3 µs, ``init=False`` with the setters about
0.8-1.1 µs.

Where even the setters cost too much (a ``Delivery`` for every entry a
stream read returns, a ``Plan`` for every RETRY), :func:`builder` gives the class a private mutable
twin: a subclass that adds no slot and no behaviour but plain assignment.
A new object is made as a twin, its fields assigned plainly (the
interpreter's specialised slot stores), then its ``__class__`` set to the
value class: from then on it is an ordinary frozen instance (same layout,
same type, assignment refused).  About 0.3 µs for the 11 fields of a
``Delivery``; a ``Plan`` of 6 fields 0.27 µs through its ``__init__`` on
the twin (0.36 with the setters).  ``builder(cls, init=True)`` writes that
``__init__`` for the class (generated from its fields, as ``dataclasses``
generates its own; the signature stays the dataclass's), so no class spells
its stores out by hand.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

__all__ = ["builder", "immutable", "setters"]

_C = TypeVar("_C", bound=type)


def immutable(cls: _C) -> _C:
    """Over ``@dataclasses.dataclass(frozen=True, slots=True)``: assigning or
    deleting any attribute raises :class:`dataclasses.FrozenInstanceError`
    naming the class and the attribute.

    Raises:
        TypeError: ``cls`` is not a frozen slotted dataclass.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__qualname__}: @immutable goes over @dataclass(frozen=True, slots=True)")

    def __setattr__(self: object, name: str, value: object) -> NoReturn:
        raise dataclasses.FrozenInstanceError(
            f"{type(self).__qualname__} is immutable: cannot assign to {name!r}")

    def __delattr__(self: object, name: str) -> NoReturn:
        raise dataclasses.FrozenInstanceError(
            f"{type(self).__qualname__} is immutable: cannot delete {name!r}")

    for f in (__setattr__, __delattr__):
        f.__qualname__ = f"{cls.__qualname__}.{f.__name__}"
        setattr(cls, f.__name__, f)
    return cls


def setters(cls: type, *names: str) -> tuple[Callable[[Any, Any], None], ...]:
    """The ``__set__`` of the slots ``names`` of ``cls``, in that order.

    ``setter(obj, value)`` stores ``value`` in the slot of ``obj`` without
    going through ``__setattr__`` (which a frozen class refuses): for the
    ``__init__`` of a frozen slotted dataclass made with ``init=False``.  Take
    them after the class is decorated (``slots=True`` makes a new class).

    Raises:
        TypeError: ``cls`` has no slot of that name.
    """
    out = []
    for name in names:
        slot = next((k.__dict__[name] for k in cls.__mro__ if name in k.__dict__), None)
        if not isinstance(slot, types.MemberDescriptorType):
            raise TypeError(f"{cls.__qualname__} has no slot {name!r}")
        out.append(slot.__set__)
    return tuple(out)


def builder(cls: _C, *, init: bool = False) -> _C:
    """A private mutable twin of the frozen slotted class ``cls`` (see the
    module docstring): instances of the twin take plain assignments, and
    become instances of ``cls`` -- immutable -- once their ``__class__`` is
    set to it::

        b = _Twin()               # blank (or object.__new__(_Twin))
        b.x = x                   # each field (a slot of ``cls``)
        b.__class__ = cls         # frozen from here on

    The twin adds no slot, so the layouts match and ``__class__`` may be set.
    It is never to escape half-built: set every field, then the class.

    ``init``: also replace the dataclass's generated ``__init__`` of ``cls``
    (same signature: what type checkers see) with one that does this on the
    new object itself (:func:`_twin_init`), for a class built for every
    message.

    Raises:
        TypeError: ``cls`` is not an :func:`immutable` frozen slotted dataclass.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__qualname__}: builder() takes a @dataclass(frozen=True, slots=True)")
    twin = type(f"_{cls.__name__}Builder", (cls,), {
        "__slots__": (),
        # the generic C slot functions: plain (specialised) slot stores
        "__setattr__": object.__setattr__,
        "__delattr__": object.__delattr__,
        # ``_Twin()`` makes a blank one (no ``object.__new__`` wrapper to call)
        "__init__": object.__init__,
        "__module__": cls.__module__,
        "__qualname__": f"_{cls.__qualname__}Builder",
    })
    if init:
        _twin_init(cls, twin)
    return twin  # type: ignore[return-value]


def _twin_init(cls: type, twin: type) -> None:
    """Give ``cls`` an ``__init__`` of its dataclass signature that sets the
    new object's class to ``twin``, stores every field plainly (the
    ``init=False`` ones: their default) and sets the class back: frozen from
    here on.  Generated as ``dataclasses`` generates its own (one
    ``exec``), so that each class's stores are straight-line code.

    Raises:
        TypeError: a field has a ``default_factory`` (not supported here).
    """
    params: list[str] = []
    body = ["    cls = self.__class__", "    _setattr(self, '__class__', _twin)"]
    env: dict[str, Any] = {"_setattr": object.__setattr__, "_twin": twin}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__qualname__}.{f.name}: builder(init=True) takes no default_factory")
        if f.default is not dataclasses.MISSING:
            env[f"_d_{f.name}"] = f.default
        elif not f.init:
            raise TypeError(f"{cls.__qualname__}.{f.name}: builder(init=True) needs a default for init=False")
        if f.init:
            params.append(f.name if f.default is dataclasses.MISSING else f"{f.name}=_d_{f.name}")
            body.append(f"    self.{f.name} = {f.name}")
        else:
            body.append(f"    self.{f.name} = _d_{f.name}")
    body.append("    self.__class__ = cls")
    src = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body) + "\n"
    exec(src, env)  # generated from the class's own fields, as dataclasses does
    fn = env["__init__"]
    generated = cls.__dict__["__init__"]  # the dataclass's: its annotations, for the docs
    fn.__annotations__ = dict(generated.__annotations__)
    fn.__qualname__ = f"{cls.__qualname__}.__init__"
    fn.__module__ = cls.__module__
    cls.__init__ = fn  # type: ignore[misc]
