"""Stream consumers' liveness, sans-IO: the heartbeat, the lease period, the
stop's and the reaper's scripts.

A look at the group -- the keys it reads, what it decides (who is alive, who
is dead, what to take, what to warn about, a claiming mount's warm-up) -- is
in :mod:`.survey` (the key names are re-exported here: the heartbeat writes
them): one module for all the functions a catch-up's look calls; the
reaper's script (:data:`REAP`, a constant the look sends) is here, with the
stop's.  ``_forms/stream/liveness.py`` sends the commands and keeps the
times.

A stream mount keeps two keys beside its stream (in its hash slot):

* ``{stream}:stream-consumers:<stream>,<group>`` (:func:`registry_key`): a
  hash, consumer name -> its registration (``"<heartbeat ms> <mode> <unix
  ms> block=<ms>"``, its read's ``block``, and ``min_idle=<ms>`` last in
  RECLAIM and CLAIMING: :func:`registration_value`, :func:`registration`);
  every live consumer of the library registers itself there with each
  heartbeat;
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

A look at the group (:func:`~.survey.survey`: ``XINFO CONSUMERS``, the
registry, the ``PTTL`` of each registered consumer's heartbeat key) sorts its
consumers:

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

The lease period (:func:`lease_every`): the entries a consumer holds are
renewed every third of the shortest idle time after which another consumer
may take one: its own :func:`lease_guard`, or the ``min_idle`` a live peer
of the group registered as claiming (RECLAIM, CLAIMING:
:func:`~.survey.claimers`) when shorter -- a peer mounted with a shorter
``min_idle`` (a rolling deploy that changes it) would otherwise claim
entries still being handled.  The peers are as the last look found them: a
mount's first look runs in its first catch-up, before its first read (the
own-PEL recovery at a restart hands over its entries just before it), so
until then, and while no look succeeded, the period is the consumer's own;
between two looks a registry probe (:func:`claimer_probe`, with the stop
probe) makes a look as soon as such a peer registers or beats again after a
lapse, and the lease's wait is cut short when the period shrinks.  While
the read loop does not probe (it waits for busy handlers to take what it
read, or a step is slow: the probe overdue, :func:`follow_at`), the lease
reads the registry itself every :data:`STOP_PROBE` as long as it holds
entries, and follows such a peer once its heartbeat key is there
(:func:`alive_claimers`; the look, its reaping and hand-over stay the read
loop's).  A peer whose heartbeat lapsed, or that stopped, is not followed
(the next look lengthens the period again); a warning names each such peer
and both settings once per ``min_idle`` it registered
(:func:`~.survey.shorter_notes`; the period and its notes are in
:mod:`.survey`: a look computes them).
The peer's first claims, before this consumer's probe sees its
registration, wait: for a warm-up after its first registration a RECLAIM or
CLAIMING mount claims only entries idle the longest lease bound of the live
peers its first look found (:func:`~.survey.warm_up`: a peer's bound is what
it renews against before it sees the new one, :func:`~.survey.peer_bound`),
until each surely looked again and renewed: :data:`SEEN_WITHIN`, a read's
``block`` (the longest those peers registered: each reads the registry
between two of its reads, or by its lease once its probe is late by its
``block``, :func:`follow_at`; the new mount's own for a peer of a version
before ``block`` was registered), the longest of their lease periods and
a margin.  Limits: a consumer that never registered (another client, a
version without heartbeats) is not known.

Why the stream's liveness differs from the reliable list's
-----------------------------------------------------------

Both forms keep one heartbeat key per consumer (TTL ``heartbeat``, renewed
every ``heartbeat / 3``, holding the process's token) and one registry hash,
look every ``heartbeat / 2`` (jittered, and as soon as a live key's ``PTTL``
says it lapses), and take a dead consumer's work back with one script gated
on its heartbeat key being absent.  They differ where the work in hand
lives:

* a stream's is its **PEL**, kept by the server per consumer with an idle
  time and a delivery count for each entry.  So the registry holds
  ``"<heartbeat ms> <mode>"`` (the dead consumer's own heartbeat is the idle
  guard; a CLAIMING consumer's PEL holds delayed retries, left to
  ``XAUTOCLAIM``); a look reads ``XINFO CONSUMERS`` (pending counts, idle
  times), the registry and each registered key's ``PTTL``, and sorts
  consumers into alive, stopped, lapsed and none (never registered: its
  entries *stranded*, warned about, not taken in PLAIN); :data:`REAP` takes
  only entries idle the dead one's ``heartbeat`` (an entry a live consumer
  whose key vanished still leases is never taken), with ``RETRYCOUNT`` one
  higher (the crash counts), and runs as a step of the read loop, so what it
  takes is handed over in turn with the own-PEL recovery and the claims;
* a reliable list's is a plain **processing list**: no idle time, no owner,
  no count per element.  So the registry holds the processing list's name,
  the reaper (a task beside the reader) tests the heartbeat keys (``PTTL``;
  its script is gated on ``EXISTS``) and moves the whole processing list
  back onto the queue, the attempt counted in each element's envelope;
  there is no idleness to guard by and nothing stranded to tell apart.

The mirror paragraph is in ``_core/reliable_list/liveness.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from ..._subscription import Mode
from .._commands import Command, Script
from .._identity import HEARTBEAT_FLOOR, claim, heartbeat_value, renew
from .survey import (
    BLOCK_PART,
    MIN_IDLE_PART,
    Registration,
    heartbeat_key,
    lease_every,
    lease_guard,
    legacy_heartbeat_key,
    legacy_registry_key,
    registry_key,
    shorter_notes,
)

__all__ = [
    "HANDED_BACK_IDLE_MS", "HEARTBEAT_FLOOR", "LEASE_TIMEOUT_FLOOR", "REAP", "SEEN_WITHIN", "STOP",
    "STOP_PROBE", "alive_claimers", "beat", "claim_name", "claimer_probe", "follow_at",
    "heartbeat_key", "lease_every", "lease_guard", "lease_timeout", "legacy_heartbeat_key",
    "legacy_registry_key", "registration_value", "registry_key", "shorter_notes", "stop_probe",
    "stopped_value",
]

STOP_PROBE = 0.5
"""Seconds between two looks of a live mount at the registry for a new
stopped mark (one ``HGETALL``): a peer's hand-back is taken over within
about this, or the read's ``block`` when longer (the probe runs between two
reads)."""

SEEN_WITHIN = 2 * STOP_PROBE
"""Seconds, besides its own read's ``block`` (the one it registers), within
which a live mount reads a new registration in the registry: its read loop
probes every :data:`STOP_PROBE` between two reads; while that probe is
overdue (a read loop that waits for busy handlers) its lease reads the
registry itself (:func:`follow_at`), from :data:`STOP_PROBE` after the
probe's due time plus that ``block``.  A new claiming mount's warm-up
counts with it and the longest ``block`` its peers registered
(:func:`~.survey.warm_up`)."""

HANDED_BACK_IDLE_MS = 10**12
"""The idle time (ms, about 31 years) :data:`STOP` gives the entries it hands
back: past every ``heartbeat`` and ``min_idle``, below the server's clock
(``XCLAIM ... IDLE`` must not reach before the epoch)."""



LEASE_TIMEOUT_FLOOR = 0.5
"""The shortest wait for one lease renewal's reply (a period shorter than this
is a test's: its renewals are not cut by a loaded machine's round trips)."""


def lease_timeout(every: float, bound: float) -> float:
    """Seconds one lease renewal may wait for its reply: its period ``every``
    (at least :data:`LEASE_TIMEOUT_FLOOR`), at most ``bound`` (the runtime's
    round-trip deadline).  A renewal cut by it (a silent link) is followed at
    once by the next, due by then, on another connection: an entry in hand
    idles about two periods at most, below the three after which a peer may
    take it -- not the period plus the whole deadline plus a period again."""
    return min(bound, max(every, LEASE_TIMEOUT_FLOOR))


def registration_value(heartbeat: float, mode: Mode, at: float | None = None, *,
                       stopped: bool = False, min_idle: float | None = None,
                       block: float | None = None) -> str:
    """``"<heartbeat ms> <mode>[ <unix ms>[ stopped]][ block=<ms>][ min_idle=<ms>]"``.

    ``block`` (a read's, every mode: a new claiming mount's warm-up waits
    for the longest of its peers', :func:`~.survey.warm_up`) and
    ``min_idle`` (RECLAIM and CLAIMING only: the idle time after which it
    claims; a peer's lease renews every third of the shortest, see
    :func:`lease_every`) come after the positional parts, ``min_idle``
    last: a reader that knows only the positional ones, or those and a last
    ``min_idle`` (``registration`` before ``block``), reads the others as
    before, and a value without a part is read as not knowing it."""
    value = f"{max(1, round(heartbeat * 1000))} {mode.value}"
    if at is not None:
        value += f" {round(at * 1000)}"
        if stopped:
            value += " stopped"
    if block is not None:
        value += f" {BLOCK_PART}{max(1, round(block * 1000))}"
    if min_idle is not None and mode is not Mode.PLAIN:
        value += f" {MIN_IDLE_PART}{max(1, round(min_idle * 1000))}"
    return value


def stopped_value(heartbeat: float, mode: Mode, at: float) -> str:
    """The stopped mark :data:`STOP` writes in the registry."""
    return registration_value(heartbeat, mode, at, stopped=True)


def beat(stream: str, group: str, consumer: str, token: str, heartbeat: float, mode: Mode,
         ttl: float, at: float | None = None, min_idle: float | None = None,
         block: float | None = None) -> Command:
    """A heartbeat: the key with a TTL of ``ttl`` seconds, and the
    registration (with ``at``, the unix time of the beat: a look tells when
    it lapsed; ``min_idle`` and ``block``, see :func:`registration_value`);
    only while the key is this process's (``token``) or absent
    (:data:`~._identity.RENEW`)."""
    return renew(heartbeat_key(stream, group, consumer), registry_key(stream, group),
                 heartbeat_value(token, heartbeat), ttl, consumer,
                 registration_value(heartbeat, mode, at, min_idle=min_idle, block=block))


def claim_name(stream: str, group: str, consumer: str, token: str, heartbeat: float, mode: Mode,
               takeover: bool | str, at: float | None = None,
               min_idle: float | None = None, block: float | None = None) -> Command:
    """The first heartbeat, at mount: the claim of the consumer name
    (:data:`~._identity.CLAIM`)."""
    return claim((heartbeat_key(stream, group, consumer), registry_key(stream, group),
                  legacy_heartbeat_key(stream, group, consumer), legacy_registry_key(stream, group)),
                 heartbeat_value(token, heartbeat), heartbeat, takeover, consumer,
                 registration_value(heartbeat, mode, at, min_idle=min_idle, block=block))


def stop_probe(registered: Mapping[str, Registration], me: str,
               seen: Collection[tuple[str, float | None]]) -> list[tuple[str, float | None]]:
    """The stopped marks in a registry (read by :func:`registry`) of
    consumers other than ``me`` not in ``seen``: (name, stop time) each; a
    look is due when any."""
    out: list[tuple[str, float | None]] = []
    for name, reg in registered.items():
        if name != me and reg.stopped and (name, reg.at) not in seen:
            out.append((name, reg.at))
    return out


def follow_at(next_probe: float, followed: float, block: float) -> float:
    """The clock time of the lease's next own read of the registry (a
    claiming peer registered meanwhile: :func:`claimer_probe`, then
    :func:`alive_claimers`): once the read loop's probe, due at
    ``next_probe``, is late by more than this mount's ``block`` (the one it
    registers: a new claiming peer's warm-up waits for it,
    :data:`SEEN_WITHIN`) and :data:`STOP_PROBE` (it waits for busy handlers,
    or a step is slow), and :data:`STOP_PROBE` after its last (``followed``:
    then).  A read loop that probes in time (nothing busy) makes it send
    nothing."""
    return max(next_probe + block + STOP_PROBE, followed + STOP_PROBE)


def alive_claimers(registered: Mapping[str, Registration], names: Sequence[str],
                   ttls: Sequence[int | bytes]) -> dict[str, float]:
    """Of ``names`` (:func:`claimer_probe`'s), those whose heartbeat key is
    there (``ttls``: its ``PTTL`` each, -2: gone), each with the
    ``min_idle`` it registered: what a look's :func:`~.survey.claimers`
    would add for them."""
    out: dict[str, float] = {}
    for name, ttl in zip(names, ttls, strict=True):
        min_idle = registered[name].min_idle
        if int(ttl) != -2 and min_idle is not None:
            out[name] = min_idle
    return out


def claimer_probe(registered: Mapping[str, Registration], me: str, guard: float,
                  known: Mapping[str, float], seen: Collection[tuple[str, float | None]]
                  ) -> list[str]:
    """Consumers of a registry (read by :func:`registry`) other than ``me``
    registered as claiming entries idle less than ``guard`` (:func:`~.survey.lease_guard`)
    that the last look did not find alive so (``known``: its
    :func:`~.survey.claimers`), with a registration it did not see (``seen``:
    (name, unix time of the beat) each): a peer mounted (or restarted) with
    a shorter ``min_idle``; a look is due, which tells whether it is alive.
    A dead one's registration does not change: it makes no look again."""
    out: list[str] = []
    for name, reg in registered.items():
        if (name != me and not reg.stopped and reg.claims and reg.min_idle is not None
                and 0 < reg.min_idle < guard and known.get(name) != reg.min_idle
                and (name, reg.at) not in seen):
            out.append(name)
    return out


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


# -- the take-over of a lapsed or stopped consumer's entries ----------------------------

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
