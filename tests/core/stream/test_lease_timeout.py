"""How long one stream lease renewal waits for its reply (sans-IO, ``_core/stream/liveness``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trio_redis_finalize import Mode
from trio_redis_finalize._core.stream.liveness import LEASE_TIMEOUT_FLOOR, lease_every, lease_timeout

BOUND = 5.0


@given(st.sampled_from(list(Mode)), st.floats(0.01, 600), st.floats(0.5, 600))
def test_a_silent_renewal_costs_at_most_a_period(mode: Mode, min_idle: float, heartbeat: float) -> None:
    """The wait is the lease period (the floor, the round-trip bound aside):
    the renewal after a cut one goes out at once, so an entry in hand idles
    about two periods at most -- below the three after which a peer takes it."""
    every = lease_every(mode, min_idle, heartbeat)
    timeout = lease_timeout(every, BOUND)
    assert timeout <= BOUND
    assert timeout == min(BOUND, max(every, LEASE_TIMEOUT_FLOOR))
    if every >= LEASE_TIMEOUT_FLOOR:
        assert every + timeout < 3 * every
