"""Stream entries turned into deliveries (sans-IO): the stream's half of decoding.

:func:`stream_deliveries` decodes the entries of a stream read
(``XREADGROUP``, ``XCLAIM``, ``XAUTOCLAIM``): header fields, attempts,
copies another group wrote, entries deleted while pending
(:func:`lost_entry`); :func:`read_entries`, :func:`id_key` and
:func:`as_str` read the replies around them.  The stream reader
(``_forms/stream``) and the stream's liveness rules (``liveness``) call it.
What every form shares (the :class:`~.._decode.Original` an entry read once
becomes, the envelope of list elements and payloads) stays in
``_core/_decode.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..._delivery import Delivery
from ..._envelope import GROUP_FIELD, ORIGIN_FIELD, RETRIES_FIELD, TRACEPARENT_FIELD, TRACESTATE_FIELD
from .._decode import Original, OriginalBuilder
from .._plan import plan_dead, plan_foreign, plan_lost
from .._types import Plan, Target, attempt_of

__all__ = ["Entry", "as_str", "id_key", "lost_entry", "read_entries", "stream_deliveries"]

log = logging.getLogger("trio_redis_finalize")


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
