"""What every subscription form shares: form and mode enums, validation."""

from __future__ import annotations

import enum
import math

from ._keys import derived

__all__ = [
    "DEAD_SUFFIX", "DEFAULT_MAX_ATTEMPTS", "QUEUE_DEAD_LETTER", "STREAM_DEAD_LETTER",
    "DelayedRetry", "DerivedKey", "Form", "Mode", "Retention", "check_key", "check_limits",
    "check_maxlen", "check_positive",
    "default_dead_letter", "resolve_dead_letter", "source_of_dead_letter",
]

DEFAULT_MAX_ATTEMPTS = 10
"""``max_attempts`` of a stream or reliable list subscription unless given:
a message that keeps failing ends in the dead letter at its 10th attempt
(with the default ``Backoff()``, at least its ``window`` of 30 s after the
first failure).  ``max_attempts=None`` retries forever (and has no dead letter)."""
DEAD_SUFFIX = ":dead"
"""The default dead letter of a stream or reliable list: the source key with
this suffix, in its hash slot (``orders`` -> ``{orders}:dead``)."""


class DerivedKey(str):
    """The default of ``dead_letter``, shown as what it stands for
    (``"{stream}:dead"``): with ``max_attempts`` set, :func:`default_dead_letter`
    of the source; without, none.  Told apart by its class (a plain string
    ``"{stream}:dead"`` given by a user is that key)."""

    __slots__ = ()


STREAM_DEAD_LETTER = DerivedKey("{stream}:dead")
QUEUE_DEAD_LETTER = DerivedKey("{queue}:dead")


def default_dead_letter(source: str) -> str:
    """The dead letter a stream or reliable list ``source`` gets by default:
    ``{source}:dead`` (``_keys.derived``: same hash slot)."""
    return derived(source, DEAD_SUFFIX)


def source_of_dead_letter(key: str) -> str | None:
    """The source whose default dead letter is ``key`` (``{orders}:dead`` ->
    ``orders``, ``{app}.orders:dead`` -> ``{app}.orders``), or None."""
    if not key.endswith(DEAD_SUFFIX):
        return None
    base = key[: -len(DEAD_SUFFIX)]
    inner = base[1:-1] if base.startswith("{") and base.endswith("}") else None
    for source in (inner, base):
        if source and default_dead_letter(source) == key:
            return source
    return None


def resolve_dead_letter(source: str, max_attempts: int | None, dead_letter: str | None) -> str | None:
    """``dead_letter`` as given, or for the default (a :class:`DerivedKey`)
    :func:`default_dead_letter` of ``source`` when ``max_attempts`` is set, else None."""
    if not isinstance(dead_letter, DerivedKey):
        return dead_letter
    return None if max_attempts is None else default_dead_letter(source)


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


class Retention(enum.Enum):
    """What a stream subscription removes from its stream, beyond acknowledging.

    By default (``retention=None``) nothing: entries are acknowledged (XACK)
    and stay in the stream until something else trims it.

    * ``DELETE_ON_FINALIZE``: each original is deleted (XDEL) when it is
      finalized -- ACK, DROP, RETRY (after its copy is written), dead letter,
      durable delay, runtime delay (at once, the copy follows later), an
      entry lost before handling.  For work-queue streams that one group
      reads: ``mount()`` refuses a stream that other groups read (deleting
      would take entries they have not read).  The two-step cells delete in
      their gated script; ACK and DROP send ``XDEL`` right after the
      ``XACK``, in the same pipeline, and a periodic trim (below) removes
      what a crash left between the two.
    * ``TRIM_ACKED``: at least every 10 s, one bounded step trims the stream
      below the oldest entry some group still needs (each group's oldest
      pending entry, and the entry after its last delivered id), over every
      group of the stream, in one atomic script.  An entry a group has not
      read, or has pending, is never trimmed.  A stream without groups is
      left alone.
    """

    DELETE_ON_FINALIZE = "delete_on_finalize"
    TRIM_ACKED = "trim_acked"


def check_maxlen(name: str, value: object) -> int | None:
    """``None``, or an int >= 1 (a ``MAXLEN ~`` cap), else ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


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


def check_delay(delayed_retry: object, delay_key: str | None) -> None:
    """``delayed_retry`` is a :class:`DelayedRetry` or None; a ``delay_key`` is a
    key, and only given with ``DelayedRetry.DURABLE_ZSET``."""
    if delayed_retry is not None and not isinstance(delayed_retry, DelayedRetry):
        raise ValueError(f"delayed_retry must be a DelayedRetry or None, got {delayed_retry!r}")
    if delay_key is not None:
        check_key("delay_key", delay_key)
        if delayed_retry is not DelayedRetry.DURABLE_ZSET:
            raise ValueError("delay_key is only used with delayed_retry=DelayedRetry.DURABLE_ZSET")
