"""Which attempt a stream entry counts when the reader takes it again, sans-IO.

The attempt of a stream delivery is ``max(header retries + 1, server
delivery count)`` (``_core._plan.attempt_of``); the reader keeps the server
count honest whenever it takes an entry of its own PEL again, sets a count
back, or claims one.  The rules are written here, once each, as pure
functions of ``(id, count)`` pairs; ``_forms/stream/own_pel.py`` sends the
commands they shape:

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
  its count set one lower, ``XCLAIM ... RETRYCOUNT n-1`` (:func:`give_back`);
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

from collections.abc import Iterable, Mapping
from typing import TypeVar

from .._commands import Command
from .._types import Effect, Plan
from .decode import id_key

__all__ = [
    "AS_IS", "as_handed", "claimed_waiting", "give_back", "given_back", "lapsed_own",
    "recovered", "redelivered", "waiting",
]

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


def give_back(stream: str, group: str, me: str, items: Iterable[tuple[I, int]]) -> Plan | None:
    """The ``XCLAIM ... RETRYCOUNT n JUSTID`` commands (one per count) that give
    ``items`` (id, delivery count now) back to ``me``'s PEL uncounted
    (:func:`given_back`); None when there is nothing to give back."""
    by_count: dict[int, list[I]] = {}
    for eid, n in given_back(items):
        by_count.setdefault(n, []).append(eid)
    commands: list[Command] = []
    for n, ids in by_count.items():
        commands.append(("XCLAIM", stream, group, me, 0, *ids, "RETRYCOUNT", n, "JUSTID"))
    return Plan(Effect.NOTHING, tuple(commands)) if commands else None


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
