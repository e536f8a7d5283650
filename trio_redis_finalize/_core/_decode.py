"""Replies of reads turned into deliveries (sans-IO).

:func:`list_delivery` opens the envelope of a list element or a Pub/Sub
payload; a corrupt one, or one already past ``max_attempts``, comes with
the plan that finalizes it without a handler (its dead letter).
:func:`payload_deliveries` does it for the message replies of a Pub/Sub
read.
:func:`stream_deliveries` does the same for the entries of a stream read
(``XREADGROUP``, ``XCLAIM``, ``XAUTOCLAIM``): header fields, attempts, copies
another group wrote, entries deleted while pending.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._delivery import Delivery, _set_origin_id
from .._envelope import (
    GROUP_FIELD,
    MAGIC,
    ORIGIN_FIELD,
    RETRIES_FIELD,
    TRACEPARENT_FIELD,
    TRACESTATE_FIELD,
    CorruptEnvelope,
    unwrap,
)
from .._value import builder, setters
from ._finalize import Item
from ._plan import Plan, Target, attempt_of, content_origin, plan_dead, plan_foreign, plan_lost

__all__ = [
    "MESSAGE",
    "PMESSAGE",
    "Entry",
    "Foreign",
    "ForeignBuilder",
    "Original",
    "as_str",
    "foreign",
    "foreigns",
    "id_key",
    "list_deliveries",
    "list_delivery",
    "lost_entry",
    "open_envelope",
    "payload_deliveries",
    "read_entries",
    "stream_deliveries",
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
    stops there; None when there is none).  ``names``: channel names
    decoded so far (added to).  ``pattern``: the replies are a pattern
    subscription's (``pmessage``).

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


# -- streams ------------------------------------------------------------------

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


Entry = tuple[bytes, list[bytes] | None]
"""A stream entry as a read answers it: its id and flat field list (name,
value, ...); ``None`` for an entry deleted while pending (``XCLAIM``)."""

_HEADERS = frozenset((RETRIES_FIELD, ORIGIN_FIELD, GROUP_FIELD))
_SPECIAL = _HEADERS | {TRACEPARENT_FIELD, TRACESTATE_FIELD}
"""Field names an original without trace context has none of."""




def as_str(b: bytes | str) -> str:
    """A reply value as text."""
    return b.decode() if isinstance(b, bytes) else b


def id_key(eid: bytes | str) -> tuple[int, int]:
    """A stream id as ``(ms, seq)``, for ordering."""
    if isinstance(eid, str):
        eid = eid.encode()
    ms, _, seq = eid.partition(b"-")
    return int(ms), int(seq or 0)


def read_entries(reply: Any) -> list[Entry]:
    """The entries of an ``XREADGROUP`` reply for one stream (RESP2)."""
    if not reply:
        return []
    out: list[Entry] = reply[0][1]
    return out


def lost_entry(target: Target, entry_id: str) -> tuple[Delivery, Plan]:
    """An entry deleted from the stream while pending, and the plan that
    acknowledges it (counted ``lost_before_handling``); logged."""
    d = Delivery(target.source, entry_id, {}, None, 1, entry_id, None, 0, target.name)
    log.warning("%s: entry %s was deleted while pending; acknowledged", target.name, entry_id,
                extra={"subscription": target.name, "entry_id": entry_id, "attempt": 1})
    return d, plan_lost(target, d)


def _without_headers(flat: Sequence[bytes]) -> list[bytes]:
    """A flat field list without the header fields (name, value, ...)."""
    return [x for i in range(0, len(flat) - 1, 2) if flat[i] not in _HEADERS
            for x in (flat[i], flat[i + 1])]


def _body_of(flat: list[bytes], n: int) -> list[bytes]:
    """``_without_headers(flat)`` (``n``: its length); fast for a copy the
    library wrote: its headers last (``_plan._stream_copy_fields``), none in
    the body before them (two slices and a set test, no loop in Python)."""
    if n >= 6 and not n & 1:
        if flat[-6] == RETRIES_FIELD and flat[-4] == ORIGIN_FIELD and flat[-2] == GROUP_FIELD:
            if _HEADERS.isdisjoint(flat[0:n - 6:2]):
                return flat[:n - 6]
        elif (flat[-4] == RETRIES_FIELD and flat[-2] == ORIGIN_FIELD
              and _HEADERS.isdisjoint(flat[0:n - 4:2])):
            return flat[:n - 4]
    return _without_headers(flat)


def stream_deliveries(
    target: Target, entries: Sequence[Entry], counts: Mapping[bytes, int] | None = None,
) -> tuple[list[Delivery], list[tuple[Delivery, Plan]]]:
    """The deliveries of stream entries: those for the handlers, and those
    finalized without one, each with its plan.

    ``counts``: server delivery counts of the entries (recovered, claimed);
    an entry not in it was delivered once.  The header fields
    (:data:`RETRIES_FIELD`, :data:`ORIGIN_FIELD`, :data:`GROUP_FIELD`) are
    taken out of ``fields`` and ``flat`` (a repeated one: its last value
    counts, as in a mapping); the trace context (``traceparent``,
    ``tracestate``) out of ``fields`` only (``flat`` is what copies carry;
    ``field_list`` leaves it out); the attempt is ``max(retries + 1, count)``.
    Without a handler: a copy another group wrote (acknowledged as
    foreign), a corrupt retry counter or an attempt past ``max_attempts``
    (dead letter), an entry deleted while pending (acknowledged, lost).
    """
    ready: list[Delivery] = []
    direct: list[tuple[Delivery, Plan]] = []
    source = target.source
    name = target.name
    limit = target.max_attempts
    own_group = target.group.encode()
    append = ready.append
    special = _SPECIAL
    plain = _SPECIAL.isdisjoint
    blank: Any = OriginalBuilder  # called: a blank twin (``_value.builder``)
    original = Original
    for eid, flat in entries:
        # the common case, first: an original (no header, no trace context)
        # read once (attempt 1, within any max_attempts); its field map built
        # from the names tested (a repeated name keeps its last value, as in
        # dict(zip(...)))
        if flat is not None and (not counts or counts.get(eid, 1) == 1):
            n = len(flat)
            if n == 4:
                plain_names = flat[0] not in special and flat[2] not in special
            elif n == 2:
                plain_names = flat[0] not in special
            else:
                plain_names = not n & 1 and plain(flat[::2])
            if plain_names:
                # an Original (its field map made when first read), inline:
                # one per entry read
                d: Any = blank()
                d.source = source
                d.id = d.origin_id = eid.decode()
                d.data = d.raw = d.corrupt = d.error = None
                d.attempt = 1
                d.retries = 0
                d.mount = name
                d.flat = flat
                d.__class__ = original  # fields made when first read: frozen from here on
                append(d)
                continue
        entry_id = eid.decode()
        if flat is None:
            direct.append(lost_entry(target, entry_id))
            continue
        # the field map; a repeated name keeps its last value, as in dict(zip(...))
        n = len(flat)
        if n == 4:  # displays for the short field lists: about twice as fast
            fields = {flat[0]: flat[1], flat[2]: flat[3]}
        elif n == 2:
            fields = {flat[0]: flat[1]}
        elif n == 6:
            fields = {flat[0]: flat[1], flat[2]: flat[3], flat[4]: flat[5]}
        else:
            it = iter(flat)
            fields = dict(zip(it, it, strict=False))
        if TRACEPARENT_FIELD in fields or TRACESTATE_FIELD in fields:
            # the trace context: kept in ``flat`` (copies carry it), not shown to the handler
            fields.pop(TRACEPARENT_FIELD, None)
            fields.pop(TRACESTATE_FIELD, None)
        if RETRIES_FIELD not in fields and ORIGIN_FIELD not in fields and GROUP_FIELD not in fields:
            # an original: its field list as read is its own
            body, retries, origin, corrupt, group = flat, 0, entry_id, None, None
        else:
            retries, origin, corrupt = 0, entry_id, None
            raw_retries = fields.pop(RETRIES_FIELD, None)
            raw_origin = fields.pop(ORIGIN_FIELD, None)
            group = fields.pop(GROUP_FIELD, None)
            body = _body_of(flat, n)
            if raw_retries is not None:
                try:
                    retries = int(raw_retries)
                    if retries < 0:
                        raise ValueError
                except ValueError:
                    corrupt = f"corrupt {RETRIES_FIELD.decode()} header {raw_retries!r}"
                    retries = 0
            if raw_origin is not None:
                origin = raw_origin.decode("utf-8", "replace")
        count = counts.get(eid, 1) if counts else 1
        attempt = attempt_of(retries, count)
        d = Delivery(source, entry_id, fields, None, attempt, origin, None, retries, name, corrupt,
                     body)
        if group is not None and group != own_group:
            # a copy another group wrote (RETRY, delayed): that group handles it
            direct.append((d, plan_foreign(target, d)))
        elif corrupt is not None:
            direct.append((d, plan_dead(target, d, corrupt)))
        elif limit is not None and attempt > limit:
            direct.append((d, plan_dead(
                target, d, f"arrived at attempt {attempt}, past max_attempts={limit}")))
        else:
            ready.append(d)
    return ready, direct
