"""Outcomes a handler returns: ``ACK``, ``RETRY``, ``DROP``, ``retry_after(delay)``."""

from __future__ import annotations

import enum
import math
from typing import Final

__all__ = ["ACK", "DROP", "RETRY", "Outcome", "OutcomeKind", "retry_after"]


class OutcomeKind(enum.Enum):
    ACK = "ack"
    RETRY = "retry"
    DROP = "drop"
    RETRY_AFTER = "retry_after"


class Outcome:
    """What to do with a delivery once its handler is done (immutable).

    Use the constants :data:`ACK`, :data:`RETRY`, :data:`DROP` or
    :func:`retry_after`; equal outcomes compare equal.
    """

    __slots__ = ("delay", "kind")
    kind: OutcomeKind
    delay: float

    def __init__(self, kind: OutcomeKind, delay: float = 0.0) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "delay", delay)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Outcome is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Outcome is immutable")

    def __reduce__(self) -> tuple[type[Outcome], tuple[OutcomeKind, float]]:
        # copy and pickle would otherwise restore the slots with setattr
        return (Outcome, (self.kind, self.delay))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Outcome):
            return NotImplemented
        return self.kind is other.kind and self.delay == other.delay

    def __hash__(self) -> int:
        return hash((self.kind, self.delay))

    def __repr__(self) -> str:
        if self.kind is OutcomeKind.RETRY_AFTER:
            return f"retry_after({self.delay!r})"
        return self.kind.name

    @property
    def is_retry(self) -> bool:
        """Whether this is RETRY or retry_after (the message is to be handled again)."""
        return self.kind is OutcomeKind.RETRY or self.kind is OutcomeKind.RETRY_AFTER


ACK: Final = Outcome(OutcomeKind.ACK)
"""Handled: remove the delivery for good."""
RETRY: Final = Outcome(OutcomeKind.RETRY)
"""Handle again as soon as possible (a copy with the retry counter one higher)."""
DROP: Final = Outcome(OutcomeKind.DROP)
"""Give up on the delivery without handling it: removed like ACK, counted apart."""


def retry_after(delay: float) -> Outcome:
    """Handle again after ``delay`` seconds (see the README for the three ways).

    Raises:
        ValueError: ``delay`` is negative, NaN or infinite.
    """
    delay = float(delay)
    if not math.isfinite(delay) or delay < 0:
        raise ValueError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    return Outcome(OutcomeKind.RETRY_AFTER, delay)
