"""The durable delay set's move back into the stream keeps ``copy_maxlen``.

Copies a stream subscription writes into its stream carry ``MAXLEN ~
copy_maxlen``: a RETRY's copy, a runtime ``retry_after`` copy, and the due
durable copies the move script (``move_due_to_stream(cap)``) writes back.
A member wider than the script's budget (``_delay_set.MOVE_WIDTH``) is
handed back and written by the client (``_move_back``): with the cap too,
so the stream stays as long whichever writer moved the copy (before: the
client's ``XADD`` had no cap, and a delay set of wide copies grew the stream
past ``copy_maxlen``).  Against a real server; timeouts are bounds.
"""

from __future__ import annotations

import pytest
from _procs import Recorder, eventually

from trio_redis_finalize import ORIGIN_FIELD, RETRIES_FIELD, DelayedRetry, StreamSubscription, open_consumer
from trio_redis_finalize._envelope import pack_parts
from trio_redis_finalize._forms import _delay_set
from trio_redis_finalize._transport import Client

pytestmark = pytest.mark.timeout(90)

S, G = "s", "g"
DELAY_KEY = "{s}:delayed"
N = 600
CAP = 50
SLACK = 100
"""``MAXLEN ~`` trims whole stream nodes: up to a node (``stream-node-max-entries``,
100 by default) more than the cap may stay."""


@pytest.mark.parametrize("writer", ["script", "client"])
async def test_due_copies_moved_back_keep_the_copy_cap(
    redis_url: str, client: Client, monkeypatch: pytest.MonkeyPatch, writer: str,
) -> None:
    """``N`` due copies in the delay set of a subscription with ``copy_maxlen``
    ``CAP``, each moved by the script (``script``) or each handed back and
    written by the client (``client``: ``MOVE_WIDTH`` below their width).
    Once all are moved the stream holds at most ``CAP`` plus a node."""
    if writer == "client":
        monkeypatch.setattr(_delay_set, "MOVE_WIDTH", 4)  # each member: 6 values
    members = [pack_parts([b"%016d" % i, b"n", b"%d" % i, ORIGIN_FIELD, b"0-%d" % (i + 1),
                           RETRIES_FIELD, b"1"]) for i in range(N)]
    await client.execute("ZADD", DELAY_KEY, *[x for i, m in enumerate(members) for x in (i, m)])
    sub = StreamSubscription(S, G, block=0.05, delayed_retry=DelayedRetry.DURABLE_ZSET,
                             copy_maxlen=CAP)
    async with open_consumer(redis_url, name="c") as consumer:
        await consumer.mount(sub, Recorder())

        def moved() -> bool:
            return bool(consumer.stats()[sub.name]["effects"]["moved_from_delay_set"] == N)

        await eventually(moved, 30, f"{N} copies moved back")
        assert await client.execute("EXISTS", DELAY_KEY) == 0
        length = await client.execute("XLEN", S)
    assert length <= CAP + SLACK, f"{length} entries in the stream: copy_maxlen={CAP} not applied"
