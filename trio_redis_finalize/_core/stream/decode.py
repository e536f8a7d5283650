"""Stream entries turned into deliveries, and the attempt each counts (sans-IO).

:func:`stream_deliveries` decodes the entries of a stream read
(``XREADGROUP``, ``XCLAIM``, ``XAUTOCLAIM``): header fields, attempts,
copies another group wrote, entries deleted while pending
(:func:`lost_entry`); :func:`read_entries`, :func:`id_key` and
:func:`as_str` read the replies around them, :func:`parse_reap` the reply of
the reaper's script (``liveness.REAP``: a dead consumer's entries it took).  The stream reader
(``_forms/stream``) and the stream's liveness rules (``liveness``) call it.
What every form shares (the :class:`~.._decode.Original` an entry read once
becomes, the envelope of list elements and payloads) stays in
``_core/_decode.py``.

The attempt of a stream delivery is ``header retries + server delivery
count`` (``_core._types.attempt_of``, read here: every delivery of a copy
counts, a crash during its handler too), past
``max_attempts`` a dead letter; the reader keeps the server count honest
whenever it takes an entry of its own PEL again, sets a count back, or
claims one.  Those rules are written below, once each, as pure functions
of ``(id, count)`` pairs; ``_forms/stream/own_pel.py`` and
``_forms/stream/pending.py`` send the commands they shape:

* :func:`recovered`: the own-PEL recovery (``XPENDING`` then ``XCLAIM ...
  RETRYCOUNT n``): at a (re)start one more than the server count (a crash
  may have cut a handler); later, an entry above the last id the reader was
  handed came from a read whose reply was lost (never handled, its count
  stays), one at or below it was handed before and is handed again (one
  more; CLAIMING leaves it: its PEL holds its delayed retries); an entry
  being taken over when a failure cut in counts as it was being taken
  (:data:`AS_IS`: its claim counted it already) -- no bump twice;
* :func:`given_back`: a delivery handed back unstarted (a stop, a cancelled
  hand-over, an own entry a claim took while its handler still runs) has
  its count set one lower (:func:`give_back`: :data:`GIVE_BACK`, ``XCLAIM
  ... RETRYCOUNT n-1`` only while it is still pending for this consumer at
  the count it was handed with, so a claim another consumer made meanwhile
  keeps its entry); a claimed entry that waits out its Backoff is set back
  to the attempt that failed (:func:`set_back_claimed`, the same script);
* :func:`as_handed`, :func:`lapsed_own`, :func:`claimed_waiting`: the count
  each kind of entry is given back from;
* :func:`waiting`: a recovered or claimed entry whose Backoff is not due is
  held as the attempt that failed;
* :func:`redelivered`: a Backoff redelivery (``scripts.REDELIVER``) sets the
  count to the attempt about to be made, ``RETRYCOUNT attempt+1``.

What is left uncounted or counted once too often is said in
``StreamSubscription``'s docstring ("Attempts count ...").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ..._delivery import Delivery
from ..._envelope import GROUP_FIELD, ORIGIN_FIELD, RETRIES_FIELD, TRACEPARENT_FIELD, TRACESTATE_FIELD
from .._commands import Arg, Command, Script
from .._decode import Original, OriginalBuilder
from .._plan import plan_dead, plan_foreign, plan_lost
from .._types import Effect, Plan, Target, attempt_of

__all__ = [
    "AS_IS", "GIVE_BACK", "GIVE_BACK_PER_CALL", "Entry", "Reaped", "as_handed", "as_str",
    "claimed_waiting", "give_back", "given_back", "id_key", "lapsed_own", "lost_entry",
    "parse_reap", "read_entries", "recovered", "redelivered", "retries_of", "set_back_claimed",
    "stream_deliveries", "waiting",
]

log = logging.getLogger("trio_redis_finalize")


Entry = tuple[bytes, list[bytes] | None]
"""A stream entry as a read answers it: its id and flat field list (name,
value, ...); ``None`` for an entry deleted while pending (``XCLAIM``)."""

_HEADERS = frozenset((RETRIES_FIELD, ORIGIN_FIELD, GROUP_FIELD))
_SPECIAL = _HEADERS | {TRACEPARENT_FIELD, TRACESTATE_FIELD}
"""Field names an original without trace context has none of."""




def retries_of(flat: Sequence[bytes] | None) -> int:
    """The retry counter of an entry's field list (its last ``RETRIES_FIELD``; 0 without
    one, or a corrupt one)."""
    r = 0
    if flat is not None:
        for k, v in zip(flat[::2], flat[1::2], strict=False):
            if k == RETRIES_FIELD:
                try:
                    r = max(int(v), 0)
                except ValueError:
                    r = 0
    return r


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


@dataclasses.dataclass(frozen=True, slots=True)
class Reaped:
    """A reply of the reaper's script (``liveness.REAP``): the dead
    consumer's entries it took, with their delivery counts."""

    entries: list[Entry]
    counts: dict[bytes, int]
    """Each taken entry's delivery count now (the attempt it counts)."""
    gone: list[bytes]
    wait: float | None
    """Seconds until the next entry left is idle enough (None: none left to wait for)."""
    forgotten: bool


def parse_reap(reply: Any) -> Reaped | None:
    """A ``liveness.REAP`` reply; None when the consumer's heartbeat came back."""
    if not isinstance(reply, list):
        return None
    taken, gone, wait, forgotten = reply
    entries: list[Entry] = [(t[0], t[1]) for t in taken]
    counts = {t[0]: int(t[2]) for t in taken}
    return Reaped(entries, counts, list(gone), None if int(wait) < 0 else int(wait) / 1000,
                  bool(forgotten))


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
    ``field_list`` leaves it out); the attempt is ``retries + count``.
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


# -- the attempt an entry taken again counts (see the module docstring) ------------

I = TypeVar("I", bound=bytes | str)  # noqa: E741 - an entry id, as the reply or the delivery has it

AS_IS: None = None
"""The attempt an entry being taken over counts when a claim took it (the
claim counted it already): the server count as it is."""


def recovered(rows: Iterable[tuple[bytes, int]], *, start: bool, last: bytes | None,
              claiming: bool, taking: Mapping[bytes, int | None]) -> list[tuple[bytes, int]]:
    """The own pending entries a recovery takes, each with the attempt it counts.

    ``rows``: (id, server delivery count) of own pending entries that no
    handler holds and no Backoff keeps waiting.  ``start``: the first look
    after a (re)start (so is any look of a reader that knows no ``last``,
    the greatest id it was handed).  ``claiming``: CLAIMING mode (an entry at
    or below ``last`` is left out).  ``taking``: entries being taken over,
    with the attempt each was being taken at (:data:`AS_IS`: the count as it
    is).  Every attempt is at least 1.
    """
    start = start or last is None
    top = id_key(last) if last is not None else (-1, -1)
    out: list[tuple[bytes, int]] = []
    for eid, count in rows:
        n = count
        if eid in taking:
            n = taking[eid] or n
        elif start:
            n += 1
        elif id_key(eid) <= top:
            if claiming:
                continue
            n += 1
        out.append((eid, max(n, 1)))
    return out


def given_back(items: Iterable[tuple[I, int]]) -> list[tuple[I, int]]:
    """(id, its delivery count now) -> (id, the count it is set back to): one
    less (at least 0), the handler call it reckoned never happened."""
    return [(eid, max(n - 1, 0)) for eid, n in items]


# KEYS: stream
# ARGV: group, consumer, [id, count, n]... (count: the delivery count the
#   entry was handed with; n: the count it is set back to, see given_back)
# The give-back (give_back), checked and done in one step: each entry still
# pending for the consumer at delivery count ``count`` is claimed by it again
# (idle 0, ``JUSTID``) with its count set to ``n``.  One pending for another
# consumer (a claim took it meanwhile: that consumer's delivery now, which a
# plain ``XCLAIM ... 0`` would take back and count lower), for nobody
# (finalized, deleted), or at another count (set back already: a resend, or
# the stop's second give-back) is left as it is.  For each id: 1 set back, 0
# left.  (As ``scripts.REDELIVER``, which sets the count of a Backoff
# redelivery.)
GIVE_BACK = Script(
    """
local out = {}
for i = 3, #ARGV, 3 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 1 and p[1][4] == tonumber(ARGV[i + 1]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'RETRYCOUNT', ARGV[i + 2], 'JUSTID')
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
""",
    name="stream_give_back", keys=("stream",), argv=("group", "consumer", "[id, count, n]..."),
)
GIVE_BACK_PER_CALL = 500
"""Entries per :data:`GIVE_BACK` call: a long give-back does not hold the
server in one script (as the lease's calls)."""


def give_back(stream: str, group: str, me: str, items: Iterable[tuple[I, int]]) -> Plan | None:
    """The :data:`GIVE_BACK` calls (one per :data:`GIVE_BACK_PER_CALL` items)
    that give ``items`` (id, the delivery count ``me`` knows it at: handed
    with, or set by its own claim) back to ``me``'s PEL uncounted
    (:func:`given_back`), each only while still pending for ``me`` at that
    count; None when there is nothing to give back.  Safe to send again (a
    second call finds the count set back and leaves it)."""
    items = list(items)
    commands: list[Command] = []
    for i in range(0, len(items), GIVE_BACK_PER_CALL):
        part = items[i:i + GIVE_BACK_PER_CALL]
        args: list[Arg] = [group, me]
        for (eid, count), (_, n) in zip(part, given_back(part), strict=True):
            args += [eid, count, n]
        commands.append(GIVE_BACK.command((stream,), args))
    return Plan(Effect.NOTHING, tuple(commands)) if commands else None


def set_back_claimed(stream: str, group: str, me: str, items: Iterable[tuple[I, int]]) -> Plan | None:
    """The :data:`GIVE_BACK` calls that set the counts of entries ``me`` has
    just claimed one lower (``items``: id, the count it is given back from,
    :func:`claimed_waiting`'s), each only while still pending for ``me`` at
    that count: a peer in RECLAIM or CLAIMING that claimed one between this
    claim and its set-back (``me`` stalled past ``min_idle`` while reading
    the counts and the schedule) keeps it, at its count (a plain ``XCLAIM``
    would take it back and lower it); None when there is nothing to set back."""
    return give_back(stream, group, me, items)


def as_handed(ids: Iterable[I], counts: Mapping[I, int]) -> list[tuple[I, int]]:
    """Deliveries handed over and never started: each with the count it was
    handed with (``counts``; one not in it was delivered once)."""
    return [(eid, counts.get(eid, 1)) for eid in ids]


def lapsed_own(ids: Iterable[bytes], counts: Mapping[bytes, int]) -> list[tuple[bytes, int]]:
    """Entries still being handled here that a claim took (their lease lapsed):
    each with its count now (2 when unknown: the claim counted one more
    than the first delivery); given back, the claim did not count."""
    return [(eid, counts.get(eid, 2)) for eid in ids]


def waiting(left: Mapping[I, tuple[float, int]]) -> dict[I, int]:
    """Entries whose Backoff is not due (``left``: id -> (seconds left, the
    attempt that failed)): the attempt each is held as (at least 1)."""
    return {eid: max(a, 1) for eid, (_, a) in left.items()}


def claimed_waiting(ids: Iterable[I], left: Mapping[I, tuple[float, int]]) -> list[tuple[I, int]]:
    """Claimed entries that wait out their Backoff: the count each is given back
    from, one above the attempt that failed (the claim counted a delivery
    that did not happen), so it is set back to that attempt."""
    return [(eid, left[eid][1] + 1) for eid in ids]


def redelivered(items: Iterable[tuple[I, int]]) -> list[tuple[I, int]]:
    """(id, the attempt that failed) -> (id, the attempt about to be made), the
    delivery count a Backoff redelivery sets (``RETRYCOUNT attempt+1``): a
    crash during it, or before it, counts."""
    return [(eid, a + 1) for eid, a in items]
