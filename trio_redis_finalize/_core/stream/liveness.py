"""Stream consumers' presence, sans-IO: heartbeat keys, the group's registry,
the reaper's script and what a look at the group decides.

A stream mount keeps two keys beside its stream (in its hash slot):

* ``{stream}:stream-consumers:<stream>,<group>`` (:func:`registry_key`): a
  hash, consumer name -> its registration (``"<heartbeat ms> <mode>"``,
  :func:`registration`); every live consumer of the library registers itself
  there with each heartbeat;
* ``{stream}:stream-heartbeat:<stream>,<group>,<consumer>``
  (:func:`heartbeat_key`): a key with a TTL of ``heartbeat`` seconds,
  renewed every ``heartbeat / 3`` while the consumer runs (:func:`beat`);
  it holds the owning process's token, claimed at mount: one live process
  per consumer name (``_identity``).

Each name is escaped (``_keys.named``), so that no two (stream, group,
consumer) share a key.  The naming before (``{stream}:consumers:<group>``,
``{stream}:heartbeat:<group>:<consumer>``: :func:`legacy_registry_key`,
:func:`legacy_heartbeat_key`) is still read: a look takes over a dead
consumer registered there (an earlier version's), and a claim at mount is
refused while this name's old heartbeat key is alive.  Old heartbeat keys
expire with their TTL; an old registry is emptied as its consumers are
reaped or mount again under the new naming.

A look at the group (:func:`survey`: ``XINFO CONSUMERS``, the registry, the
``PTTL`` of each registered consumer's heartbeat key) sorts its consumers:

* **alive**: registered, heartbeat key present -- nothing to do (the look
  after its key would lapse is planned: :attr:`Survey.wake`);
* **stopped**: registered with the stopped mark (:func:`stopped_value`, set by
  :data:`STOP` at a clean stop), heartbeat key gone -- its entries were
  handed back (made idle at once), so :data:`REAP` takes them at the next
  look, as for a lapsed one; a live mount looks as soon as a
  :func:`stop_probe` finds a new mark (every ``STOP_PROBE`` seconds);
* **lapsed**: registered, heartbeat key gone -- dead.  :data:`REAP` (one
  gated script) takes the entries it holds that have been idle its
  ``heartbeat`` (so an entry a live consumer whose key vanished still
  leases is never taken), with ``RETRYCOUNT`` one higher (the crash counts
  as an attempt), and once nothing is pending for it deletes the consumer
  from the group (``XGROUP DELCONSUMER``) and from the registry.  Not in
  ``Mode.CLAIMING`` (its PEL holds delayed retries; its own ``XAUTOCLAIM``
  takes them back after ``min_idle``), nor from a consumer registered as
  CLAIMING: there the script only deletes a consumer whose PEL is empty;
* **none**: never registered (another client, a consumer of a version
  without heartbeats): its pending entries are *stranded* in PLAIN mode --
  warned about (:func:`warnings`), counted (:attr:`Survey.stranded`), never
  taken; RECLAIM and CLAIMING claim them once idle ``min_idle``.

A cleanly stopping mount hands back what it read and did not finalize
(:data:`STOP`): its heartbeat key deleted, its registration replaced by the
stopped mark, every entry still pending for it made idle at once (``XCLAIM
... IDLE``, owner and delivery count unchanged), so a live consumer of the
group takes them within a look (:data:`REAP`, RECLAIM's and CLAIMING's
``XAUTOCLAIM``), or the same name started again re-reads them at once.  The
stopped mark stays in the registry (``inspect`` shows it) until a look finds
nothing pending for it and removes it with the consumer; a consumer that
stops with nothing pending is deleted from the group and the registry at
once.
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
from .._commands import Command, Script
from .._decode import Entry
from .._finalize import Record
from .._identity import claim, heartbeat_value, renew

__all__ = [
    "HANDED_BACK_IDLE_MS", "HEARTBEAT_FLOOR", "REAP", "STOP", "STOP_PROBE", "Heartbeat",
    "Peer", "Reap", "Reaped", "Registration", "Survey", "beat", "claim_name", "consumer_rows",
    "heartbeat_key", "lease_every", "legacy_heartbeat_key", "legacy_registry_key", "parse_reap",
    "peers", "registration", "registration_value", "registry", "registry_key", "stop_probe",
    "stopped_value", "survey", "warnings", "watch_notes",
]

STOP_PROBE = 0.5
"""Seconds between two looks of a live mount at the registry for a new
stopped mark (one ``HGETALL``): a peer's hand-back is taken over within
about this, or the read's ``block`` when longer (the probe runs between two
reads)."""

HANDED_BACK_IDLE_MS = 10**12
"""The idle time (ms, about 31 years) :data:`STOP` gives the entries it hands
back: past every ``heartbeat`` and ``min_idle``, below the server's clock
(``XCLAIM ... IDLE`` must not reach before the epoch)."""

HEARTBEAT_FLOOR = 0.01
"""Seconds: a shorter heartbeat cannot be renewed (every ``heartbeat / 3``) in time."""


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


def lease_every(mode: Mode, min_idle: float, heartbeat: float) -> float:
    """Seconds between two lease renewals of the entries in hand.

    A third of the shortest idle time after which another consumer may take
    an entry: the reaper's guard (``heartbeat``) in PLAIN and RECLAIM, and
    ``min_idle`` (XAUTOCLAIM) in RECLAIM and CLAIMING.
    """
    if mode is Mode.PLAIN:
        return heartbeat / 3
    if mode is Mode.CLAIMING:
        return max(min_idle / 3, 0.001)
    return max(min(min_idle, heartbeat) / 3, 0.001)


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """What a consumer wrote about itself in the registry."""

    heartbeat: float | None
    """Its heartbeat in seconds (None: unreadable)."""
    mode: Mode | None
    at: float | None = None
    """Unix time of its last beat, or of its stop (None: not written)."""
    stopped: bool = False
    """The stopped mark: it stopped cleanly and handed its entries back (:data:`STOP`)."""


def registration_value(heartbeat: float, mode: Mode, at: float | None = None, *,
                       stopped: bool = False) -> str:
    """``"<heartbeat ms> <mode>[ <unix ms>[ stopped]]"``."""
    value = f"{max(1, round(heartbeat * 1000))} {mode.value}"
    if at is not None:
        value += f" {round(at * 1000)}"
        if stopped:
            value += " stopped"
    return value


def stopped_value(heartbeat: float, mode: Mode, at: float) -> str:
    """The stopped mark :data:`STOP` writes in the registry."""
    return registration_value(heartbeat, mode, at, stopped=True)


def registration(value: bytes | str) -> Registration:
    """A registry value as :class:`Registration` (unknown parts None)."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    parts = text.split(" ")
    try:
        hb: float | None = int(parts[0]) / 1000
    except ValueError:
        hb = None
    try:
        m: Mode | None = Mode(parts[1]) if len(parts) > 1 else None
    except ValueError:
        m = None
    at: float | None = None
    if len(parts) > 2:
        try:
            at = int(parts[2]) / 1000
        except ValueError:
            at = None
    return Registration(hb, m, at, len(parts) > 3 and parts[3] == "stopped")


def beat(stream: str, group: str, consumer: str, token: str, heartbeat: float, mode: Mode,
         ttl: float, at: float | None = None) -> Command:
    """A heartbeat: the key with a TTL of ``ttl`` seconds, and the
    registration (with ``at``, the unix time of the beat: a look tells when
    it lapsed); only while the key is this process's (``token``) or absent
    (:data:`~._identity.RENEW`)."""
    return renew(heartbeat_key(stream, group, consumer), registry_key(stream, group),
                 heartbeat_value(token, heartbeat), ttl, consumer,
                 registration_value(heartbeat, mode, at))


def claim_name(stream: str, group: str, consumer: str, token: str, heartbeat: float, mode: Mode,
               takeover: bool | str, at: float | None = None) -> Command:
    """The first heartbeat, at mount: the claim of the consumer name
    (:data:`~._identity.CLAIM`)."""
    return claim((heartbeat_key(stream, group, consumer), registry_key(stream, group),
                  legacy_heartbeat_key(stream, group, consumer), legacy_registry_key(stream, group)),
                 heartbeat_value(token, heartbeat), heartbeat, takeover, consumer,
                 registration_value(heartbeat, mode, at))


def stop_probe(flat: Sequence[bytes], me: str, seen: Collection[tuple[str, float | None]]
               ) -> list[tuple[str, float | None]]:
    """The stopped marks in a registry (``HGETALL``) of consumers other than
    ``me`` not in ``seen``: (name, stop time) each; a look is due when any."""
    out: list[tuple[str, float | None]] = []
    for name, reg in registry(flat).items():
        if name != me and reg.stopped and (name, reg.at) not in seen:
            out.append((name, reg.at))
    return out


# KEYS: stream, heartbeat (the dead consumer's heartbeat key), registry
# ARGV: group, dead (the dead consumer), me, min_idle_ms, page, ids... (id, id, ...)
# Gated on the heartbeat key being absent (the consumer came back: -1).
# Takes each id (the reaper looked them up: XPENDING ... IDLE, at most `page`)
# that is still pending for the dead consumer and idle `min idle`, with its
# delivery count one higher (the crash counts as an attempt); one another
# consumer took meanwhile is not pending for the dead one any more, one
# touched since is not idle enough: racing reapers take each entry once.
# Then, when nothing is pending for the dead consumer any more, deletes it
# from the group and from the registry.
# Returns {taken, gone, wait, forgotten}: taken = {id, fields, count} each;
# gone = ids the stream no longer has (Redis 6.2 claims them as nil, 7+ drops
# them from the PEL); wait = ms until the next entry left is idle enough (-1:
# none left, or page 0: nothing is to be taken); forgotten = 1 when the
# consumer was deleted.
REAP = Script(
    """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local group, dead, me = ARGV[1], ARGV[2], ARGV[3]
local min_idle, page = tonumber(ARGV[4]), tonumber(ARGV[5])
local taken, gone = {}, {}
for i = 6, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], group, 'IDLE', min_idle, ARGV[i], ARGV[i], 1, dead)
  if #p > 0 then
    local n = tonumber(p[1][4]) + 1
    local c = redis.call('XCLAIM', KEYS[1], group, me, 0, ARGV[i], 'RETRYCOUNT', n)
    if c[1] then taken[#taken + 1] = {c[1][1], c[1][2], n} else gone[#gone + 1] = ARGV[i] end
  end
end
local rest = redis.call('XPENDING', KEYS[1], group, '-', '+', math.max(page, 1), dead)
if #rest == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], group, dead)
  redis.call('HDEL', KEYS[3], dead)
  return {taken, gone, -1, 1}
end
local wait = -1
if page > 0 then
  for _, r in ipairs(rest) do
    local w = math.max(0, min_idle - tonumber(r[3]))
    if wait < 0 or w < wait then wait = w end
  end
end
return {taken, gone, wait, 0}
""",
    name="stream_reap", keys=("stream", "heartbeat", "registry"),
    argv=("group", "dead", "me", "min_idle_ms", "page", "ids..."),
)

# KEYS: stream, heartbeat (the own heartbeat key), registry
# ARGV: group, consumer, stopped (the stopped mark), idle_ms, all (1: the
#   whole own PEL; 0: only the ids that follow, each while still pending for
#   it), value (the own heartbeat's), ids... (id, id, ...)
# Nothing is done while another process holds the name's heartbeat (it took
# the name over: what is pending is its own now).
# A consumer's clean stop, after its handlers and finalizer ended: what is
# still pending for it (read and not finalized: unstarted and given back with
# its count set back, cut by the grace, waiting for a backoff) is handed back:
# made idle `idle ms` with ``XCLAIM ... IDLE n JUSTID`` (owner and delivery
# count unchanged), so a live consumer takes it at once (the reaper, which
# honours the stopped mark, counts one more as for every taking: the given
# back ones come back at the attempt they had), and the registration is
# replaced by the stopped mark.  Nothing pending: the consumer is deleted from
# the group and the registry.  Either way the heartbeat key is deleted.  A
# group that is gone: the registration and key deleted.
# Returns {handed back, 1 when entries are left pending for it}.
STOP = Script(
    """
local group, me = ARGV[1], ARGV[2]
local hb = redis.call('GET', KEYS[2])
if hb and hb ~= ARGV[6] then return {0, 0} end
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], group, '-', '+', 1, me)
if not ok then
  redis.call('HDEL', KEYS[3], me)
  redis.call('DEL', KEYS[2])
  return {0, 0}
end
local n = 0
if #p == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], group, me)
elseif ARGV[5] == '1' then
  local lo = '-'
  while true do
    local rows = redis.call('XPENDING', KEYS[1], group, lo, '+', 500, me)
    if #rows == 0 then break end
    local args = {KEYS[1], group, me, 0}
    for _, r in ipairs(rows) do args[#args + 1] = r[1] end
    args[#args + 1] = 'IDLE'
    args[#args + 1] = ARGV[4]
    args[#args + 1] = 'JUSTID'
    redis.call('XCLAIM', unpack(args))
    local ids = rows
    n = n + #ids
    if #rows < 500 then break end
    lo = '(' .. rows[#rows][1]
  end
else
  for i = 7, #ARGV do
    if #redis.call('XPENDING', KEYS[1], group, ARGV[i], ARGV[i], 1, me) > 0 then
      redis.call('XCLAIM', KEYS[1], group, me, 0, ARGV[i], 'IDLE', ARGV[4], 'JUSTID')
      n = n + 1
    end
  end
end
if #p == 0 then
  redis.call('HDEL', KEYS[3], me)
else
  redis.call('HSET', KEYS[3], me, ARGV[3])
end
redis.call('DEL', KEYS[2])
if #p == 0 then return {0, 0} end
return {n, 1}
""",
    name="stream_stop", keys=("stream", "heartbeat", "registry"),
    argv=("group", "consumer", "stopped", "idle_ms", "all", "value", "ids..."),
)


# -- a look at the group --------------------------------------------------------

class Heartbeat(enum.Enum):
    """A consumer's heartbeat as a look at the group found it."""

    ALIVE = "alive"
    """Registered; its heartbeat key is there."""
    LAPSED = "lapsed"
    """Registered; its heartbeat key is gone: dead."""
    STOPPED = "stopped"
    """Registered with the stopped mark, its heartbeat key gone: it stopped
    cleanly and handed its entries back (:data:`STOP`)."""
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


@dataclasses.dataclass(frozen=True, slots=True)
class Reaped:
    """A :data:`REAP` reply."""

    entries: list[Entry]
    counts: dict[bytes, int]
    """Each taken entry's delivery count now (the attempt it counts)."""
    gone: list[bytes]
    wait: float | None
    """Seconds until the next entry left is idle enough (None: none left to wait for)."""
    forgotten: bool


def parse_reap(reply: Any) -> Reaped | None:
    """A :data:`REAP` reply; None when the consumer's heartbeat came back."""
    if not isinstance(reply, list):
        return None
    taken, gone, wait, forgotten = reply
    entries: list[Entry] = [(t[0], t[1]) for t in taken]
    counts = {t[0]: int(t[2]) for t in taken}
    return Reaped(entries, counts, list(gone), None if int(wait) < 0 else int(wait) / 1000,
                  bool(forgotten))


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
