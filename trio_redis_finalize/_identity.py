"""The shell of ``_core._identity``: this process's token, the claim of a
consumer name's heartbeat at mount (raise when another live process holds
it; take it at once from a crashed process of this host), the renewal that
keeps only its own, and an error log when another process took the name
over."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable

from ._core._commands import Command
from ._core._identity import describe_holder, gone, make_token, parse_claim, refusal
from ._deadlines import log
from ._forms._port import Context

__all__ = ["LIVE", "NameHold", "new_token"]

LIVE: set[str] = set()
"""The tokens of the consumers open in this process (never taken for dead)."""


def _pidns() -> str:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), '' without ``/proc``."""
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return "".join(c for c in link if c.isdigit())


def start_of(pid: int) -> str | None:
    """When the process ``pid`` started (``/proc/<pid>/stat``, clock ticks
    after boot); None when no such process runs (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


_HOST = socket.gethostname()
_PIDNS = _pidns()


def new_token() -> str:
    """A token for a new consumer of this process (``_core._identity``)."""
    pid = os.getpid()
    token = make_token(_HOST, pid, uuid.uuid4().hex[:8], _PIDNS, (start_of(pid) or "") if _PIDNS
                       else "")
    LIVE.add(token)
    return token


class NameHold:
    """One mount's hold on its consumer name's heartbeat key."""

    def __init__(self) -> None:
        self._holder = ""  # the other process found holding the key (logged once)

    async def claim(self, ctx: Context, command: Callable[[bool | str], Command], key: str,
                    legacy_key: str, timeout: float) -> None:
        """Send the :data:`~._core._identity.CLAIM` ``command(takeover)``.

        Raises:
            ConsumerNameInUse: another live process holds the name (and the
                mount is no ``takeover``).
        """
        me = ctx.consumer.name
        (reply,) = await ctx.client.pipeline([command(ctx.takeover)], timeout=timeout)
        got = parse_claim(reply)
        if not got.ok and not got.old_naming and gone(got.holder, _HOST, _PIDNS, os.getpid(),
                                                              start_of, LIVE):
            log.info("%s: consumer name %r was held by %s, which no longer runs (a crash, or "
                     "a consumer closed in this process); taking the name over", ctx.name, me,
                     describe_holder(got.holder),
                     extra={"subscription": ctx.name})
            (reply,) = await ctx.client.pipeline([command(got.holder)], timeout=timeout)
            got = parse_claim(reply)
        if not got.ok:
            raise refusal(ctx.name, me, key, got, legacy_key)
        if got.holder and got.holder.split(" ", 1)[0] != ctx.consumer.token and ctx.takeover:
            log.warning("%s: took consumer name %r over from %s (takeover=True)", ctx.name, me,
                        describe_holder(got.holder), extra={"subscription": ctx.name})

    async def renew(self, ctx: Context, command: Command, timeout: float) -> None:
        """Send the :data:`~._core._identity.RENEW` ``command``; an error log
        (once per holder) when another process holds the key."""
        (reply,) = await ctx.client.pipeline([command], timeout=timeout)
        if reply == 1:
            self._holder = ""
            return
        holder = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
        if holder != self._holder:
            self._holder = holder
            log.error("%s: consumer name %r was taken over by %s; this process no longer "
                      "renews its heartbeat (stop it: two processes with one consumer name "
                      "handle each other's pending deliveries twice)", ctx.name,
                      ctx.consumer.name, describe_holder(holder), extra={"subscription": ctx.name})
