"""What the server can do beyond Redis 6.2, as a value (sans-IO).

The transport asks every connection it opens, in the handshake's round trip,
``COMMAND INFO`` of the commands that may be missing, ``COMMAND DOCS`` of
the commands whose options may be missing and ``HELLO 2`` (the server's name
and version; the connection stays RESP2) (:data:`DETECT`), and turns the
replies into :class:`Capabilities` with :func:`parse` -- once per connection.
A mount resolves its :class:`~._plan.Target` with the capabilities the client
reports at that moment; from there the plans choose the native commands or
today's scripts, the fallback (Redis 6.2, 7.0, Valkey 9.1).

One flag per capability, and one place in the core that consumes each (the
``Target`` properties named below; the later ones are detected, not used yet):

``xackdel`` (Redis 8.2.3): ``XACKDEL key group ACKED IDS n id ...``
    Consumed by ``Target.xackdel``: it replaces the XACK + XDEL of
    ``Retention.DELETE_ON_FINALIZE`` (plans, gated and batched scripts).
    Redis 8.2.0 to 8.2.2 have the command with a stack overflow in it
    (CVE-2025-62507, fixed in 8.2.3): on Redis the flag needs the command
    *and* a version 8.2.3 or later (:data:`XACKDEL_SAFE`); an unknown
    version (``HELLO`` refused) leaves it unset.  Valkey has no XACKDEL in
    9.1 (it comes with a later release, an implementation of its own that
    the Redis CVE does not concern): there the command's presence is
    enough.
``acked_trim`` (Redis 8.2): the ``ACKED`` option of ``XADD`` and ``XTRIM``
    Consumed by ``Target.acked``: ``_retention.TRIM_ACKED_NATIVE`` for the
    retention trim (``XTRIM ... = id ACKED``).  Not by the ``*_maxlen`` caps:
    on Redis 8.2.3 ``MAXLEN ~ n ACKED`` removes nothing (redis/redis#14656,
    fixed upstream later) and ``MAXLEN = n ACKED`` walks the referenced head
    of the stream on every XADD; a server with the fix could make the caps
    ``ACKED`` at ``Target.acked``, the same one place.
``claim_read`` (Redis 8.4): ``XREADGROUP ... CLAIM min-idle``
    A stream read strategy: where it would be consumed, and what it would
    replace, is written in the stream's home (``_forms/stream/own_pel.py``,
    the claims).
``idmp`` (Redis 8.6): ``XADD ... IDMP``
    Would make the copies written before an acknowledgement idempotent (a
    resent cross-slot copy, a runtime copy sent again after a lost reply).
``xnack`` (Redis 8.8): ``XNACK``
    The native hand-back at a graceful stop: ``XNACK key group SILENT IDS n
    id ...`` for the deliveries read and not started (their count set back
    by one), ``FAIL`` for those a grace cut, would replace the stop's ``XCLAIM
    ... RETRYCOUNT`` (the give-back) + ``XCLAIM ... IDLE`` + the stopped mark
    (``_core.stream.liveness.STOP``) and the peers' registry probe.  Not used yet:
    an XNACKed entry has no owner in the PEL, so the reaper (which reads the
    stopped consumer's PEL) never sees it; only ``XREADGROUP ... CLAIM``
    (``claim_read``) or ``XAUTOCLAIM`` serves it, which PLAIN mounts do not
    run.  It is to be consumed together with ``claim_read``, at this flag.

A command is there when ``COMMAND INFO`` names it (a missing one answers
nil); an option when ``COMMAND DOCS`` lists its token among the command's
arguments (Redis 6.2 has no ``COMMAND DOCS``: its error reply means no
option).  A detection that the server refused (an ACL without ``COMMAND``, a
transient error) gives ``None``: unknown, which plans as the fallback and is
never taken for a server that lost a capability.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ._commands import Command

__all__ = ["DETECT", "NO_CAPABILITIES", "XACKDEL_SAFE", "Capabilities", "parse", "server_version",
           "tokens"]


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a server has beyond Redis 6.2 (see the module docstring)."""

    xackdel: bool = False
    """Redis 8.2: ``XACKDEL key group ACKED IDS n id ...`` (acknowledge, and
    delete what no group still references)."""
    acked_trim: bool = False
    """Redis 8.2: ``XADD ... MAXLEN ~ n ACKED`` and ``XTRIM ... ACKED`` (trim
    only entries every group has read and acknowledged)."""
    claim_read: bool = False
    """Redis 8.4: ``XREADGROUP ... CLAIM min-idle`` (claim idle pending entries
    in the same read)."""
    idmp: bool = False
    """Redis 8.6: ``XADD ... IDMP`` (an idempotent XADD)."""
    xnack: bool = False
    """Redis 8.8: ``XNACK`` (give an entry back without spending an attempt)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The flags that are set, by name."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))

    def missing(self, other: Capabilities) -> tuple[str, ...]:
        """The flags set here that ``other`` lacks, by name."""
        return tuple(n for n in self.names if not getattr(other, n))

    def union(self, other: Capabilities) -> Capabilities:
        """The flags set here or in ``other``."""
        return Capabilities(**{n: True for n in (*self.names, *other.names)})

    def common(self, other: Capabilities) -> Capabilities:
        """The flags set both here and in ``other``."""
        return Capabilities(**{n: True for n in self.names if getattr(other, n)})

    def __str__(self) -> str:
        return ", ".join(self.names) or "none"


NO_CAPABILITIES = Capabilities()
"""Redis 6.2's: every plan takes the fallback."""

_COMMANDS = ("XACKDEL", "XNACK")
_DOCUMENTED = ("XADD", "XTRIM", "XREADGROUP")

DETECT: tuple[Command, ...] = (
    ("COMMAND", "INFO", *_COMMANDS),
    ("COMMAND", "DOCS", *_DOCUMENTED),
    ("HELLO", "2"),
)
"""The detection commands; their replies, in order, go to :func:`parse`."""


XACKDEL_SAFE = (8, 2, 3)
"""The first Redis version whose XACKDEL the library uses (CVE-2025-62507 in 8.2.0-8.2.2)."""

_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def server_version(hello: Any) -> tuple[str, tuple[int, int, int]] | None:
    """The server's name (``redis``, ``valkey``) and version from a ``HELLO``
    reply (RESP2: a flat list of names and values); None when refused or
    unreadable."""
    if not isinstance(hello, list):
        return None
    fields = {_text(k).lower(): v for k, v in zip(hello[::2], hello[1::2], strict=False)
              if not isinstance(k, list | dict)}
    version = fields.get("version")
    if not isinstance(version, bytes | str):
        return None
    m = _VERSION.match(_text(version))
    if m is None:
        return None
    name = fields.get("server")
    return (_text(name).lower() if isinstance(name, bytes | str) else "",
            (int(m[1]), int(m[2]), int(m[3])))


def _xackdel_safe(hello: Any) -> bool:
    """XACKDEL may be used on this server (it has the command): Redis 8.2.3 or
    later, or a server that is not Redis (Valkey's XACKDEL is its own)."""
    found = server_version(hello)
    if found is None:
        return False
    name, version = found
    return name not in ("", "redis") or version >= XACKDEL_SAFE


def tokens(doc: Any) -> set[str]:
    """Every argument token (``MAXLEN``, ``ACKED`` ...) of one command's
    ``COMMAND DOCS`` entry (RESP2: a flat list of names and values, nested)."""
    out: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):  # pragma: no cover - RESP3 maps (the transport speaks RESP2)
            node = [x for kv in node.items() for x in kv]
        if not isinstance(node, list):
            return
        for i, item in enumerate(node):
            if isinstance(item, list | dict):
                walk(item)
            elif _text(item) == "token" and i + 1 < len(node) and not isinstance(node[i + 1], list):
                out.add(_text(node[i + 1]).upper())

    walk(doc)
    return out


def _docs(reply: Any) -> dict[str, set[str]]:
    """``COMMAND DOCS`` (name, doc, name, doc ...) -> name -> its argument tokens."""
    if not isinstance(reply, list):
        return {}
    return {_text(name).upper(): tokens(doc) for name, doc in zip(reply[::2], reply[1::2], strict=False)}


def parse(replies: Sequence[Any]) -> Capabilities | None:
    """:class:`Capabilities` from the replies to :data:`DETECT`, in order
    (error replies as exception values); ``None`` when ``COMMAND INFO`` was
    refused (unknown).  ``COMMAND DOCS`` refused (Redis 6.2 has none) leaves
    the options out; ``HELLO`` refused leaves ``xackdel`` out (the version
    that makes it safe is unknown)."""
    if len(replies) != len(DETECT):
        raise ValueError(f"parse(): {len(replies)} replies to {len(DETECT)} detection commands")
    info, docs, hello = replies
    if not isinstance(info, list) or len(info) != len(_COMMANDS):
        return None
    has = {name: bool(row) for name, row in zip(_COMMANDS, info, strict=True)}
    options = _docs(docs) if not isinstance(docs, Exception) else {}
    return Capabilities(
        xackdel=has["XACKDEL"] and _xackdel_safe(hello),
        acked_trim="ACKED" in options.get("XTRIM", set()) and "ACKED" in options.get("XADD", set()),
        claim_read="CLAIM" in options.get("XREADGROUP", set()),
        idmp="IDMP" in options.get("XADD", set()),
        xnack=has["XNACK"],
    )
