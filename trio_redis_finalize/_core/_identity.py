"""One consumer name, one live process (sans-IO): the heartbeat's owner token,
the claim of the name at mount and the renewal that keeps only its own.

A stream or reliable-list mount keeps a heartbeat key (``_presence``,
``_reliable``).  Its value names the process that holds it: the consumer's
*token*, ``<host>/<pid>/<random>/<pid namespace>/<process start>`` (one per
:class:`~._consumer.Consumer`; the last two empty where ``/proc`` has none),
and the heartbeat in ms (:func:`heartbeat_value`).

* **claim** (:data:`CLAIM`, at mount, before the first read): one script,
  so two processes mounting the same name at the same moment cannot both
  win.  It takes the heartbeat key when it is absent (never claimed, or
  lapsed: a process SIGKILLed ``heartbeat`` seconds ago) or holds this
  consumer's own token; a key holding another token -- another live
  process with this consumer name -- is refused (:class:`ConsumerNameInUse`,
  naming the consumer, the key, the holder and the heartbeat's age), and so
  is a live heartbeat key of the old key naming (a process of an earlier
  version with this name, see ``_keys.named``).  ``takeover=True`` takes
  the key whatever it holds.  A claim also registers the consumer and removes its name from the
  old naming's registry (this process is now the one responsible for it).
* **a restart after a crash** need not wait for the lapse: a holder whose
  token names this host and pid namespace, and a pid that runs no process
  started when the token's did (:func:`gone`: the process died, SIGKILL
  say, and this is its restart by systemd, a supervisor or a shell on the
  same host) is taken over at once, with a claim that replaces exactly that
  value (so a third process claiming meanwhile wins or loses as a whole).
  A holder on another host, in another pid namespace (a new container) or
  where ``/proc`` says nothing blocks until its heartbeat lapses: at most
  the subscription's ``heartbeat`` after the crash.
* **renewal** (:data:`RENEW`, every ``heartbeat / 3``, and the last beat at
  shutdown): extends the key only while it holds this token, or is absent
  (a lapse while the event loop was blocked: taken back); a key holding
  another token -- a process that took the name over -- is left alone and
  the holder is returned, logged as an error by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

from .._errors import ConsumerNameInUse
from ._commands import Command, Script

__all__ = ["CLAIM", "HEARTBEAT_FLOOR", "RENEW", "Claimed", "ConsumerNameInUse", "age", "claim",
           "describe_holder", "gone", "heartbeat_value", "make_token", "parse_claim", "refusal", "renew"]


def heartbeat_value(token: str, heartbeat: float) -> str:
    """What a heartbeat key holds: the owner's token and the heartbeat (ms)."""
    return f"{token} {max(1, round(heartbeat * 1000))}"


HEARTBEAT_FLOOR = 0.01
"""Seconds: a shorter ``heartbeat`` cannot be renewed (every ``heartbeat / 3``) in time
(streams and reliable lists alike)."""

# KEYS: heartbeat (the heartbeat key), registry, old_heartbeat (the heartbeat
#   key of the old naming), old_registry (the registry of the old naming)
# ARGV: value (heartbeat_value), ttl_ms, takeover ('': no, '*': whatever the
#   key holds, else: only the value it must hold), consumer (its name),
#   registration
# Returns {0, previous value or ''} when claimed; {1, value, pttl} when
# another token holds the key; {2, '', pttl} when the old naming's heartbeat
# key is alive.
CLAIM = Script(
    """
local cur = redis.call('GET', KEYS[1])
if ARGV[3] ~= '*' then
  if cur and cur ~= ARGV[1] and cur ~= ARGV[3] then return {1, cur, redis.call('PTTL', KEYS[1])} end
  local old = redis.call('PTTL', KEYS[3])
  if old ~= -2 then return {2, '', old} end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
redis.call('HDEL', KEYS[4], ARGV[4])
return {0, cur or ''}
""",
    name="heartbeat_claim", keys=("heartbeat", "registry", "old_heartbeat", "old_registry"),
    argv=("value", "ttl_ms", "takeover", "consumer", "registration"),
)

# KEYS: heartbeat (the heartbeat key), registry
# ARGV: value, ttl_ms, consumer (its name), registration
# Renews only this process's own heartbeat (or takes back a lapsed one);
# returns 1, or the value another process holds the key with.
RENEW = Script(
    """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1
""",
    name="heartbeat_renew", keys=("heartbeat", "registry"),
    argv=("value", "ttl_ms", "consumer", "registration"),
)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def claim(keys: tuple[str, str, str, str], value: str, ttl: float, takeover: bool | str,
          consumer: str, registration: str) -> Command:
    """The :data:`CLAIM` command (``keys``: heartbeat, registry, and the old
    naming's two; ``takeover``: True, False, or the holder's value to replace)."""
    how = "*" if takeover is True else "" if takeover is False else takeover
    return CLAIM.command(keys, (value, _ms(ttl), how, consumer, registration))


def renew(heartbeat: str, registry: str, value: str, ttl: float, consumer: str,
          registration: str) -> Command:
    """The :data:`RENEW` command."""
    return RENEW.command((heartbeat, registry), (value, _ms(ttl), consumer, registration))


@dataclasses.dataclass(frozen=True, slots=True)
class Claimed:
    """A :data:`CLAIM` reply."""

    ok: bool
    holder: str
    """The value the key held (claimed: what was taken over, '' when absent)."""
    ttl: float | None
    """Refused: seconds the holder's heartbeat key still lives (None: no expiry)."""
    old_naming: bool = False
    """Refused for a live heartbeat key of the old key naming (an earlier version)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def parse_claim(reply: Any) -> Claimed:
    code = int(reply[0])
    holder = _text(reply[1])
    if code == 0:
        return Claimed(True, holder, None)
    ttl = int(reply[2])
    return Claimed(False, holder, ttl / 1000 if ttl >= 0 else None, old_naming=code == 2)


def make_token(host: str, pid: int, nonce: str, pidns: str, start: str) -> str:
    """A consumer's token (see the module docstring); ``/`` and spaces in the
    host name are replaced (they separate the parts)."""
    host = host.replace("/", "_").replace(" ", "_")
    return f"{host}/{pid}/{nonce}/{pidns}/{start}"


def gone(value: str, host: str, pidns: str, pid: int, start_of: Callable[[int], str | None],
         live: Collection[str]) -> bool:
    """The consumer holding a heartbeat (``value``) is known to be gone: its
    token names this ``host`` and pid namespace (``pidns``, not empty), it is
    no token of a consumer open in this process (``pid``; ``live``), and
    its pid is this process's (a consumer of this process, closed) or runs
    no process started when it did (``start_of(pid)``: the start of the
    process with that pid now, None when none runs).  Anything else (another
    host, no ``/proc``, an unreadable token) is not known gone."""
    token = value.split(" ", 1)[0]
    parts = token.split("/")
    if len(parts) != 5 or token in live:
        return False
    t_host, t_pid, _, t_ns, t_start = parts
    if not pidns or t_host != host or t_ns != pidns or not t_start or not t_pid.isdigit():
        return False
    return int(t_pid) == pid or start_of(int(t_pid)) != t_start


def describe_holder(value: str) -> str:
    """``process 1234 on host h1`` from a heartbeat value (its token)."""
    token = value.split(" ", 1)[0]
    host, _, rest = token.partition("/")
    pid = rest.partition("/")[0]
    if host and pid:
        return f"process {pid} on host {host}"
    return f"a process ({value!r})"


def age(value: str, ttl: float | None) -> float | None:
    """Seconds since the holder last renewed its heartbeat (its heartbeat
    length, read from the value, minus what its key still lives)."""
    _, _, ms = value.partition(" ")
    if ttl is None or not ms.isdigit():
        return None
    return max(0.0, int(ms) / 1000 - ttl)


def refusal(what: str, consumer: str, key: str, got: Claimed, old_key: str) -> ConsumerNameInUse:
    """The error of a refused :data:`CLAIM` (``what``: the subscription, for the message)."""
    lapse = "never (it has no expiry)" if got.ttl is None else f"in {got.ttl:.1f} s unless renewed"
    if got.old_naming:
        held = (f"a live heartbeat {old_key!r} of the old key naming (a process of an "
                f"earlier version of trio_redis_finalize; it lapses {lapse})")
    else:
        seen = age(got.holder, got.ttl)
        when = "" if seen is None else f", renewed {seen:.1f} s ago"
        held = (f"a live heartbeat {key!r} held by {describe_holder(got.holder)}{when} "
                f"(it lapses {lapse})")
    return ConsumerNameInUse(
        f"{what}: consumer name {consumer!r} is in use: {held}.  Two processes with one "
        "consumer name handle each other's pending deliveries twice.  Give this process "
        "another name (open_consumer(name=...)), or stop the other one; if it is dead "
        "(SIGKILL), mount again once its heartbeat lapses, or pass takeover=True "
        "(open_consumer or mount; run --takeover) to take the name over now.")
