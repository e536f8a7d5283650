"""Replies of reads turned into deliveries (sans-IO): what every form shares.

:func:`list_delivery` opens the envelope of a list element or a Pub/Sub
payload; a corrupt one, or one already past ``max_attempts``, comes with
the plan that finalizes it without a handler (its dead letter).
:func:`payload_deliveries` does it for the message replies of a Pub/Sub
read.
:class:`Original` is what a stream entry read once becomes; the stream's
decoding itself (``XREADGROUP``, ``XCLAIM``, ``XAUTOCLAIM``: header fields,
attempts, copies another group wrote, entries deleted while pending) is in
``_core/stream/decode.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from redis import exceptions as rexc

from .._delivery import Delivery, _set_origin_id
from .._envelope import MAGIC, CorruptEnvelope, unwrap
from .._value import builder, setters
from ._gates import Item
from ._plan import plan_dead
from ._types import Plan, Target, content_origin

__all__ = [
    "MESSAGE",
    "PMESSAGE",
    "Foreign",
    "ForeignBuilder",
    "Original",
    "OriginalBuilder",
    "foreign",
    "foreigns",
    "list_deliveries",
    "list_delivery",
    "open_envelope",
    "payload_deliveries",
]

log = logging.getLogger("trio_redis_finalize")

_MAGIC_HEAD = MAGIC[:1]


def open_envelope(raw: bytes) -> tuple[bytes, int, str, str | None]:
    """``(body, retries, origin id, corrupt reason)`` of a list element or payload.

    A foreign payload (no envelope) is ``(raw, 0, content_origin(raw), None)``;
    a corrupt envelope is ``(raw, 0, content_origin(raw), reason)``.
    """
    try:
        body, retries, origin = unwrap(raw)
    except CorruptEnvelope as e:
        return raw, 0, content_origin(raw), f"corrupt envelope: {e}"
    return body, retries, origin if origin is not None else content_origin(raw), None


class Foreign(Delivery):
    """The delivery of a list element or Pub/Sub payload without envelope (a
    foreign one: what any other producer sends): attempt 1, and ``origin_id``
    -- a SHA-1 of the bytes (:func:`~._plan.content_origin`), about 0.7 µs -- is
    computed when first read instead of for every message received (an
    ACK or DROP never reads it; a ``retry_after`` copy, a log line, a
    handler that reads it do).  Nothing else differs: the value is a
    function of ``raw`` (immutable bytes), so it is the same whenever it is
    computed; once read it is an ordinary slot; a ``Delivery`` in every
    respect (``isinstance``, fields, copies, its repr and name).

    Every foreign delivery (:func:`foreigns`, and its inline copy in
    :func:`payload_deliveries`) also leaves unset the fields whose value all of
    them share (:data:`_SHARED`: ``fields``, empty; ``retries``, 0; ``corrupt``, ``error`` and ``flat``,
    None): set when first read, as ``origin_id`` is (``fields`` a new empty
    map of its own), so a message handled without reading them costs five
    stores and a dict less.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # called only for an unset slot: origin_id until first read, and the
        # shared ones every foreign delivery leaves unset
        if name == "origin_id":
            raw = self.raw
            assert raw is not None  # set by the reader, never unset
            origin = content_origin(raw)
            _set_origin_id(self, origin)
            return origin
        setter = _SHARED_SETTERS.get(name)
        if setter is not None:
            value = {} if name == "fields" else _SHARED[name]
            setter(self, value)
            return value
        raise AttributeError(f"{type(self).__qualname__!r} object has no attribute {name!r}",
                             name=name, obj=self)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled and copied as the Delivery it is (pickle finds no Foreign by its name)
        return _as_delivery, (Delivery.__getstate__(self),)


Foreign.__name__ = Foreign.__qualname__ = "Delivery"  # what a handler is told it got

_SHARED: dict[str, Any] = {"fields": None, "retries": 0, "corrupt": None, "error": None,
                           "flat": None}
"""The fields a :class:`Foreign` may leave unset, with their value (``fields``:
a new empty map each, made when first read)."""
_SHARED_SETTERS = dict(zip(_SHARED, setters(Delivery, *_SHARED), strict=True))


def _as_delivery(state: list[Any]) -> Delivery:
    """A :class:`Delivery` of the fields ``state`` (a :class:`Foreign` unpickled, copied)."""
    d = Delivery.__new__(Delivery)
    d.__setstate__(state)  # type: ignore[attr-defined]
    return d


ForeignBuilder = builder(Foreign)
"""A foreign delivery is filled in on this twin with plain slot stores (every
field but ``origin_id``), then becomes a :class:`Foreign` by ``__class__`` assignment (``_value.builder``;
about 0.37 µs a delivery, against 0.89 µs with the slot setters and 1.3 µs
with ``Delivery.__init__``)."""


_blank: Any = ForeignBuilder
"""Called, a blank twin (``_value.builder``: the C constructor, about a tenth
of a delivery cheaper than ``object.__new__(ForeignBuilder)``)."""


def foreigns(source: str, raws: Iterable[bytes], mount: str) -> list[Delivery]:
    """The deliveries of foreign bytes ``raws`` (no envelope: attempt 1, within
    any ``max_attempts``): :class:`Foreign` ones, each filled in on its twin
    (the readers' hot path: a call per read, not per element)."""
    out: list[Delivery] = []
    append = out.append
    blank = _blank
    cls = Foreign
    for raw in raws:
        d = blank()
        d.source = source
        d.id = None
        d.data = raw
        d.attempt = 1
        d.raw = raw
        d.mount = mount
        d.__class__ = cls  # the rest set when first read (_SHARED): frozen from here on
        append(d)
    return out


def foreign(source: str, raw: bytes, mount: str) -> Delivery:
    """The delivery of foreign bytes ``raw``: :func:`foreigns` of one."""
    return foreigns(source, (raw,), mount)[0]


def list_delivery(target: Target, source: str, raw: bytes) -> tuple[Delivery, Plan | None]:
    """The delivery of ``raw``, and the plan that finalizes it without a handler
    (corrupt envelope, or already past ``max_attempts``), if any."""
    if raw[:1] != _MAGIC_HEAD:  # cannot be an envelope: a foreign element
        return foreign(source, raw, target.name), None
    body, retries, origin, corrupt = open_envelope(raw)
    attempt = retries + 1  # attempt_of(retries): retries >= 0
    d = Delivery(source, None, {}, body, attempt, origin, raw, retries, target.name, corrupt)
    if corrupt is not None:
        what = "dead-lettered" if target.dead_letter is not None else "dropped"
        log.error("%s: %s in a %d-byte element from %r (origin %s); %s",
                  target.name, corrupt, len(raw), source, origin, what)
        return d, plan_dead(target, d, corrupt)
    limit = target.max_attempts
    if limit is not None and attempt > limit:
        return d, plan_dead(
            target, d, f"arrived at attempt {attempt}, past max_attempts={limit}"
        )
    return d, None




def list_deliveries(
    target: Target, source: str, raws: Sequence[bytes],
) -> tuple[list[Delivery], list[tuple[Delivery, Plan]]]:
    """:func:`list_delivery` of each of ``raws``, split: the deliveries for the
    handlers, and those finalized without one, each with its plan.

    The hot path of a reader: an element that cannot be an envelope (a
    foreign producer's, the common case) is attempt 1 -- never past any
    ``max_attempts`` (>= 1) -- a :class:`Foreign`, the digest of its bytes
    (its origin id) computed when first read (a read without any envelope:
    :func:`foreigns` of it all, one call); an envelope within
    ``max_attempts`` (the library's copies) is unwrapped here; the rest
    (corrupt, past ``max_attempts``, foreign bytes starting with 0xff) goes
    through :func:`list_delivery`.
    """
    name = target.name
    head = _MAGIC_HEAD
    direct: list[tuple[Delivery, Plan]] = []
    # none starts with the envelope's first byte (0xff): the largest is below it
    if not raws or max(raws) < head:
        return foreigns(source, raws, name), direct
    ready: list[Delivery] = []
    limit = target.max_attempts
    for raw in raws:
        if raw[:1] != head:
            ready += foreigns(source, (raw,), name)
            continue
        try:
            body, retries, origin = unwrap(raw)
        except CorruptEnvelope:
            origin = None
        if origin is not None and (limit is None or retries < limit):  # attempt <= limit
            ready.append(Delivery(source, None, {}, body, retries + 1, origin, raw, retries, name))
            continue
        d, p = list_delivery(target, source, raw)
        if p is None:
            ready.append(d)
        else:
            direct.append((d, p))
    return ready, direct


# -- Pub/Sub ------------------------------------------------------------------

MESSAGE = b"message"
"""The head of a channel subscription's message reply."""
PMESSAGE = b"pmessage"
"""The head of a pattern subscription's message reply."""
_MAGIC_BYTE = MAGIC[0]


def payload_deliveries(
    target: Target, names: dict[bytes, str], replies: Iterable[Any], *, pattern: bool = False,
) -> tuple[list[Delivery], list[Item], Any]:
    """The deliveries of Pub/Sub message replies (``[b"message", channel,
    data]``, a pattern's ``[b"pmessage", pattern, channel, data]``:
    :meth:`~._transport.PubSub.received`): those for the handlers, and those
    finalized without one (corrupt envelope, past ``max_attempts``) with
    their plan, as :func:`list_delivery` decides; and the
    first reply that is not a message of the subscription's kind (the loop
    stops there; None when there is none), or the ``InvalidResponse`` the
    replies raised (bytes that are not RESP after the messages read).
    ``names``: channel names decoded so far (added to).  ``pattern``: the
    replies are a pattern subscription's (``pmessage``).

    The hot path of the reader: one loop over what the parser gives (in C,
    a reply per step).  A payload without envelope (the common case) is a
    :func:`foreign` delivery (its digest computed when
    read), built here inline (a call per message less); the channel's name
    is looked up only when it changes (a run of messages on one channel
    compares bytes, no hash).  An envelope goes through
    :func:`list_deliveries`.
    """
    ready: list[Delivery] = []
    direct: list[Item] = []
    try:  # no cost unless raised (3.11)
        return _payload_loop(target, names, replies, pattern, ready, direct)
    except rexc.InvalidResponse as e:  # what follows the last message read is not RESP:
        return ready, direct, e  # the messages before it still go (the caller raises it)


def _payload_loop(
    target: Target, names: dict[bytes, str], replies: Iterable[Any], pattern: bool,
    ready: list[Delivery], direct: list[Item],
) -> tuple[list[Delivery], list[Item], Any]:
    """:func:`payload_deliveries`' loop, filling ``ready`` and ``direct``
    (kept by the caller when ``replies`` raises)."""
    mount = target.name
    kind = PMESSAGE if pattern else MESSAGE
    append = ready.append
    blank: Any = ForeignBuilder  # called: a blank twin (``_value.builder``)
    magic = _MAGIC_BYTE
    last: bytes | None = None
    name = ""
    for reply in replies:
        try:  # a list of its length unpacks at once (the interpreter's fast path)
            if pattern:
                head, _, channel, data = reply
            else:
                head, channel, data = reply
        except (TypeError, ValueError):  # an error reply, a pong ...: the caller's
            return ready, direct, reply
        if head != kind:  # a confirmation ...: not a message of this subscription's
            return ready, direct, reply
        if channel != last:
            got = names.get(channel)
            if got is None:
                got = names[channel] = channel.decode("utf-8", "replace")
            name = got
            last = channel
        if not data or data[0] != magic:  # cannot be an envelope: attempt 1, no plan
            # foreigns(name, (data,), mount), inline (the call per message: about
            # 2,200 instructions more, 1.18x the floor against 1.09x); what every foreign delivery
            # shares (fields, retries, corrupt, error, flat) is set when first
            # read, as origin_id is (Foreign)
            d: Any = blank()
            d.source = name
            d.id = None
            d.data = data
            d.attempt = 1
            d.raw = data
            d.mount = mount
            d.__class__ = Foreign  # frozen from here on
            append(d)
            continue
        more, plans = list_deliveries(target, name, (data,))
        ready += more
        direct += plans
    return ready, direct, None


# -- stream originals (the stream's decoding: _core/stream/decode.py) ---------

class Original(Delivery):
    """The delivery of a stream original read once (no header field, no trace
    context: attempt 1, its own origin): its field map is made from ``flat``
    when first read instead of for every entry read (an ACK or DROP never
    reads it; a handler that does pays the same dict, once, and a property
    call on each read).  As with :class:`Foreign`, nothing else differs:
    ``fields`` is a function of ``flat`` (which nothing changes), the same
    whenever it is made; a ``Delivery`` in every respect.

    A property rather than ``__getattr__`` (as :class:`Foreign` has): a class
    with a ``__getattr__`` makes every attribute read slower (the hook, no
    specialised slot load), and the finalizer reads every entry's ``id``.
    """

    __slots__ = ()

    @property
    def fields(self) -> Mapping[bytes, bytes]:
        try:
            return _get_fields(self)  # type: ignore[no-any-return]
        except AttributeError:  # not made yet
            it = iter(self.flat)  # type: ignore[arg-type]  # always set on an Original
            fields = dict(zip(it, it, strict=False))
            _set_fields(self, fields)
            return fields

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled and copied as the Delivery it is (pickle finds no Original by its name)
        return _as_delivery, (Delivery.__getstate__(self),)


Original.__name__ = Original.__qualname__ = "Delivery"  # what a handler is told it got
_get_fields = Delivery.__dict__["fields"].__get__
_set_fields, = setters(Delivery, "fields")

OriginalBuilder = builder(Original)
"""An :class:`Original` is filled in on this twin (``_value.builder``)."""
