"""Commands as plain values: their types, Lua scripts, the keys a command names.

Nothing here sends anything: the transport packs and sends these values;
the planner builds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["SCRIPTS", "Arg", "Command", "Script", "command_keys", "describe"]

Arg = bytes | str | int | float
Command = Sequence[Arg]

SCRIPTS: dict[bytes, Script] = {}
"""Every script by its sha: its source (loaded on ``NOSCRIPT``) and its name
(error messages name the script run)."""


class Script:
    """A Lua script run by ``EVALSHA`` (loaded with ``SCRIPT LOAD`` on ``NOSCRIPT``)."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, source: str, name: str = "script") -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()
        self.name = name
        SCRIPTS[self.sha] = self

    def command(self, keys: Sequence[Arg], args: Sequence[Arg]) -> tuple[Arg, ...]:
        """The ``EVALSHA`` command for a pipeline."""
        return (b"EVALSHA", self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"Script({self.name})"


def _text(arg: Arg) -> str:
    if isinstance(arg, bytes):
        return arg.decode("utf-8", "backslashreplace")
    return str(arg)


_NO_KEYS = frozenset({
    "ACL", "ASKING", "AUTH", "BGREWRITEAOF", "BGSAVE", "CLIENT", "CLUSTER", "COMMAND", "CONFIG",
    "DBSIZE", "DEBUG", "DISCARD", "ECHO", "EXEC", "FLUSHALL", "FLUSHDB", "FUNCTION", "HELLO",
    "INFO", "KEYS", "LASTSAVE", "LATENCY", "LOLWUT", "MODULE", "MONITOR", "MULTI",
    "PING", "PSUBSCRIBE", "PUBLISH", "PUBSUB", "PUNSUBSCRIBE", "QUIT", "RANDOMKEY", "READONLY",
    "READWRITE", "RESET", "ROLE", "SAVE", "SCAN", "SCRIPT", "SELECT", "SHUTDOWN", "SLOWLOG",
    "SUBSCRIBE", "SWAPDB", "TIME", "UNSUBSCRIBE", "UNWATCH", "WAIT",
})
_ALL_KEYS = frozenset({
    "DEL", "EXISTS", "MGET", "PFCOUNT", "PFMERGE", "SDIFF", "SDIFFSTORE", "SINTER", "SINTERSTORE",
    "SUNION", "SUNIONSTORE", "TOUCH", "UNLINK", "WATCH",
})
_TWO_KEYS = frozenset({
    "BLMOVE", "BRPOPLPUSH", "COPY", "LMOVE", "RENAME", "RENAMENX", "RPOPLPUSH", "SMOVE",
})
_BLOCKING_POPS = frozenset({"BLPOP", "BRPOP", "BZPOPMAX", "BZPOPMIN"})
_SUBCOMMAND_KEY = frozenset({"MEMORY", "OBJECT", "XGROUP", "XINFO"})


def command_keys(command: Command) -> list[Arg]:
    """The keys ``command`` touches, as Redis Cluster routes them (``[]``: none).

    ``EVALSHA``/``EVAL``/``FCALL`` read ``numkeys``; ``XREAD``/``XREADGROUP``
    take the keys after ``STREAMS``; ``XGROUP``/``XINFO``/``OBJECT`` the
    argument after the subcommand; multi-key and two-key commands (``DEL``,
    ``MSET``, ``BLMOVE``, ``BLPOP`` ...) all of theirs; server commands
    (``PING``, ``SCRIPT``, ``CLUSTER``, ``PUBLISH`` ...) none (``XINFO HELP``
    and the like too: they name no key); any other
    command its first argument.
    """
    if not command:
        return []
    name = _text(command[0]).upper()
    if name in _NO_KEYS:
        return []
    if name in {"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO"}:
        if len(command) < 3:
            return []
        try:
            nkeys = int(command[2])
        except ValueError:
            return []
        return list(command[3 : 3 + max(nkeys, 0)])
    if name in {"XREADGROUP", "XREAD"}:
        upper = [_text(a).upper() for a in command]
        if "STREAMS" not in upper:
            return []
        rest = command[upper.index("STREAMS") + 1 :]
        return list(rest[: len(rest) // 2])
    if name in _SUBCOMMAND_KEY:
        return [command[2]] if len(command) > 2 else []
    if name in _ALL_KEYS:
        return list(command[1:])
    if name in {"MSET", "MSETNX"}:
        return list(command[1::2])
    if name in _TWO_KEYS:
        return list(command[1:3])
    if name in _BLOCKING_POPS:
        return list(command[1:-1])
    return [command[1]] if len(command) > 1 else []


def describe(command: Command) -> str:
    """``"XADD on key 'orders'"``: the command and its key(s), for error messages;
    a script of the library's by its name (``"EVALSHA stream_copy_ack on key
    'orders', 'orders'"``)."""
    name = _text(command[0]).upper() if command else "?"
    if name in {"PUBLISH", "SPUBLISH"} and len(command) > 1:
        return f"{name} on channel {_text(command[1])!r}"
    if name == "EVALSHA" and len(command) > 1:
        sha = command[1]
        sha = sha.encode() if isinstance(sha, str) else sha
        script = SCRIPTS.get(sha) if isinstance(sha, bytes) else None
        if script is not None:
            name = f"EVALSHA {script.name}"
    keys = command_keys(command)
    if not keys:
        return name
    shown = ", ".join(repr(_text(k)) for k in keys[:DESCRIBED_KEYS])
    if len(keys) > DESCRIBED_KEYS:  # a batched writes call declares every write's key
        shown += f" and {len(keys) - DESCRIBED_KEYS} more"
    return f"{name} on key {shown}"


DESCRIBED_KEYS = 8
"""How many of a command's keys :func:`describe` names (then how many more)."""
