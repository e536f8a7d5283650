"""A look at a stream group, sans-IO: who is alive, who is dead, what to take.

The registry's values (:class:`Registration`), then what a look at the group
decides (:func:`survey`): ``XINFO CONSUMERS`` (:func:`consumer_rows`), the
registry (``HGETALL``, :func:`registry`) and the ``PTTL`` of each registered
consumer's heartbeat key sort its consumers into alive, stopped, lapsed and
none (:func:`peers`; the states are described in :mod:`.liveness`, which
holds the heartbeat, the lease and the stop); a lapsed or stopped one's
entries are taken by :data:`REAP` calls (:class:`Reap`; its reply is read
by ``decode.parse_reap``), stranded work is warned about (:func:`warnings`,
:func:`watch_notes`), and the live peers that claim idle entries are named
with their ``min_idle`` (:func:`claimers`), which make the lease period
(:func:`lease_every`, :func:`shorter_notes`; see :mod:`.liveness`); the
first look's live peers with a longer lease bound lengthen a claiming
mount's ``min_idle`` for a warm-up as long as their registered ``block``
asks (:func:`warm_up`, see :mod:`.liveness`).  The
keys a look reads are named here (:func:`registry_key`,
:func:`heartbeat_key`, and those of the naming before), and the heartbeat
writes them.  ``_forms/stream/liveness.py`` sends the commands.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ..._keys import derived, named
from ..._subscription import Mode
from .._commands import Command
from .._finalize import Record

__all__ = [
    "BLOCK_PART", "MIN_IDLE_PART", "Heartbeat", "Peer", "Reap", "Registration", "Survey",
    "WarmUp", "claim_min_idle", "claimers", "consumer_rows", "heartbeat_key", "lease_every",
    "lease_guard", "legacy_heartbeat_key", "legacy_registry_key", "peer_bound", "peers",
    "registration", "registry", "registry_key", "shorter_notes", "survey", "warm_up",
    "warm_up_note", "warnings", "watch_notes",
]


# -- the keys a look reads (the heartbeat writes them: :mod:`.liveness`) ----------------

@functools.lru_cache(maxsize=4096)
def registry_key(stream: str, group: str) -> str:
    """The hash of the library's consumers of ``group`` (name -> registration)."""
    return named(stream, "stream-consumers", group)


@functools.lru_cache(maxsize=4096)
def heartbeat_key(stream: str, group: str, consumer: str) -> str:
    """The key whose TTL says ``consumer`` of ``group`` is alive."""
    return named(stream, "stream-heartbeat", group, consumer)


@functools.lru_cache(maxsize=4096)
def legacy_registry_key(stream: str, group: str) -> str:
    """:func:`registry_key` of the naming before (not one-to-one; read only)."""
    return derived(stream, f":consumers:{group}")


@functools.lru_cache(maxsize=4096)
def legacy_heartbeat_key(stream: str, group: str, consumer: str) -> str:
    """:func:`heartbeat_key` of the naming before (not one-to-one; read only)."""
    return derived(stream, f":heartbeat:{group}:{consumer}")


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """What a consumer wrote about itself in the registry."""

    heartbeat: float | None
    """Its heartbeat in seconds (None: unreadable)."""
    mode: Mode | None
    at: float | None = None
    """Unix time of its last beat, or of its stop (None: not written)."""
    stopped: bool = False
    """The stopped mark: it stopped cleanly and handed its entries back (:data:`~.liveness.STOP`)."""
    min_idle: float | None = None
    """Seconds after which it claims an idle entry (RECLAIM, CLAIMING); None:
    not written (PLAIN, or a version before it was registered)."""
    block: float | None = None
    """Seconds one of its reads blocks, between two of its registry probes
    (None: a version before it was registered)."""

    @property
    def claims(self) -> bool:
        """It claims entries idle its known ``min_idle`` (``XAUTOCLAIM``)."""
        return self.mode in (Mode.RECLAIM, Mode.CLAIMING) and self.min_idle is not None


MIN_IDLE_PART = "min_idle="
"""The registration's last part that gives a claiming consumer's ``min_idle``
(ms): after the positional ones, so a reader that knows only those reads the
rest as before (:func:`~.liveness.registration_value`)."""

BLOCK_PART = "block="
"""The part before :data:`MIN_IDLE_PART` that gives a consumer's read ``block``
(ms): a reader that knows only ``min_idle`` (last) reads it as before."""


def _ms(text: str) -> float | None:
    try:
        return int(text) / 1000
    except ValueError:
        return None


def registration(value: bytes | str) -> Registration:
    """A registry value as :class:`Registration` (unknown parts None): the
    positional parts, then named ones (``name=<ms>``, any unknown ignored)."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    parts = text.split(" ")
    named: dict[str, float | None] = {}
    while len(parts) > 1 and "=" in parts[-1]:
        key, _, ms = parts.pop().partition("=")
        named.setdefault(key + "=", _ms(ms))
    try:
        m: Mode | None = Mode(parts[1]) if len(parts) > 1 else None
    except ValueError:
        m = None
    return Registration(_ms(parts[0]), m, _ms(parts[2]) if len(parts) > 2 else None,
                        len(parts) > 3 and parts[3] == "stopped", named.get(MIN_IDLE_PART),
                        named.get(BLOCK_PART))


# -- a look at the group --------------------------------------------------------

class Heartbeat(enum.Enum):
    """A consumer's heartbeat as a look at the group found it."""

    ALIVE = "alive"
    """Registered; its heartbeat key is there."""
    LAPSED = "lapsed"
    """Registered; its heartbeat key is gone: dead."""
    STOPPED = "stopped"
    """Registered with the stopped mark, its heartbeat key gone: it stopped
    cleanly and handed its entries back (:data:`~.liveness.STOP`)."""
    NONE = "none"
    """Never registered: another client, or a consumer without heartbeats."""


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """One consumer of the group."""

    name: str
    pending: int
    idle: float | None
    """Seconds since its last interaction with the group (None: not in the group)."""
    heartbeat: Heartbeat
    ttl: float | None
    """Seconds its heartbeat key still lives (None: not alive, or no expiry)."""
    registration: Registration | None

    @property
    def stranded(self) -> bool:
        """Entries pending for it, and no live heartbeat."""
        return self.pending > 0 and self.heartbeat is not Heartbeat.ALIVE


def _pairs(row: Sequence[Any]) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else str(k)): v
            for k, v in zip(row[::2], row[1::2], strict=False)}


def consumer_rows(reply: Sequence[Any]) -> list[tuple[str, int, int | None]]:
    """``XINFO CONSUMERS`` (RESP2) as (name, pending, idle ms) rows."""
    out: list[tuple[str, int, int | None]] = []
    for row in reply:
        info = _pairs(row)
        name = info.get("name", b"")
        idle = info.get("idle")
        out.append((name.decode(errors="replace") if isinstance(name, bytes) else str(name),
                    int(info.get("pending", 0)), None if idle is None else int(idle)))
    return out


def registry(flat: Sequence[bytes]) -> dict[str, Registration]:
    """``HGETALL`` of the registry as name -> :class:`Registration`."""
    return {k.decode(errors="replace"): registration(v)
            for k, v in zip(flat[::2], flat[1::2], strict=True)}


def peers(rows: Sequence[tuple[str, int, int | None]], registered: Mapping[str, Registration],
          ttls: Mapping[str, int]) -> list[Peer]:
    """The group's consumers (``rows``, :func:`consumer_rows`) and the registered
    ones it does not have (yet, or any more), each with its heartbeat.

    ``ttls``: the ``PTTL`` of each registered consumer's heartbeat key (-2:
    gone, -1: no expiry, else ms).
    """
    out: list[Peer] = []
    seen: set[str] = set()
    for name, pending, idle in [*rows, *((n, 0, None) for n in registered)]:
        if name in seen:
            continue
        seen.add(name)
        reg = registered.get(name)
        ttl = ttls.get(name, -2) if reg is not None else -2
        if reg is None:
            hb = Heartbeat.NONE
        elif ttl == -2:
            hb = Heartbeat.STOPPED if reg.stopped else Heartbeat.LAPSED
        else:
            hb = Heartbeat.ALIVE
        out.append(Peer(name, pending, None if idle is None else idle / 1000, hb,
                        ttl / 1000 if ttl >= 0 else None, reg))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Reap:
    """One :data:`REAP` call a look decided."""

    peer: Peer
    page: int
    """Entries to take at most (0: none, only delete the consumer once its PEL is empty)."""
    min_idle: float
    """Seconds an entry must have been idle to be taken (the dead consumer's heartbeat)."""

    @property
    def min_idle_ms(self) -> int:
        return max(1, round(self.min_idle * 1000))

    def candidates(self, stream: str, group: str) -> Command:
        """The ``XPENDING`` of the entries :data:`REAP` is to take (idle enough, one page)."""
        return ("XPENDING", stream, group, "IDLE", self.min_idle_ms, "-", "+", self.page,
                self.peer.name)

    def args(self, group: str, me: str, ids: Sequence[bytes] = ()) -> list[str | int | bytes]:
        return [group, self.peer.name, me, self.min_idle_ms, self.page, *ids]


@dataclasses.dataclass(frozen=True, slots=True)
class Survey:
    """What a look at the group found and decided (:func:`survey`)."""

    peers: tuple[Peer, ...]
    """The group's other consumers (all but the one that looked)."""
    reap: tuple[Reap, ...]
    """Dead consumers: their entries to take, or their names to delete."""
    stranded: int
    """Entries pending for other consumers without a live heartbeat (lapsed or none)."""
    wake: float | None
    """Seconds until the first live consumer's heartbeat key would lapse (None: none)."""


def survey(me: str, mode: Mode, heartbeat: float, page: int, found: Sequence[Peer]) -> Survey:
    """Sort the group's consumers (see the module docstring) for consumer ``me``.

    ``page``: entries one :data:`REAP` takes at most.  A dead consumer's
    entries are taken once idle its own registered heartbeat (this
    consumer's ``heartbeat`` when unreadable).
    """
    others = tuple(p for p in found if p.name != me)
    reap: list[Reap] = []
    for p in others:
        if p.heartbeat not in (Heartbeat.LAPSED, Heartbeat.STOPPED):
            continue
        reg = p.registration
        takes = mode is not Mode.CLAIMING and (reg is None or reg.mode is not Mode.CLAIMING)
        hb = reg.heartbeat if reg is not None and reg.heartbeat is not None else heartbeat
        reap.append(Reap(p, page if takes and p.pending else 0, hb))
    lapse = [p.ttl for p in others if p.heartbeat is Heartbeat.ALIVE and p.ttl is not None]
    return Survey(others, tuple(reap), sum(p.pending for p in others if p.stranded),
                  min(lapse) if lapse else None)


def claimers(found: Survey) -> dict[str, float]:
    """The group's other live consumers that claim idle entries (RECLAIM,
    CLAIMING), each with the ``min_idle`` it registered.  Left out: a lapsed
    or stopped one (it claims nothing while dead), one never registered or
    registered by a version before ``min_idle`` was (not known)."""
    out: dict[str, float] = {}
    for p in found.peers:
        reg = p.registration
        if (p.heartbeat is Heartbeat.ALIVE and reg is not None and reg.claims
                and reg.min_idle is not None and reg.min_idle > 0):
            out[p.name] = reg.min_idle
    return out


def lease_guard(mode: Mode, min_idle: float, heartbeat: float) -> float:
    """Seconds after which another consumer may take an entry this one holds,
    as far as its own settings tell: the reaper's guard (``heartbeat``) in
    PLAIN and RECLAIM, and ``min_idle`` (XAUTOCLAIM) in RECLAIM and CLAIMING."""
    if mode is Mode.PLAIN:
        return heartbeat
    if mode is Mode.CLAIMING:
        return min_idle
    return min(min_idle, heartbeat)


def lease_every(mode: Mode, min_idle: float, heartbeat: float,
                peers: float | None = None) -> float:
    """Seconds between two lease renewals of the entries in hand.

    A third of the shortest idle time after which another consumer may take
    an entry: :func:`lease_guard`, or ``peers`` when shorter -- the shortest
    ``min_idle`` of the group's live consumers that claim (RECLAIM,
    CLAIMING; :func:`claimers`), as the last look found them
    (None: none known).
    """
    guard = lease_guard(mode, min_idle, heartbeat)
    if peers is not None:
        guard = min(guard, peers)
    return max(guard / 3, 0.001)


def shorter_notes(name: str, mode: Mode, min_idle: float, heartbeat: float,
                  claimers: Mapping[str, float], warned: Collection[tuple[str, float]]
                  ) -> list[Record]:
    """A warning for each live peer (``claimers``: name -> its ``min_idle``,
    :func:`claimers`) that claims entries idle less than this
    subscription's :func:`lease_guard`, not in ``warned`` (name, min_idle)
    yet: it names the peer, both settings and the lease period they make."""
    guard = lease_guard(mode, min_idle, heartbeat)
    every = lease_every(mode, min_idle, heartbeat, min(claimers.values(), default=None))
    ours = (f"heartbeat={heartbeat:g} s (Mode.PLAIN)" if mode is Mode.PLAIN
            else f"min_idle={min_idle:g} s" + (f" (heartbeat={heartbeat:g} s)"
                                              if heartbeat < min_idle and mode is Mode.RECLAIM
                                              else ""))
    return [(logging.WARNING,
             "%s: consumer %r of the group claims entries idle min_idle=%g s, shorter than "
             "this subscription's %s: while it lives, the entries in hand here are leased "
             "every %g s (a third of the shortest) so that it takes none a handler holds; "
             "give the group's subscriptions one min_idle",
             (name, peer, theirs, ours, every), {"subscription": name})
            for peer, theirs in sorted(claimers.items())
            if theirs < guard and (peer, theirs) not in warned]


@dataclasses.dataclass(frozen=True, slots=True)
class WarmUp:
    """A claiming mount's claims after its first registration (:func:`warm_up`)."""

    min_idle: float
    """Seconds an entry must idle to be claimed during the window."""
    seconds: float
    """The window, from the first registration."""
    peer: str
    """The live peer whose bound is :attr:`min_idle` (the first by name on a tie)."""


def peer_bound(reg: Registration | None) -> float | None:
    """Seconds an entry a peer holds may idle before its lease renews it while
    it has not seen a peer that claims sooner: its :func:`lease_guard`; its
    ``heartbeat`` without a ``min_idle`` (PLAIN, an earlier version); None
    when the registration tells neither."""
    if reg is None or reg.min_idle is None or reg.mode not in (Mode.RECLAIM, Mode.CLAIMING):
        return None if reg is None else reg.heartbeat
    return lease_guard(reg.mode, reg.min_idle, reg.heartbeat or reg.min_idle)


def warm_up(mode: Mode, min_idle: float, block: float, probe: float, found: Survey,
            margin: float = 0.5) -> WarmUp | None:
    """The first look's (``found``) warm-up: until the live peers whose
    :func:`peer_bound` is longer than ``min_idle`` surely saw this mount's
    registration (within ``probe``, :data:`~.liveness.SEEN_WITHIN`, and a
    read's ``block``: the longest they registered, this mount's ``block``
    for one that registered none) and renewed (their longest lease period),
    its claims ask the longest of those bounds.  None: PLAIN, or no live
    peer's bound is longer (nothing changes)."""
    longer = [(-b, p.name, block if r.block is None else r.block) for p in found.peers
              if p.heartbeat is Heartbeat.ALIVE and (r := p.registration) is not None
              and (b := peer_bound(r)) is not None and b > min_idle]
    if mode is Mode.PLAIN or not longer:
        return None
    neg, peer, _ = min(longer)  # the longest bound, the first name on a tie
    return WarmUp(-neg, probe + max(w[2] for w in longer) - neg / 3 + margin, peer)


def claim_min_idle(min_idle: float, warm: WarmUp | None, elapsed: float | None) -> float:
    """The claims' ``min_idle`` now: ``warm``'s while ``elapsed`` (seconds
    since the first registration; None: not yet) is inside its window."""
    if warm is None or (elapsed is not None and elapsed >= warm.seconds):
        return min_idle
    return max(min_idle, warm.min_idle)


def warm_up_note(name: str, min_idle: float, warm: WarmUp) -> Record:
    """The note that the warm-up lengthens the claims' ``min_idle``, naming the peer."""
    return (logging.INFO,
            "%s: for %.1f s after mounting, this subscription claims entries idle "
            "min_idle=%g s, not its own %g s: live consumer %r of the group may hold entries "
            "idle that long until it sees this subscription's registration",
            (name, warm.seconds, warm.min_idle, min_idle, warm.peer), {"subscription": name})


def _utc(t: float) -> str:
    """A unix time as ``HH:MM:SS.mmm UTC`` (the day left out: a log line has it)."""
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d} UTC"


def _n(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def warnings(name: str, mode: Mode, min_idle: float, found: Survey,
             warned: Collection[str]) -> list[Record]:
    """Log records about stranded work (consumers not in ``warned`` yet).

    A consumer without a heartbeat holding entries: a warning in PLAIN mode
    (nothing takes them: how to recover them), a note in RECLAIM and
    CLAIMING (claimed once idle ``min_idle``).  A dead registered consumer
    holding entries: when they are taken over (or, CLAIMING, claimed back).
    """
    out: list[Record] = []
    extra = {"subscription": name}
    reaped = {r.peer.name: r for r in found.reap}
    for p in found.peers:
        if p.name in warned or not p.stranded:
            continue
        idle = "-" if p.idle is None else f"{p.idle:.1f}"
        if p.heartbeat is Heartbeat.NONE:
            if mode is Mode.PLAIN:
                out.append((logging.WARNING,
                            "%s: %s pending for consumer %r (idle %s s) are stranded: it has no "
                            "heartbeat (another client, or a consumer without heartbeats), and "
                            "Mode.PLAIN takes over only dead consumers that kept one.  To "
                            "recover them: mount this group once with Mode.RECLAIM (it claims "
                            "entries idle min_idle), XCLAIM them, or start that consumer again "
                            "under its name (open_consumer(name=...))",
                            (name, _n(p.pending), p.name, idle), extra))
            else:
                out.append((logging.INFO,
                            "%s: %s pending for consumer %r (idle %s s, no heartbeat); claimed "
                            "by this subscription once idle min_idle=%g s",
                            (name, _n(p.pending), p.name, idle, min_idle), extra))
            continue
        r = reaped[p.name]
        reg = p.registration
        if p.heartbeat is Heartbeat.STOPPED:
            at = "" if reg is None or reg.at is None else f" at {_utc(reg.at)}"
            out.append((logging.INFO,
                        "%s: %s of consumer %r, which stopped cleanly%s and handed them back; "
                        "%s",
                        (name, _n(p.pending), p.name, at,
                         "taking them over now" if r.page else
                         "a CLAIMING subscription claims them (idle at once)"), extra))
            continue
        lapsed = ("" if reg is None or reg.at is None or reg.heartbeat is None
                  else f", heartbeat lapsed at {_utc(reg.at + reg.heartbeat)}")
        if r.page:
            left = max(0.0, r.min_idle - (p.idle or 0.0))
            when = "now" if left == 0 else f"in about {left:.1f} s (once idle heartbeat={r.min_idle:g} s)"
            out.append((logging.WARNING,
                        "%s: %s of consumer %r%s (idle %s s), taken over %s; their attempt "
                        "counts the crash",
                        (name, _n(p.pending), p.name, lapsed, idle, when), extra))
        else:
            out.append((logging.INFO,
                        "%s: %s of consumer %r (Mode.CLAIMING)%s (idle %s s); a CLAIMING "
                        "subscription claims them back once idle min_idle",
                        (name, _n(p.pending), p.name, lapsed, idle), extra))
    return out


def watch_notes(name: str, found: Survey, now: float) -> list[Record]:
    """At mount (the first look): one note per other consumer that holds
    entries and whose heartbeat is still alive -- a consumer killed moments
    ago looks alive until its key lapses, so say when its entries would be
    taken over should it be dead (``now``: the unix time)."""
    out: list[Record] = []
    for p in found.peers:
        if p.heartbeat is not Heartbeat.ALIVE or not p.pending or p.ttl is None:
            continue
        out.append((logging.INFO,
                    "%s: %s of consumer %r, heartbeat alive until %s: should it be dead (killed "
                    "just now), taken over in about %.1f s",
                    (name, _n(p.pending), p.name, _utc(now + p.ttl), p.ttl),
                    {"subscription": name}))
    return out
