"""Redis Cluster routing, sans-IO: which hash slot a command serves, and where a slot lives.

What :class:`~._cluster.ClusterClient` and its
:class:`~._cluster.RoutedConnection` decide without a socket: the slot of
a command's first key (:func:`slot_of`; a ``SCAN ... MATCH {tag}...`` the
slot of its literal hash tag), a pipeline's runs of consecutive commands
of one slot (:func:`slot_runs`), a transaction's one slot
(:func:`one_slot`), the slot map a ``CLUSTER SLOTS`` reply draws
(:func:`slot_map`), where a ``MOVED`` or ``ASK`` points, and how many
redirections and ``TRYAGAIN`` pauses a command is given.  See
``_cluster``'s docstring for the routing rules these serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc
from redis.crc import key_slot

from .._core._commands import Arg, Command, command_keys

__all__ = ["MAX_REDIRECTS", "MAX_TRYAGAIN", "REDIRECTS", "SLOTS", "Address", "key_bytes", "one_slot",
           "redirect_address", "slot_map", "slot_of", "slot_runs", "tryagain_pause"]

SLOTS = 16384
MAX_REDIRECTS = 8
"""``MOVED`` and ``ASK`` redirections followed per command before giving up."""
MAX_TRYAGAIN = 25
"""``TRYAGAIN`` answers waited out per command (pauses of 10 ms doubling up to
250 ms: about 5 s, enough for a migration to move the slot's remaining keys)."""


def tryagain_pause(n: int) -> float:
    return float(min(0.25, 0.01 * 2**n))

Address = tuple[str, int]
REDIRECTS = (rexc.MovedError, rexc.AskError, rexc.TryAgainError)


def key_bytes(key: Arg) -> bytes:
    if isinstance(key, bytes):
        return key
    return str(key).encode()


def _pattern_slot(pattern: bytes) -> int | None:
    """The one slot of every key ``pattern`` can match, when its hash tag is literal.

    ``{jobs}:processing:*`` matches only keys tagged ``jobs``; ``jobs:*`` or
    ``{j*}:x`` can match keys of any slot (``None``).
    """
    start = pattern.find(b"{")
    end = pattern.find(b"}", start + 1)
    if start < 0 or end <= start + 1:
        return None
    if any(c in pattern[:end] for c in b"*?[\\"):
        return None
    return int(key_slot(pattern[start + 1 : end]))


def slot_of(command: Command) -> int | None:
    """The hash slot of ``command``'s first key; ``None`` when it names none.

    ``SCAN ... MATCH pattern`` goes to the slot of the pattern's hash tag
    when it has a literal one (all the keys it can match live there).
    """
    keys = command_keys(command)
    if keys:
        return int(key_slot(key_bytes(keys[0])))
    if len(command) > 3 and key_bytes(command[0]).upper() == b"SCAN":
        upper = [key_bytes(a).upper() for a in command]
        if b"MATCH" in upper[2:-1]:
            return _pattern_slot(key_bytes(command[upper.index(b"MATCH", 2) + 1]))
    return None


def redirect_address(err: rexc.MovedError | rexc.AskError, source: Address) -> Address:
    """Where a redirection points (a node that does not know its own address
    sends ``:port``; it is then on the host of the node that answered)."""
    return (err.host or source[0], int(err.port))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def slot_runs(commands: Sequence[Command]) -> list[tuple[int | None, list[Command]]]:
    """``commands`` as runs of consecutive commands of one slot, in order
    (a command without keys joins the run before it), each with its slot."""
    runs: list[tuple[int | None, list[Command]]] = []
    for cmd in commands:
        s = slot_of(cmd)
        if runs and (s is None or runs[-1][0] in (None, s)):
            if runs[-1][0] is None and s is not None:
                runs[-1] = (s, runs[-1][1])
            runs[-1][1].append(cmd)
        else:
            runs.append((s, [cmd]))
    return runs


def one_slot(commands: Sequence[Command]) -> int | None:
    """The one slot of a transaction's ``commands`` (``None``: they name no key).

    Raises:
        redis.exceptions.CrossSlotTransactionError: keys of several slots.
    """
    slots = {s for s in (slot_of(c) for c in commands) if s is not None}
    if len(slots) > 1:
        raise rexc.CrossSlotTransactionError(
            f"a transaction in Redis Cluster needs keys of one hash slot, got slots {sorted(slots)}"
        )
    return slots.pop() if slots else None


def slot_map(reply: Any, addr: Address) -> list[Address | None]:
    """The owner of every slot, as the ``CLUSTER SLOTS`` ``reply`` of the node
    at ``addr`` says (a master that does not know its own host: ``addr``'s)."""
    owner: list[Address | None] = [None] * SLOTS
    for row in reply:
        start, end, master = int(row[0]), int(row[1]), row[2]
        host = _text(master[0]) if master[0] else ""
        if not host or host == "?":
            host = addr[0]
        where = (host, int(master[1]))
        owner[start : end + 1] = [where] * (end - start + 1)
    return owner
