"""What every subscription form shares: form and mode enums, validation."""

from __future__ import annotations

import enum
import math

__all__ = ["DelayedRetry", "Form", "Mode", "check_key", "check_limits", "check_positive"]


class Form(enum.Enum):
    """The shape of a subscription, which decides how it is finalized."""

    STREAM = "stream"
    RELIABLE_LIST = "reliable list"
    LIST = "list"
    CHANNEL = "channel"
    PATTERN = "pattern"


class Mode(enum.Enum):
    """How a stream subscription treats pending entries.

    * ``PLAIN``: read new entries; re-read its own PEL on start and after errors.
    * ``RECLAIM``: as PLAIN, and also claim entries idle ``min_idle`` from
      other (dead) consumers with XAUTOCLAIM.
    * ``CLAIMING``: RETRY leaves the entry in the PEL; XAUTOCLAIM with
      ``min_idle`` before every read brings it back (same id, delivery count + 1).
    """

    PLAIN = "plain"
    RECLAIM = "reclaim"
    CLAIMING = "claiming"


class DelayedRetry(enum.Enum):
    """Where ``retry_after(delay)`` keeps the copy while it waits.

    * ``RUNTIME``: in process memory (lost if the process dies meanwhile).
    * ``DURABLE_ZSET``: in a sorted set in Redis, scored by due time.
    """

    RUNTIME = "runtime"
    DURABLE_ZSET = "durable_zset"


def check_key(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def check_limits(max_attempts: int | None, dead_letter: str | None) -> None:
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
    ):
        raise ValueError(f"max_attempts must be an int >= 1 or None, got {max_attempts!r}")
    if dead_letter is not None:
        check_key("dead_letter", dead_letter)
        if max_attempts is None:
            raise ValueError("dead_letter needs max_attempts (when would a message be dead?)")


class Subscription:
    """Base of the subscription forms (configuration only; immutable)."""

    __slots__ = ()
    form: Form

    @property
    def name(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError
