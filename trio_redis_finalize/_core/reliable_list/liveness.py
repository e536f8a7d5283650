"""Reliable lists, sans-IO: the keys beside the queue, the reader's scripts,
retry-counter bumps and the multiset counting of identical elements.

Keys beside the queue (all in the queue's hash slot):

* ``{queue}:list-consumers:<queue>`` (:func:`registry_key`): a hash,
  consumer name -> its processing list; every live consumer (re)registers
  itself there with each heartbeat;
* ``{queue}:list-heartbeat:<queue>,<consumer>`` (:func:`heartbeat_key`): a
  key with a TTL of ``heartbeat`` seconds, renewed every ``heartbeat / 3``
  seconds while the consumer runs; it holds the owning process's token,
  claimed at mount: one live process per consumer name (``_identity``).

Each name is escaped (``_keys.named``): no two (queue, consumer) share a key,
nor does a list's key a stream's.  The naming before (``{queue}:consumers``,
``{queue}:heartbeat:<consumer>``: :func:`legacy_registry_key`,
:func:`legacy_heartbeat_key`) is still read: the reaper moves back the
processing list of a dead consumer registered there (an earlier version's),
and a claim at mount is refused while this name's old heartbeat key is
alive.  Old heartbeat keys expire with their TTL; an old registry is emptied
as its consumers are reaped or mount again under the new naming.

Beside a consumer's processing list (its hash slot), ``<processing>:receipts``
(:func:`receipts_key`): the receipts of its runtime ``retry_after`` copies
(:data:`DELAYED_COPY`), a hash, token -> 1.

A consumer whose heartbeat key is gone is dead: any live consumer moves its
processing list back onto the queue (:data:`REAP`) and then forgets it.  A
cleanly stopped consumer hands what is left in its processing list (cut by
the grace) back onto the queue itself (:data:`STOP`: as the reaper would,
counted, but at once) and deregisters once the list is empty; elements
waiting for a Backoff stay, with their schedule.  The run-time half (the
heartbeat and reaper tasks, the stop) is ``_forms.reliable_list.liveness``.

Why the reliable list's liveness differs from the stream's
----------------------------------------------------------

Both forms share the heartbeat itself: a key per consumer with a TTL of
``heartbeat`` renewed every ``heartbeat / 3`` holding the owner's token
(``_core._identity``'s CLAIM and RENEW, ``_identity.NameHold``), a registry
hash beside the source, the one-to-one naming (``_keys.named``) and the old
one still read.  They differ in what tells them a consumer is dead and what
a dead consumer holds (the stream's side: ``_core.stream.liveness``):

* **What is held.**  A list has no PEL: what a consumer holds is its own
  processing list (its name in the registry, ``name -> processing list``),
  and Redis knows nothing of who reads it.  A stream's group knows its
  consumers and their pending entries (``XINFO CONSUMERS``, ``XPENDING``),
  so its registry holds ``"<heartbeat ms> <mode>[ <unix ms>[ stopped]]"``
  (the dead one's own heartbeat and mode decide what may be taken).
* **Who is dead.**  A list consumer is dead when its heartbeat key is gone:
  each live consumer reads the registry (``HGETALL``, both namings) and the
  ``PTTL`` of every registered peer's key every ``heartbeat / 2``
  (jittered 0.8-1.2), and again as soon as the first live key would lapse;
  -2 is dead.  :data:`REAP` checks again (``EXISTS`` of the key) in the
  script.  A stream look also reads ``XINFO CONSUMERS`` (idle times and
  pending counts; unregistered consumers are stranded, never taken), tells a
  stopped mark from a lapse, and probes for stopped marks every
  ``STOP_PROBE`` s; it runs as a step of the read loop (jittered 0.8-1.0),
  so what it takes is handed over in turn with the reads.
* **What is taken.**  A dead list consumer's whole processing list goes back
  onto the queue (page by page, each element's counter bumped in its
  bytes): nobody else can hold those elements, so no idle guard is needed;
  only an element waiting out its Backoff (the schedule beside that list)
  stays until it is due, as a claimed stream entry waits out the rest.
  A dead stream consumer's entries are claimed into the reaper's own PEL
  (``XCLAIM ... RETRYCOUNT``) only once idle its ``heartbeat`` (the idle
  guard: an entry whose lease a live owner still renews is never taken) and
  handed to the reaper's handlers; in ``Mode.CLAIMING`` not at all.
* **The stop.**  A list's :data:`STOP` moves what is left back onto the
  queue itself and deregisters once the list is empty; a stream's marks its
  entries idle and leaves a stopped mark for a live peer to take them.

The reader tells identical elements apart by count only: its bookkeeping is
a multiset of bytes, ``dict[bytes, int]``, counted down with :func:`dec`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from ..._envelope import CorruptEnvelope, unwrap, wrap
from ..._keys import derived, named
from .._commands import Arg, Command, Script
from .._lua import WRITES_LUA
from .._types import content_origin

__all__ = [
    "ADOPT", "BUMP", "DELAYED_COPY", "GIVE_BACK", "REAP", "STOP", "bumped", "dec", "delayed_copy",
    "doubtful", "heartbeat_key", "legacy_heartbeat_key", "legacy_registry_key", "moved_key",
    "receipts_key",
    "registry_key", "stop_args", "stranded",
]


def registry_key(queue: str) -> str:
    """The hash of the queue's consumers (name -> processing list)."""
    return named(queue, "list-consumers")


def moved_key(queue: str) -> str:
    """The hash of the processing lists consumer names left for another
    (changed settings: old list -> the name), until :data:`ADOPT` emptied
    them: a take-over that failed is made again at the name's next mount."""
    return named(queue, "list-moved")


def heartbeat_key(queue: str, consumer: str) -> str:
    """The key whose TTL says ``consumer`` of ``queue`` is alive."""
    return named(queue, "list-heartbeat", consumer)


def legacy_registry_key(queue: str) -> str:
    """:func:`registry_key` of the naming before (not one-to-one; read only)."""
    return derived(queue, ":consumers")


def legacy_heartbeat_key(queue: str, consumer: str) -> str:
    """:func:`heartbeat_key` of the naming before (not one-to-one; read only)."""
    return derived(queue, f":heartbeat:{consumer}")


# KEYS: processing (the processing list)
# ARGV: element, copy (its rewritten copy)
# Replaces one occurrence of the element in place (a crash redelivery counts
# as an attempt, so a poison element that kills its consumer reaches
# max_attempts); false when the element is gone.
BUMP = Script(
    """
local i = redis.call('LPOS', KEYS[1], ARGV[1])
if not i then return false end
redis.call('LSET', KEYS[1], i, ARGV[2])
return 1
""",
    name="reliable_list_bump", keys=("processing",), argv=("element", "copy"),
)

def _move_back(first: int) -> str:
    """Lua: move the element pairs of ``ARGV[first:]`` (element, what goes
    back) from the processing list ``KEYS[1]`` onto the queue ``KEYS[2]``,
    counting them in ``n``: the copy first (a refusal there, OOM, leaves the
    element where it is), then the removal; an element no longer there takes
    its copy back.  Copies before originals, as every finalization."""
    return f"""local n = 0
for i = {first}, #ARGV, 2 do
  redis.call('RPUSH', KEYS[2], ARGV[i + 1])
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    n = n + 1
  else
    redis.call('RPOP', KEYS[2])
  end
end"""


# KEYS: processing (the dead consumer's processing list), queue, heartbeat
#   (its heartbeat key), registry
# ARGV: consumer (its name), [element, copy]... (each element and its
#   rewritten copy)
# Gated on the heartbeat key being absent (the consumer may have come back);
# each element is pushed onto the consumer end (RIGHT) of the queue, then
# removed from the processing list (the push taken back when it was no longer there), so racing
# reapers move every element once.  Elements come newest first, so the
# oldest ends up rightmost: recovered elements are consumed first, in their
# original order.  Returns the number moved, or -1 when the consumer is alive.
REAP = Script(
    """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
""" + _move_back(2) + """
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('HDEL', KEYS[4], ARGV[1]) end
return n
""",
    name="reliable_list_reap", keys=("processing", "queue", "heartbeat", "registry"),
    argv=("consumer", "[element, copy]..."),
)

# KEYS: old (the processing list this consumer name was registered with
#   before), processing (its processing list now), registry, old_schedule,
#   schedule (their Backoff schedules), old_receipts, moved (moved_key)
# ARGV: consumer (its name), registration (its processing list now), limit
# A consumer started again under its name with another processing list
# (changed settings) after its previous process left elements in the old
# one: its claim re-registered the name with the new list, so no reaper
# looks at the old one again.  It takes the old list over as its own: up to
# ``limit`` elements move, as they are, onto the oldest end of the new list
# (in their order), and once the old list is empty its Backoff schedule is
# merged into the new one's (the later due time of a member kept, the
# longer expiry), its receipts go and so does its note in moved; the start's rescan then counts and
# delivers them as a restart does.  Gated on the registry naming this
# consumer with the new list still (the name is this process's).  Returns
# the number moved, or -1 when the name is registered otherwise now.
ADOPT = Script(
    """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return -1 end
local n, limit = 0, tonumber(ARGV[3])
while n < limit and redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT') do n = n + 1 end
if redis.call('LLEN', KEYS[1]) == 0 then
  if redis.call('EXISTS', KEYS[4]) == 1 then
    local ttl = math.max(redis.call('PTTL', KEYS[4]), redis.call('PTTL', KEYS[5]))
    redis.call('ZUNIONSTORE', KEYS[5], 2, KEYS[5], KEYS[4], 'AGGREGATE', 'MAX')
    if ttl > 0 then redis.call('PEXPIRE', KEYS[5], ttl) end
    redis.call('DEL', KEYS[4])
  end
  redis.call('DEL', KEYS[6])
  redis.call('HDEL', KEYS[7], KEYS[1])
end
return n
""",
    name="reliable_list_adopt",
    keys=("old", "processing", "registry", "old_schedule", "schedule", "old_receipts", "moved"),
    argv=("consumer", "registration", "limit"),
)

# KEYS: processing (the own processing list), queue, heartbeat (the own
#   heartbeat key), registry, receipts (the own receipts)
# ARGV: consumer (its name), value (the own heartbeat's), [element, copy]...
#   (each element and its rewritten copy, newest first)
# A clean stop, after the handlers and the finalizer ended: what is left in the
# processing list (handlers cut by the grace, elements waiting for a backoff)
# goes back onto the consumer end of the queue (pushed first, then removed:
# copies before originals) as :data:`REAP` moves a dead
# consumer's (counter bumped when a handler ran: :func:`stop_args`; oldest
# rightmost), at once instead of once the heartbeat lapsed.  When the list is
# empty then, the consumer deregisters (heartbeat key, registration) and its
# delayed copies' receipts go (the scheduler has stopped: none is sent again).
# Nothing is done while another process holds the name's heartbeat (it took
# the name over: the processing list is its own now).
# Returns {moved, left in the processing list}; {0, -1}: the name is another's.
STOP = Script(
    """
local hb = redis.call('GET', KEYS[3])
if hb and hb ~= ARGV[2] then return {0, -1} end
""" + _move_back(3) + """
local left = redis.call('LLEN', KEYS[1])
if left == 0 then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('DEL', KEYS[3], KEYS[5])
end
return {n, left}
""",
    name="reliable_list_stop",
    keys=("processing", "queue", "heartbeat", "registry", "receipts"),
    argv=("consumer", "value", "[element, copy]..."),
)

# KEYS: processing (the processing list), queue
# ARGV: [element, n]... (newest first)
# Gives back elements read but never handed to a handler (shutdown): each is
# removed from the processing list and pushed onto the consumer end of the
# queue only while the list still holds n copies of it (n: as for the
# finalization scripts, see ``_plan.list_counted``).  Not counted as an attempt.
GIVE_BACK = Script(
    """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('LPOS', KEYS[1], ARGV[i], 'RANK', tonumber(ARGV[i + 1])) then
    redis.call('LREM', KEYS[1], 1, ARGV[i])
    redis.call('RPUSH', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return n
""",
    name="reliable_list_give_back", keys=("processing", "queue"), argv=("[element, n]...",),
)


def receipts_key(processing: str) -> str:
    """The hash of the receipts of a consumer's runtime ``retry_after`` copies."""
    return derived(processing, ":receipts")


# A reliable list's runtime ``retry_after`` copy (the original waits in the
# processing list until its delay is over), exactly once.
#
# KEYS: processing (the processing list), queue, receipts (the receipts
#   hash, :func:`receipts_key`), write_keys... (the writes' keys)
# ARGV: element, copy, token, n, nf, forget... (nf tokens to forget),
#   writes... (nw, the writes, as ``_writes.encode_writes`` puts them)
#
# The receipts of ``nf`` earlier copies, answered since, are deleted first.
# Then, a receipt under this copy's ``token`` says an earlier send of this
# very finalization committed (its reply was lost): 2, nothing done again.
# Else the counted gate (at least ``n`` copies of the element in the
# processing list, see ``_plan.list_counted``): closed, false; open: the
# writes' key types checked (a refusal: an error reply, nothing written),
# the writes run, the copy pushed onto the queue, one copy of the element
# removed and the receipt written, in one step: 1.  The gate's ``n`` is
# taken when the script is sent (``_list_gates.ListGates.send_later``),
# never when the copy was planned: the copies held then and now differ.
DELAYED_COPY = Script(
    WRITES_LUA
    + """
local nf = tonumber(ARGV[5])
if nf > 0 then redis.call('HDEL', KEYS[3], unpack(ARGV, 6, 5 + nf)) end
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return 2 end
if not redis.call('LPOS', KEYS[1], ARGV[1], 'RANK', -tonumber(ARGV[4])) then return false end
local at = 6 + nf
local nw = tonumber(ARGV[at])
local i, why = wcheck(at + 1, nw)
if not i then return redis.error_reply(why) end
wapply(at + 1, nw)
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('LREM', KEYS[1], -1, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[3], 1)
return 1
""",
    name="reliable_list_delayed_copy",
    keys=("processing", "queue", "receipts", "write_keys..."),
    argv=("element", "copy", "token", "n", "nf", "forget...", "writes..."),
)
_DELAYED_SHA = DELAYED_COPY.sha


def delayed_copy(processing: str, queue: Arg, element: bytes, copy: bytes, token: bytes, n: int,
                 forget: Sequence[bytes] = (), writes: Sequence[Arg] = (0,),
                 write_keys: Sequence[Arg] = ()) -> Command:
    """A :data:`DELAYED_COPY` command (``writes``: ``nw`` then the writes)."""
    return DELAYED_COPY.command(
        (processing, queue, receipts_key(processing), *write_keys),
        (element, copy, token, n, len(forget), *forget, *writes))


def delayed_parts(cmd: Command) -> tuple[bytes, int, int] | None:
    """``(element, n, writes)`` of a :data:`DELAYED_COPY` command (``writes``:
    how many it carries), or None for another command."""
    if cmd[0] != b"EVALSHA" or cmd[1] != _DELAYED_SHA:
        return None
    at = 3 + int(cmd[2])  # ARGV[1]
    element, n, nf = cmd[at], cmd[at + 3], int(cmd[at + 4])
    assert isinstance(element, bytes)
    return element, int(n), int(cmd[at + 5 + nf])


def renumbered(cmd: Command, n: int) -> Command:
    """A :data:`DELAYED_COPY` command gated on ``n`` copies instead."""
    at = 3 + int(cmd[2]) + 3
    return (*cmd[:at], n, *cmd[at + 1:])


def bumped(raw: bytes) -> bytes | None:
    """``raw`` with its retry counter one higher (a foreign element gets an
    envelope, retries 1, origin the digest of its bytes); None when corrupt."""
    try:
        body, retries, origin = unwrap(raw)
    except CorruptEnvelope:
        return None
    if retries >= 0xFFFFFFFF:
        return None
    return wrap(body, retries + 1, origin if origin is not None else content_origin(raw))


def stop_args(page: Sequence[bytes], held: dict[bytes, int]) -> list[bytes]:
    """:data:`STOP`'s element pairs for one page of the processing list
    (``LRANGE`` order, newest first): an element the reader holds (a handler
    cut by the grace, one waiting for a backoff: ``held``, a multiset counted
    down here) goes back counted (:func:`bumped`: the attempt ran); one it
    does not hold was stranded by a read cut at the stop, which no handler
    saw: as it is."""
    out: list[bytes] = []
    for e in page:
        if dec(held, e):
            out += [e, bumped(e) or e]
        else:
            out += [e, e]
    return out


def dec(counts: dict[bytes, int], e: bytes) -> int:
    """Count ``e`` down by one (never below 0); its count before."""
    n = counts.get(e, 0)
    if n > 1:
        counts[e] = n - 1
    elif n:
        counts.pop(e)  # (a Counter's ``del`` is Python code; its pop is the dict's)
    return n


def stranded(
    items: Sequence[bytes], held: dict[bytes, int], leftover: dict[bytes, int],
    delayed: Collection[bytes], *, start: bool, before: Mapping[bytes, int] | None = None,
) -> list[tuple[bytes, bool]]:
    """What a processing list (``items``, LRANGE order: newest first) holds
    that the reader does not (``held``, as a multiset), oldest first, each
    with whether its counter is to be bumped.

    At ``start`` every such element is an attempt (the previous process may
    have been handling it).  Later, only copies of elements the reader
    handled whose removal may have left them (``leftover``, counted down
    here) are; the others were stranded by a lost read reply, no handler saw
    them.  ``leftover`` entries not waiting for a runtime ``retry_after``
    copy sent and not answered yet (``delayed``) are forgotten: their
    removal did remove it after all.

    ``before``: what the reader held when it sent the ``LRANGE``.  A removal
    answered since then may have run after the ``LRANGE`` did, its element
    still in ``items`` though no longer held: an element counts as held up to
    the larger of the two counts (and its ``leftover`` is kept), so a copy
    finalized meanwhile is not delivered again.  :func:`doubtful` says
    whether that hid a stranded copy, to be looked for again later.
    """
    seen: Counter[bytes] = Counter()
    out: list[tuple[bytes, bool]] = []
    masked: set[bytes] = set()
    for e in reversed(items):  # oldest first
        seen[e] += 1
        k = seen[e]
        if k > held.get(e, 0):
            if before is not None and k <= before.get(e, 0):
                masked.add(e)  # held when the LRANGE was sent: finalized meanwhile
                continue
            out.append((e, start or dec(leftover, e) > 0))
    for e in [e for e in leftover if e not in delayed and e not in masked]:
        del leftover[e]  # its removal did remove it after all (a resend)
    return out


def doubtful(items: Sequence[bytes], held: Mapping[bytes, int], before: Mapping[bytes, int]) -> bool:
    """Whether :func:`stranded` took a copy in ``items`` for one finalized
    while the ``LRANGE`` ran (held ``before``, not now): identical bytes
    cannot tell it from a copy a lost read stranded, so the processing list
    is to be looked at again, once the removals in flight are answered."""
    seen: Counter[bytes] = Counter(items)
    return any(held.get(e, 0) < n and before.get(e, 0) > held.get(e, 0) for e, n in seen.items())
