"""The set-back of a claimed entry that waits out its Backoff, against a real server.

A claim (RECLAIM / CLAIMING's ``XAUTOCLAIM``, the PLAIN reaper's ``XCLAIM``)
that takes an entry whose ``Backoff`` is not due yet lets it wait out the rest
(``own_pel.claimed_waits``) and sets its delivery count back by the one the
claim counted (``decode.set_back_claimed``).  Between the claim and that
set-back the reader reads the entry's counts and its schedule: a peer in
RECLAIM or CLAIMING mode may claim the entry meanwhile (this consumer
stalled past ``min_idle``).  The set-back leaves such an entry with the peer,
at the peer's count, as the give-back does (``decode.GIVE_BACK``, checked in
the same script): before, a plain ``XCLAIM ... RETRYCOUNT`` took it back from
the peer and lowered its count (the peer's delivery then finds its gate
closed, and the entry is handled a second time here).

Timeouts are bounds, never expectations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
from _procs import Recorder, eventually

from trio_redis_finalize import Backoff, Delivery, Mode, Outcome, StreamSubscription, open_consumer
from trio_redis_finalize._core.stream.decode import set_back_claimed
from trio_redis_finalize._forms.stream import own_pel
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(90)

S, G = "s", "g"
WINDOW = 30.0
"""The Backoff's window: attempt 2 is not due while the test runs."""


async def _pending(client: Client) -> dict[str, tuple[str, int]]:
    """Entry id -> (the consumer it is pending for, its delivery count)."""
    rows = await client.execute("XPENDING", S, G, "-", "+", 100)
    return {r[0].decode(): (r[1].decode(), int(r[3])) for r in rows}


async def test_the_set_back_leaves_an_entry_a_peer_claimed(client: Client) -> None:
    """``set_back_claimed`` on a real server: of three entries ``me`` claimed
    (count 2), one is still so (set back to 1), one a peer claimed since
    (left with it at count 3), one was acknowledged (left: pending for
    nobody).  Sent again (a lost reply), nothing more changes."""
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    ids = [(await client.execute("XADD", S, "*", "n", str(i))).decode() for i in range(3)]
    await client.execute("XREADGROUP", "GROUP", G, "dead", "COUNT", 3, "STREAMS", S, ">")
    await client.execute("XCLAIM", S, G, "me", 0, *ids)  # the claim: count 2
    await client.execute("XCLAIM", S, G, "peer", 0, ids[1])  # the peer's: count 3
    await client.execute("XACK", S, G, ids[2])
    p = set_back_claimed(S, G, "me", [(i, 2) for i in ids])
    assert p is not None
    expected = {ids[0]: ("me", 1), ids[1]: ("peer", 3)}
    await client.pipeline(list(p.commands))
    assert await _pending(client) == expected
    await client.pipeline(list(p.commands))
    assert await _pending(client) == expected


@pytest.mark.parametrize("mode", [Mode.RECLAIM, Mode.CLAIMING], ids=["reclaim", "claiming"])
async def test_a_peers_claim_between_the_claim_and_its_set_back_stays_the_peers(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch, mode: Mode,
) -> None:
    """Consumer A fails the entry's attempt 1 under a ``Backoff`` (attempt 2 due
    ``WINDOW`` s later) and stops: the entry stays pending for A (count 1)
    with its due time.  Consumer B (``mode``, ``min_idle`` 1 s) claims it
    (count 2) and reads its schedule: not due.  Right then a peer claims it
    (``XCLAIM``, as a peer's claim does after a stall of B: count 3).  B's
    set-back must leave it the peer's at count 3 (before: B's plain
    ``XCLAIM ... RETRYCOUNT 1`` took it back, count 1)."""
    await client.execute("XGROUP", "CREATE", S, G, "0", "MKSTREAM")
    eid = (await client.execute("XADD", S, "*", "n", "1")).decode()
    sub = StreamSubscription(S, G, mode=mode, min_idle=1.0, block=0.05, max_attempts=3)
    backoff = Backoff(base=0.01, cap=0.01, window=WINDOW)

    async def fail(d: Delivery) -> Outcome:
        raise RuntimeError("fails once")

    with trio.fail_after(60):  # a bound
        async with open_consumer(redis_url, name="a", shutdown_grace=0.5) as a:
            await a.mount(sub, fail, on_error=backoff)
            await eventually(lambda: client.execute("ZCARD", f"{{{S}}}:backoff:{G}"), 10,
                             "the due time written")
        assert await _pending(client) == {eid: ("a", 1)}

        real_scheduled, real_waits = own_pel.scheduled, own_pel.claimed_waits
        raced: list[str] = []
        set_back = trio.Event()

        async def scheduled(ctx: Any, ids: Sequence[bytes]) -> dict[bytes, tuple[float, int]]:
            left = await real_scheduled(ctx, ids)
            if left and not raced:  # the peer claims now, between B's claim and its set-back
                raced.extend(i.decode() for i in left)
                await client.execute("XCLAIM", S, G, "peer", 0, *left)  # counts, as XAUTOCLAIM
            return left

        async def claimed_waits(ctx: Any, live: list[Any]) -> list[Any]:
            try:
                return await real_waits(ctx, live)
            finally:
                if raced:
                    set_back.set()

        monkeypatch.setattr(own_pel, "scheduled", scheduled)
        monkeypatch.setattr(own_pel, "claimed_waits", claimed_waits)
        rec = Recorder()
        async with open_consumer(redis_url, name="b", shutdown_grace=0.0) as b:
            await b.mount(sub, rec, on_error=backoff)
            await set_back.wait()
            after = await _pending(client)
    assert raced == [eid]
    assert after == {eid: ("peer", 3)}, after
    assert rec.seen == []
