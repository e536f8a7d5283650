"""Reliable lists, sans-IO: the keys beside the queue, the reader's scripts,
retry-counter bumps and the multiset counting of identical elements.

Keys beside the queue (all in the queue's hash slot):

* ``{queue}:consumers`` (:func:`registry_key`): a hash, consumer name -> its
  processing list; every live consumer (re)registers itself there with each
  heartbeat;
* ``{queue}:heartbeat:<consumer>`` (:func:`heartbeat_key`): a key with a TTL
  of ``heartbeat`` seconds, renewed every ``heartbeat / 3`` seconds while the
  consumer runs.

A consumer whose heartbeat key is gone is dead: any live consumer moves its
processing list back onto the queue (:data:`REAP`) and then forgets it.  A
cleanly stopped consumer whose processing list is empty deregisters itself
(:data:`FORGET`); one that leaves elements there (cut by the grace, waiting
for a backoff) hands them back onto the queue itself (:data:`STOP`: as the
reaper would, counted, but at once), then deregisters.

The reader tells identical elements apart by count only: its bookkeeping is
a multiset of bytes, ``dict[bytes, int]``, counted down with :func:`dec`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from .._envelope import CorruptEnvelope, unwrap, wrap
from .._keys import derived
from ._commands import Script
from ._plan import content_origin

__all__ = [
    "BUMP", "FORGET", "GIVE_BACK", "REAP", "STOP", "bumped", "dec", "doubtful", "heartbeat_key",
    "registry_key", "stop_args", "stranded",
]


def registry_key(queue: str) -> str:
    """The hash of the queue's consumers (name -> processing list)."""
    return derived(queue, ":consumers")


def heartbeat_key(queue: str, consumer: str) -> str:
    """The key whose TTL says ``consumer`` of ``queue`` is alive."""
    return derived(queue, f":heartbeat:{consumer}")


# KEYS: processing list.  ARGV: element, its rewritten copy.
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
    name="reliable_list_bump",
)

# KEYS: dead consumer's processing list, queue, its heartbeat key, registry.
# ARGV: consumer name, element, rewritten element, element, rewritten, ...
# Gated on the heartbeat key being absent (the consumer may have come back);
# each element is removed from the processing list and pushed onto the
# consumer end (RIGHT) of the queue only when it was still there, so racing
# reapers move every element once.  Elements come newest first, so the
# oldest ends up rightmost: recovered elements are consumed first, in their
# original order.  Returns the number moved, or -1 when the consumer is alive.
REAP = Script(
    """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    n = n + 1
  end
end
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('HDEL', KEYS[4], ARGV[1]) end
return n
""",
    name="reliable_list_reap",
)

# KEYS: own processing list, queue, own heartbeat key, registry.
# ARGV: consumer name, element, rewritten element, ... (newest first).
# A clean stop, after the handlers and the finalizer ended: what is left in the
# processing list (handlers cut by the grace, elements waiting for a backoff)
# goes back onto the consumer end of the queue as :data:`REAP` moves a dead
# consumer's (counter bumped when a handler ran: :func:`stop_args`; oldest
# rightmost), at once instead of once the heartbeat lapsed.  When the list is empty then, the
# consumer deregisters (heartbeat key, registration).
# Returns {moved, left in the processing list}.
STOP = Script(
    """
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    n = n + 1
  end
end
local left = redis.call('LLEN', KEYS[1])
if left == 0 then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('DEL', KEYS[3])
end
return {n, left}
""",
    name="reliable_list_stop",
)

# KEYS: processing list, own heartbeat key, registry.  ARGV: consumer name.
# A cleanly stopped consumer deregisters itself -- its heartbeat key and its
# registration -- only when its processing list is empty; 0 otherwise (what
# is left there is reaped once the heartbeat lapses).
FORGET = Script(
    """
if redis.call('LLEN', KEYS[1]) > 0 then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
""",
    name="reliable_list_forget",
)

# KEYS: processing list, queue.  ARGV: element, n, element, n, ..., newest first.
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
    name="reliable_list_give_back",
)


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
    copy (``delayed``) are forgotten: their removal did remove it after all.

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
