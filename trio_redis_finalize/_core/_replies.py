"""Error replies as values: their classes, their codes, and what each says about its command.

:func:`classify` is the one classification every path uses (finalizer,
scheduler, readers, set-up): :data:`FINAL`, :data:`NOT_RUN` or
:data:`UNKNOWN`.  The vocabulary is redis-py's exception classes (values
only: nothing of redis-py's I/O is used).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc

from ._commands import Command, describe

__all__ = [
    "FINAL",
    "NOT_RUN",
    "NOT_RUN_CODES",
    "NOT_RUN_ERRORS",
    "UNKNOWN",
    "BusyGroupError",
    "ErrorKind",
    "NoGroupError",
    "NotRunError",
    "WrongTypeError",
    "classify",
    "describe_error",
    "error_code",
    "raise_first_error",
    "with_context",
]


class WrongTypeError(rexc.ResponseError):
    """``WRONGTYPE``: the key holds a value of another type."""


class NoGroupError(rexc.ResponseError):
    """``NOGROUP``: the stream or its consumer group does not exist."""


class BusyGroupError(rexc.ResponseError):
    """``BUSYGROUP``: the consumer group already exists."""


_EXTRA = {"WRONGTYPE": WrongTypeError, "NOGROUP": NoGroupError, "BUSYGROUP": BusyGroupError}

NOT_RUN_CODES = frozenset({
    "OOM", "BUSY", "READONLY", "LOADING", "MASTERDOWN", "MISCONF", "NOREPLICAS", "TRYAGAIN",
    "CLUSTERDOWN", "NOSCRIPT",
})
"""Error codes of replies to commands the server did not run (and may run later)."""

_CLASS_CODES: tuple[tuple[type[Exception], str], ...] = (
    (rexc.OutOfMemoryError, "OOM"), (rexc.BusyLoadingError, "LOADING"),
    (rexc.ReadOnlyError, "READONLY"), (rexc.MasterDownError, "MASTERDOWN"),
    (rexc.TryAgainError, "TRYAGAIN"), (rexc.ClusterDownError, "CLUSTERDOWN"),
    (rexc.NoScriptError, "NOSCRIPT"),
)
# A script error wrapping the error of a command the script called (Redis
# 6.2: ``Error running script (call to f_...): @user_script:1: ... -READONLY
# You can't write ...``).  Redis 7 and Valkey pass the inner code on as the
# reply's own code, handled by the prefix.
_WRAPPED = re.compile(
    r"(?<![A-Za-z0-9_])-(" + "|".join(sorted(NOT_RUN_CODES)) + r")(?![A-Za-z0-9_])"
)


class NotRunError(rexc.ResponseError):
    """An error reply saying the command did not run, of a code redis-py has no
    class for (``BUSY``, ``MISCONF``, ``NOREPLICAS``), or wrapped in a script
    error (Redis 6.2: ``Error running script ... -READONLY ...``)."""


def describe_error(err: BaseException, command: Command) -> str:
    """``"<error> (XADD on key 'orders')"``: an error reply with its command and key."""
    return f"{err} ({describe(command)})"


def with_context(err: rexc.RedisError, command: Command) -> rexc.RedisError:
    """A copy of ``err`` of the same class whose message names the command and key."""
    msg = describe_error(err, command)
    try:
        new = type(err)(msg)
    except Exception:  # pragma: no cover - exotic constructor
        return err
    code = getattr(err, "code", None)
    if code is not None:
        new.code = code  # type: ignore[attr-defined]
    return new


class ErrorKind(enum.Enum):
    """What an error reply (or a failed request) says about its command."""

    FINAL = "final"
    """It can never succeed (WRONGTYPE, syntax, arity, a script's own refusal ...)."""
    NOT_RUN = "not_run"
    """The server did not run it and may later (OOM, BUSY, READONLY ...): send again."""
    UNKNOWN = "unknown"
    """The connection failed or timed out, or what answered was not RESP: it
    may or may not have run."""


FINAL = ErrorKind.FINAL
NOT_RUN = ErrorKind.NOT_RUN
UNKNOWN = ErrorKind.UNKNOWN

NOT_RUN_ERRORS: tuple[type[rexc.RedisError], ...] = (
    NotRunError, rexc.OutOfMemoryError, rexc.BusyLoadingError, rexc.ReadOnlyError,
    rexc.TryAgainError, rexc.ClusterDownError, rexc.NoScriptError,
)
"""The exception classes of error replies :func:`classify` calls :data:`NOT_RUN`
(for ``except`` clauses; ``MasterDownError`` is a ``ClusterDownError``)."""


def error_code(err: BaseException) -> str | None:
    """The code of an error reply (``"OOM"``, ``"WRONGTYPE"`` ...), when known."""
    code = getattr(err, "code", None)
    if isinstance(code, str):
        return code
    for cls, name in _CLASS_CODES:
        if isinstance(err, cls):
            return name
    if isinstance(err, rexc.ResponseError):
        head = str(err).split(" ", 1)[0]
        if head.isupper():
            return head
    return None


def classify(err: BaseException) -> ErrorKind:
    """What ``err`` (an error reply, or what a request raised) says about its command.

    * :data:`NOT_RUN`: an error reply with a code of :data:`NOT_RUN_CODES`,
      bare or wrapped in a script error: the command did not run (a script
      that failed at a write wrote nothing before it); send it again, with
      backoff.
    * :data:`UNKNOWN`: the connection was lost or timed out, or the reply was
      not RESP (``InvalidResponse``: the transport closed the connection;
      the garbled reply may have come after the command ran); the command
      may have run.
    * :data:`FINAL`: every other error reply; sending it again cannot help.

    Opening a connection to an endpoint that does not answer as a Redis
    server still fails at once: the handshake and ``Client.check`` turn the
    ``InvalidResponse`` into a ``ConnectionError`` naming the address, and
    set-up sends again only what did not run (:data:`NOT_RUN`).

    Prefixes and ``-CODE`` tokens are matched, never whole texts (servers
    word their messages differently).
    """
    if isinstance(err, NotRunError):
        return NOT_RUN
    code = error_code(err)
    if code in NOT_RUN_CODES:
        return NOT_RUN
    if isinstance(err, (rexc.ConnectionError, rexc.TimeoutError, rexc.InvalidResponse, OSError)):
        return UNKNOWN
    if isinstance(err, rexc.ResponseError) and _WRAPPED.search(str(err)):
        return NOT_RUN
    if not isinstance(err, rexc.RedisError):
        return UNKNOWN
    return FINAL


def raise_first_error(commands: Sequence[Command], replies: Sequence[Any]) -> None:
    """Raise the first error reply, naming its command and key (pipelines)."""
    for cmd, r in zip(commands, replies, strict=True):
        if isinstance(r, rexc.RedisError):
            raise with_context(r, cmd)
