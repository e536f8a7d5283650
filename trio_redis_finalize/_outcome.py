"""Outcomes a handler returns: ``ACK``, ``RETRY``, ``DROP``, ``retry_after(delay)``,
``REJECT`` / ``reject(reason)`` (or :class:`Rejected` raised); and
:class:`Backoff`, the default ``on_error`` of a mount."""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar, Final

from ._value import builder, immutable, setters
from ._writes import Write, checked_writes

__all__ = [
    "ACK", "DROP", "REJECT", "RETRY", "Backoff", "Outcome", "OutcomeKind", "Rejected", "WithWrites",
    "reject", "retry_after",
]


class OutcomeKind(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    DROP = "drop"
    RETRY_AFTER = "retry_after"
    REJECT = "reject"


@immutable
@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What to do with a delivery once its handler is done (immutable).

    Use the constants :data:`ACK`, :data:`RETRY`, :data:`DROP`,
    :data:`REJECT` or :func:`retry_after`, :func:`reject`; equal outcomes
    compare equal.
    """

    kind: OutcomeKind
    delay: float = 0.0
    reason: str = ""
    """Why a :func:`reject` dead-letters the delivery ("" for every other outcome)."""

    def __repr__(self) -> str:
        if self.kind is OutcomeKind.RETRY_AFTER:
            return f"retry_after({self.delay!r})"
        if self.kind is OutcomeKind.REJECT and self.reason:
            return f"reject({self.reason!r})"
        return self.kind.name

    @property
    def is_retry(self) -> bool:
        """Whether this is RETRY or retry_after (the message is to be handled again)."""
        return self.kind is OutcomeKind.RETRY or self.kind is OutcomeKind.RETRY_AFTER

    writes: ClassVar[tuple[Write, ...]] = ()
    """The writes it carries (none; see :meth:`with_writes`)."""
    write_parts: ClassVar[tuple[str | bytes | int, ...]] = ()
    """Its writes as a finalization script reads them, their count first (private)."""
    write_keys: ClassVar[tuple[str | bytes, ...]] = ()
    """The keys its writes touch, in order, each once (private)."""

    def with_writes(self, *writes: Sequence[object]) -> Outcome:
        """This outcome, carrying Redis writes committed with its finalization.

        ``return ACK.with_writes(("HINCRBY", "totals", "eur", 5))``: the
        finalization script checks that the delivery is still pending (in
        the group's PEL / the processing list), runs the writes, then
        finalizes it, as one atomic step on the server -- so the writes
        are applied once per finalized delivery, whatever is lost, refused,
        resent or raced (see the README, "Exactly-once effects").  Streams
        (every mode but a claiming RETRY, which finalizes nothing) and
        reliable lists; ACK, DROP, RETRY, ``retry_after``, REJECT and the
        dead letter a RETRY turns into at the last attempt.  Called on an
        outcome that carries writes already, adds to them (checked together).

        Raises:
            ValueError: a command that is not a deterministic write on
                declared keys (the user guide lists them), bad arguments, or
                more than the bounds allow (64 writes, 4,096 values, 1 MiB).
        """
        # (added to the writes it carries: checked with them, as one call
        # would: a key their writes make another type, the bounds)
        checked, parts, keys = checked_writes((*self.writes, *writes) if self.writes else writes)
        # built on its mutable twin (``_value.builder``: plain slot stores, no
        # Python ``__init__`` per outcome: a handler makes one per message)
        o = _WithWritesBuilder()
        o.kind = self.kind
        o.delay = self.delay
        o.reason = self.reason
        o.writes = checked
        o.write_parts = parts
        o.write_keys = keys
        o.__class__ = WithWrites  # frozen from here on
        made: WithWrites = o
        return made


ACK: Final = Outcome(OutcomeKind.ACK)
"""Handled: remove the delivery for good."""
RETRY: Final = Outcome(OutcomeKind.RETRY)
"""Handle again as soon as possible (a copy with the retry counter one higher)."""
DROP: Final = Outcome(OutcomeKind.DROP)
"""Give up on the delivery without handling it: removed like ACK, counted apart."""
REJECT: Final = Outcome(OutcomeKind.REJECT)
"""It can never succeed: dead-letter it now, whatever the attempt (see :func:`reject`)."""


def reject(reason: str) -> Outcome:
    """Dead-letter the delivery now, with ``reason``: it can never succeed.

    Like BullMQ's ``UnrecoverableError`` or Celery's ``Reject``: no further
    attempt, whatever ``max_attempts``.  The delivery is copied to the
    subscription's dead letter (the reason in its ``trf-dead-reason`` field,
    or in the reliable list's reason record: ``rejected: <reason>``), then
    removed -- one gated step, like a dead letter at the last attempt.  A
    handler may also raise :class:`Rejected`.  Streams (every mode) and
    reliable lists with a dead letter (the default); refused with
    :class:`~trio_redis_finalize.AckUnsupported` where there is none (simple
    lists, Pub/Sub, ``dead_letter=None``): the delivery then stays where it
    is.  Carries writes like the others (``reject("bad").with_writes(...)``).

    Raises:
        ValueError: ``reason`` is not a string.
    """
    if not isinstance(reason, str):
        raise ValueError(f"reason must be a string, got {reason!r}")
    return Outcome(OutcomeKind.REJECT, 0.0, reason)


class Rejected(Exception):  # an outcome raised, not an error: like Celery's Reject
    """Raised by a handler (or code it calls): dead-letter the delivery now.

    ``raise Rejected("malformed order")`` is ``return reject("malformed
    order")``: logged at WARNING (one line, no traceback), not a handler
    error, not retried.  The reason is ``str(exc)``.
    """


@immutable
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class WithWrites(Outcome):
    """An outcome with writes (made by :meth:`Outcome.with_writes`)."""

    writes: tuple[Write, ...] = ()  # type: ignore[misc]  # a slot over Outcome's ClassVar
    # what the finalization script reads of them, made with them (``_writes.checked_writes``)
    write_parts: tuple[str | bytes | int, ...] = dataclasses.field(  # type: ignore[misc]
        default=(), compare=False, repr=False)
    write_keys: tuple[str | bytes, ...] = dataclasses.field(  # type: ignore[misc]
        default=(), compare=False, repr=False)

    def __repr__(self) -> str:
        return f"{Outcome.__repr__(self)}.with_writes({', '.join(map(repr, self.writes))})"


_WithWritesBuilder: Any = builder(WithWrites)  # (Any: its fields assigned, which the type refuses)


def retry_after(delay: float) -> Outcome:
    """Handle again after ``delay`` seconds (the user guide's "Delayed retry" gives the three ways).

    Raises:
        ValueError: ``delay`` is negative, NaN or infinite.
    """
    delay = float(delay)
    if not math.isfinite(delay) or delay < 0:
        raise ValueError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    return Outcome(OutcomeKind.RETRY_AFTER, delay)


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return seconds


def _window(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"window must be a number of seconds >= 0, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"window must be a finite number of seconds >= 0, got {value!r}")
    return seconds


# ``init=False``: the ``__init__`` below validates and normalises (see ``_value``).
@immutable
@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Backoff:
    """``on_error`` (the default): a failed delivery stays pending and is
    delivered again later, by the same consumer.

    ``consumer.mount(..., on_error=Backoff(base=0.1, cap=30.0, window=30.0))``.
    When the handler raises (or returns something that is not an outcome) on
    attempt ``n``, the delivery stays where it is -- in the group's PEL
    (streams, every mode) or in the processing list (reliable lists) -- and
    after a wait it is delivered again as attempt ``n + 1``.  The wait is
    ``floor(n) + uniform(0, min(cap, base * 2 ** (n - 1)))`` seconds: the
    capped exponential with full jitter, plus a floor that spreads the
    attempts over ``window`` seconds when the subscription has
    ``max_attempts = m``::

        floor(n) = window * 2 ** (n - 1) / (2 ** (m - 1) - 1)    for 1 <= n < m

    The ``m - 1`` waits before the last attempt then add up to at least
    ``window``: a dead letter (or a drop) never comes sooner than ``window``
    seconds after the first failure, so an outage shorter than that does not
    dead-letter what it made fail.  With ``m = 3`` the floors are 10 s and
    20 s, with ``m = 2`` one of 30 s; with a large ``m`` the first retries
    stay short (``m = 10``: 0.06 s, 0.12 s, ..., 15 s).  Without
    ``max_attempts`` there is no floor (nothing ends the retries anyway);
    ``window=0`` turns the floor off.

    The schedule outlives the process: when a delivery starts waiting, its
    due time (by the server's clock) and the attempt that failed are written
    to a sorted set beside the source (``{stream}:backoff:<group>``, or
    ``<processing list>:backoff``; each expires a minute after its last due
    time).  A consumer that restarts (gracefully or after a crash) -- or
    that claims the entry of a stopped consumer, or takes over a dead or
    stopped consumer's work -- lets a delivery still
    waiting wait out the rest, then delivers it as its next attempt; only a
    stop between the failure and that write (one round trip) loses the
    schedule, and the delivery is then recovered at once, as before.

    No copy is written, a crash loses nothing (the delivery is still
    pending), and a message that always fails is handled a handful of times
    a minute, never in a hot loop.  ``max_attempts`` and ``dead_letter``
    apply as to a ``RETRY``.  On simple lists and Pub/Sub (nothing to leave
    pending) a ``Backoff`` drops the message, with the error logged.

    Immutable; equal values compare equal.

    Args:
        base: seconds; the random part's ceiling after the first failed attempt.
        cap: seconds; the random part is never longer (at least ``base``).
        window: seconds; with ``max_attempts``, the least time from the
            first failed attempt to the last attempt (0: no floor).

    Raises:
        ValueError: ``base`` or ``cap`` is not a finite number of seconds
            above 0, ``cap`` is below ``base``, or ``window`` is not a
            finite number of seconds >= 0 (the message names it).
    """

    base: float
    cap: float
    window: float

    def __init__(self, base: float = 0.1, cap: float = 30.0, window: float = 30.0) -> None:
        b = _seconds("base", base)
        c = _seconds("cap", cap)
        if c < b:
            raise ValueError(f"cap must be >= base ({b!r} s), got {cap!r}")
        w = _window(window)
        _set_base(self, b)
        _set_cap(self, c)
        _set_window(self, w)

    def ceiling(self, attempt: int) -> float:
        """The random part's longest value after failed attempt ``attempt``:
        ``min(cap, base * 2 ** (attempt - 1))``."""
        exponent = max(attempt - 1, 0)
        if exponent >= 1024:  # 2.0 ** 1024 overflows; base * 2 ** 1024 exceeds any finite cap
            return self.cap
        return min(self.cap, self.base * 2.0**exponent)

    def floor(self, attempt: int, max_attempts: int | None) -> float:
        """The shortest wait after failed attempt ``attempt`` when the
        subscription has ``max_attempts``: ``window * 2 ** (attempt - 1) /
        (2 ** (max_attempts - 1) - 1)`` before the last attempt, else 0."""
        if max_attempts is None or not self.window or not 1 <= attempt < max_attempts:
            return 0.0
        # window * 2**(a-1) / (2**(m-1) - 1), scaled by 2**-(m-1): no overflow for a large m
        return math.ldexp(self.window, attempt - max_attempts) / (
            1.0 - math.ldexp(1.0, 1 - max_attempts))

    def delay(self, attempt: int, max_attempts: int | None = None) -> float:
        """A wait after failed attempt ``attempt``: ``floor(attempt,
        max_attempts)`` plus a uniform draw in ``[0, ceiling(attempt)]``."""
        return self.floor(attempt, max_attempts) + random.uniform(0.0, self.ceiling(attempt))


_set_base, _set_cap, _set_window = setters(Backoff, "base", "cap", "window")
