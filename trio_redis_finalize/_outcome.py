"""Outcomes a handler returns: ``ACK``, ``RETRY``, ``DROP``, ``retry_after(delay)``;
and :class:`Backoff`, the default ``on_error`` of a mount."""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Sequence
from typing import ClassVar, Final

from ._value import immutable, setters
from ._writes import Write, check_writes

__all__ = ["ACK", "DROP", "RETRY", "Backoff", "Outcome", "OutcomeKind", "WithWrites", "retry_after"]


class OutcomeKind(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    DROP = "drop"
    RETRY_AFTER = "retry_after"


@immutable
@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What to do with a delivery once its handler is done (immutable).

    Use the constants :data:`ACK`, :data:`RETRY`, :data:`DROP` or
    :func:`retry_after`; equal outcomes compare equal.
    """

    kind: OutcomeKind
    delay: float = 0.0

    def __repr__(self) -> str:
        if self.kind is OutcomeKind.RETRY_AFTER:
            return f"retry_after({self.delay!r})"
        return self.kind.name

    @property
    def is_retry(self) -> bool:
        """Whether this is RETRY or retry_after (the message is to be handled again)."""
        return self.kind is OutcomeKind.RETRY or self.kind is OutcomeKind.RETRY_AFTER

    writes: ClassVar[tuple[Write, ...]] = ()
    """The writes it carries (none; see :meth:`with_writes`)."""

    def with_writes(self, *writes: Sequence[object]) -> Outcome:
        """This outcome, carrying Redis writes committed with its finalization.

        ``return ACK.with_writes(("HINCRBY", "totals", "eur", 5))``: the
        finalization script checks that the delivery is still pending (in
        the group's PEL / the processing list), runs the writes, then
        finalizes it, as one atomic step on the server -- so the writes
        are applied once per finalized delivery, whatever is lost, refused,
        resent or raced (see the README, "Exactly-once effects").  Streams
        (every mode but a claiming RETRY, which finalizes nothing) and
        reliable lists; ACK, DROP, RETRY, ``retry_after`` and the dead
        letter a RETRY turns into at the last attempt.  Called on an
        outcome that carries writes already, adds to them.

        Raises:
            ValueError: a command that is not a deterministic write on
                declared keys (see ``WRITE_COMMANDS``), bad arguments, or
                more than the bounds allow (64 writes, 4,096 values, 1 MiB).
        """
        checked = check_writes(writes)
        return WithWrites(self.kind, self.delay, (*self.writes, *checked))


ACK: Final = Outcome(OutcomeKind.ACK)
"""Handled: remove the delivery for good."""
RETRY: Final = Outcome(OutcomeKind.RETRY)
"""Handle again as soon as possible (a copy with the retry counter one higher)."""
DROP: Final = Outcome(OutcomeKind.DROP)
"""Give up on the delivery without handling it: removed like ACK, counted apart."""


@immutable
@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class WithWrites(Outcome):
    """An outcome with writes (made by :meth:`Outcome.with_writes`)."""

    writes: tuple[Write, ...] = ()  # type: ignore[misc]  # a slot over Outcome's ClassVar

    def __repr__(self) -> str:
        return f"{Outcome.__repr__(self)}.with_writes({', '.join(map(repr, self.writes))})"


def retry_after(delay: float) -> Outcome:
    """Handle again after ``delay`` seconds (see the README for the three ways).

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


# ``init=False``: the ``__init__`` below validates and normalises (see ``_value``).
@immutable
@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Backoff:
    """``on_error`` (the default): a failed delivery stays pending and is
    delivered again later, by the same consumer.

    ``consumer.mount(..., on_error=Backoff(base=0.1, cap=30.0))``.  When the
    handler raises (or returns something that is not an outcome) on attempt
    ``n``, the delivery stays where it is -- in the group's PEL (streams,
    every mode) or in the processing list (reliable lists) -- and after a
    random delay between 0 and ``min(cap, base * 2 ** (n - 1))`` seconds
    (full jitter) it is delivered again as attempt ``n + 1``.  No copy is
    written, a crash loses nothing (the delivery is still pending), and a
    message that always fails is handled a handful of times a minute, never
    in a hot loop.  ``max_attempts`` and ``dead_letter`` apply as to a
    ``RETRY``.  On simple lists and Pub/Sub (nothing to leave pending) a
    ``Backoff`` drops the message, with the error logged.

    Immutable; equal values compare equal.

    Args:
        base: seconds; the longest wait after the first failed attempt.
        cap: seconds; no wait is longer (at least ``base``).

    Raises:
        ValueError: ``base`` or ``cap`` is not a finite number of seconds
            above 0, or ``cap`` is below ``base`` (the message names it).
    """

    base: float
    cap: float

    def __init__(self, base: float = 0.1, cap: float = 30.0) -> None:
        b = _seconds("base", base)
        c = _seconds("cap", cap)
        if c < b:
            raise ValueError(f"cap must be >= base ({b!r} s), got {cap!r}")
        _set_base(self, b)
        _set_cap(self, c)

    def ceiling(self, attempt: int) -> float:
        """The longest wait after failed attempt ``attempt``: ``min(cap, base * 2 ** (attempt - 1))``."""
        exponent = max(attempt - 1, 0)
        if exponent >= 1024:  # 2.0 ** 1024 overflows; base * 2 ** 1024 exceeds any finite cap
            return self.cap
        return min(self.cap, self.base * 2.0**exponent)

    def delay(self, attempt: int) -> float:
        """A wait after failed attempt ``attempt``: uniform in ``[0, ceiling(attempt)]``."""
        return random.uniform(0.0, self.ceiling(attempt))


_set_base, _set_cap = setters(Backoff, "base", "cap")
