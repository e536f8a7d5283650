"""The warm-up of a claiming mount's claims, sans-IO.

A live consumer of the group renews the lease of the entries it holds every
third of its own guard (``survey.lease_guard``) until it sees a peer that
claims sooner: its registry probe runs every :data:`~.liveness.STOP_PROBE`
seconds between two reads, its look then finds the new registration, and the
lease renews every third of the shorter ``min_idle`` from then on
(``survey.claimers``, ``survey.lease_every``).  Until then an entry it holds
may idle up to its own guard, past the new peer's ``min_idle``: the new
peer's first claims would take it from a running handler.

So a RECLAIM or CLAIMING mount's claims (every ``XAUTOCLAIM``, the CLAIMING
claim-back of its own retries included) use a longer ``min_idle`` for a
while after its first registration: the longest lease bound
(:func:`peer_bound`) of the live peers its first look at the group found,
when longer than its own (:func:`warm_up`).  The window lasts until each of
them has surely looked again and renewed: the registry probe's period, a
read's ``block`` (the peer's is not registered: this mount's own), the
longest of their lease periods (bound / 3) and :data:`MARGIN`.  Nothing
changes when no live peer has a longer bound (no delay, the same commands).

Not covered: a peer that never registered (another client, a version without
heartbeats), one whose registration tells neither ``min_idle`` nor
``heartbeat``, one whose ``block`` is longer than this mount's, and one
whose read loop waits for busy handlers (its probe runs between two reads).
The shell (``_forms/stream/liveness.py``) reads the clock.
"""

from __future__ import annotations

import dataclasses
import logging

from ..._subscription import Mode
from .._finalize import Record
from .liveness import STOP_PROBE
from .survey import Heartbeat, Registration, Survey, lease_guard

__all__ = ["MARGIN", "WarmUp", "claim_min_idle", "peer_bound", "warm_up", "warm_up_note"]

MARGIN = 0.5
"""Seconds the window lasts past the peers' probe, read and lease period: the
round trips of their look and renewal on a loaded machine."""


@dataclasses.dataclass(frozen=True, slots=True)
class WarmUp:
    """The claims' ``min_idle`` after the first registration, and for how long."""

    min_idle: float
    """Seconds an entry must idle to be claimed during the window."""
    seconds: float
    """The window's length, from the first registration."""
    peer: str
    """The live peer whose bound is :attr:`min_idle` (the first by name on a tie)."""


def peer_bound(reg: Registration | None) -> float | None:
    """Seconds an entry a peer holds may idle before its lease renews it, as
    long as it has not seen a peer that claims sooner: its
    :func:`~.survey.lease_guard` from its registration (``min_idle``,
    ``heartbeat``, mode).  Without a ``min_idle`` (PLAIN, or an earlier
    version): its ``heartbeat``; None when the registration tells neither."""
    if reg is None:
        return None
    hb, min_idle, mode = reg.heartbeat, reg.min_idle, reg.mode
    if min_idle is not None and mode in (Mode.RECLAIM, Mode.CLAIMING):
        return lease_guard(mode, min_idle, min_idle if hb is None else hb)
    return hb


def warm_up(mode: Mode, min_idle: float, block: float, found: Survey) -> WarmUp | None:
    """The warm-up of a mount's claims (see the module docstring) from its
    first look at the group (``found``); None in PLAIN (it claims nothing)
    and when no live peer's :func:`peer_bound` is longer than ``min_idle``."""
    if mode is Mode.PLAIN:
        return None
    longest: tuple[float, str] | None = None
    for p in sorted(found.peers, key=lambda p: p.name):
        bound = peer_bound(p.registration) if p.heartbeat is Heartbeat.ALIVE else None
        if bound is not None and bound > min_idle and (longest is None or bound > longest[0]):
            longest = (bound, p.name)
    if longest is None:
        return None
    bound, peer = longest
    return WarmUp(bound, STOP_PROBE + block + bound / 3 + MARGIN, peer)


def claim_min_idle(min_idle: float, warm: WarmUp | None, elapsed: float | None) -> float:
    """Seconds an entry must idle to be claimed now: ``warm``'s ``min_idle``
    while ``elapsed`` (seconds since the first registration; None: not yet
    registered) is inside its window, else ``min_idle``."""
    if warm is None or (elapsed is not None and elapsed >= warm.seconds):
        return min_idle
    return max(min_idle, warm.min_idle)


def warm_up_note(name: str, min_idle: float, warm: WarmUp) -> Record:
    """The note (info) that the warm-up lengthens the claims' ``min_idle``, naming the peer."""
    return (logging.INFO,
            "%s: for %.1f s after mounting, this subscription claims entries idle "
            "min_idle=%g s, not its own %g s: live consumer %r of the group may hold entries "
            "idle that long until it sees this subscription's registration (its lease then "
            "renews every third of min_idle=%g s)",
            (name, warm.seconds, warm.min_idle, min_idle, warm.peer, min_idle),
            {"subscription": name})
