"""The counted gate of reliable-list removals (identical elements), against a
real server: ``LIST_REMOVE``, ``LIST_COPY_REMOVE``, ``LIST_ZADD_REMOVE`` and
the give-back with ``n``, and the sans-IO helpers that set ``n``
(``_plan.list_removal`` / ``list_counted`` / ``list_copies``).

The property: k identical copies are removed by k removals carrying
n = k, k-1, ..., 1 (in the order they are sent); whichever of them is sent a
second time right after (an unknown outcome resent), exactly k copies are
made and the processing list ends empty: a resend never takes a copy another
removal still needs.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from trio_redis_finalize import ACK, DROP, RETRY, DelayedRetry, retry_after
from trio_redis_finalize._core._plan import list_copies, list_counted, list_removal, plan
from trio_redis_finalize._core._types import Target
from trio_redis_finalize._core.reliable_list.liveness import GIVE_BACK
from trio_redis_finalize._core.reliable_list.scripts import (
    LIST_COPY_REMOVE,
    LIST_REMOVE,
    LIST_ZADD_REMOVE,
)
from trio_redis_finalize._delivery import Delivery
from trio_redis_finalize._forms.reliable_list import ReliableListSubscription
from trio_redis_finalize._transport import Client

P, DEST, ZSET = "{q}:processing:c", "{q}", "{q}:delayed"


async def lrange(client: Client, key: str) -> list[bytes]:
    items: list[bytes] = await client.execute("LRANGE", key, 0, -1)
    return items


async def test_list_remove_gate_counts_copies(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X", b"Y")
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 3)) == 0  # only 2 copies
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 2)) == 1
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 2)) == 0  # the resend: closed
    assert await lrange(client, P) == [b"X", b"Y"]
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 1)) == 1
    assert await lrange(client, P) == [b"Y"]


async def test_list_copy_remove_with_n(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 2)) == 1
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 2)) is None
    assert await lrange(client, P) == [b"X"] and await lrange(client, DEST) == [b"c"]
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c")) == 1  # n absent: 1
    assert await lrange(client, P) == [] and await lrange(client, DEST) == [b"c", b"c"]


async def test_list_zadd_remove_with_n(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    assert await client.evalsha(LIST_ZADD_REMOVE, (P, ZSET), (b"X", 1000, b"m1", 2)) is not None
    assert await client.evalsha(LIST_ZADD_REMOVE, (P, ZSET), (b"X", 1000, b"m2", 2)) is None
    assert await lrange(client, P) == [b"X"]
    assert await client.execute("ZCARD", ZSET) == 1


async def test_give_back_with_n(client: Client) -> None:
    await client.execute("RPUSH", P, b"X", b"X")
    assert await client.evalsha(GIVE_BACK, (P, DEST), (b"X", 2)) == 1
    assert await client.evalsha(GIVE_BACK, (P, DEST), (b"X", 2)) == 0
    assert await lrange(client, P) == [b"X"] and await lrange(client, DEST) == [b"X"]


async def test_removals_take_the_copy_nearest_the_tail(client: Client) -> None:
    """The reader pushes onto the head, so the oldest elements (finalized first)
    are at the tail: every removal scans from there (``LREM … -1``, the gates'
    ``LPOS … RANK -n``) and takes the copy nearest it; the counted gates count
    the same copies from either end."""
    await client.execute("RPUSH", P, b"X", b"a", b"X", b"Y")  # head ... tail
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 3)) == 0
    assert await client.evalsha(LIST_REMOVE, (P,), (b"X", 2)) == 1
    assert await lrange(client, P) == [b"X", b"a", b"Y"]
    await client.execute("RPUSH", P, b"X")
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 3)) is None
    assert await client.evalsha(LIST_COPY_REMOVE, (P, DEST), (b"X", b"c", 2)) == 1
    assert await lrange(client, P) == [b"X", b"a", b"Y"]
    await client.execute("RPUSH", P, b"X")
    assert await client.evalsha(LIST_ZADD_REMOVE, (P, ZSET), (b"X", 1000, b"m", 2)) is not None
    assert await lrange(client, P) == [b"X", b"a", b"Y"]
    await client.execute("RPUSH", P, b"X")
    t = _target()
    (ack,) = plan(t, _delivery(), ACK).commands
    assert ack == ("LREM", P, -1, b"X") and t.processing == P
    assert await client.execute(*ack) == 1
    assert await lrange(client, P) == [b"X", b"a", b"Y"]


def _target(**kw: Any) -> Target:
    return ReliableListSubscription("q", **kw).target("c")


def _delivery(raw: bytes = b"X", attempt: int = 1) -> Delivery:
    return Delivery("q", None, {}, raw, attempt, "o", raw=raw, retries=attempt - 1)


@pytest.mark.parametrize(
    ("kw", "outcome"),
    [
        ({}, ACK),
        ({}, DROP),
        ({}, RETRY),
        ({"delayed_retry": DelayedRetry.DURABLE_ZSET}, retry_after(1)),
        ({"max_attempts": 1, "dead_letter": "dead"}, RETRY),
        ({"max_attempts": 1}, RETRY),
    ],
)
def test_every_removal_of_a_plan_can_be_counted(kw: dict[str, Any], outcome: Any) -> None:
    t = _target(**kw)
    d = _delivery()
    (cmd,) = plan(t, d, outcome).commands
    assert list_removal(t, cmd) == b"X" and list_copies(cmd) == 1
    counted = list_counted(cmd, 3)
    assert list_removal(t, counted) == b"X" and list_copies(counted) == 3
    assert list_counted(counted, 2) != counted and list_copies(list_counted(counted, 2)) == 2


def test_runtime_retry_after_and_other_keys_are_not_removals() -> None:
    t = _target()
    p = plan(t, _delivery(), retry_after(5))
    assert p.commands == ()
    assert list_removal(t, ("LREM", "other", -1, b"X")) is None
    assert list_removal(t, ("LPUSH", P, b"X")) is None


@pytest.mark.parametrize("k", [2, 3, 4])
async def test_resending_any_subset_of_counted_retries_copies_each_once(client: Client, k: int) -> None:
    t = _target()
    for resent in itertools.product([False, True], repeat=k):
        await client.execute("DEL", t.processing, t.source)
        await client.execute("RPUSH", t.processing, *([b"X"] * k))
        (cmd,) = plan(t, _delivery(), RETRY).commands
        for i, again in enumerate(resent):
            c = list_counted(cmd, k - i)
            await client.pipeline([c])
            if again:
                await client.pipeline([c])
        assert await lrange(client, t.processing) == [], resent
        assert int(await client.execute("LLEN", t.source)) == k, resent


# -- a runtime retry_after's delayed copy: numbered when sent, with a receipt -----------

def _gates(*held: bytes) -> Any:
    from trio_redis_finalize._core.reliable_list.gates import ListGates

    g = ListGates()
    g.target = _target()
    for raw in held:
        g.hold(raw)
    return g


def _argv(cmd: Any) -> Any:
    """ARGV of a script command: element, copy, token, n, nf, forget..., nw, writes."""
    return cmd[3 + int(cmd[2]):]


def _later(outcome: Any, raw: bytes = b"X") -> Any:
    from trio_redis_finalize._core._writes import plan_outcome

    (cmd,) = plan_outcome(_target(), _delivery(raw), outcome).later
    return cmd


@pytest.mark.parametrize("writes", [0, 1, 2])
def test_a_delayed_copy_is_numbered_when_sent_and_settled_by_its_reply(writes: int) -> None:
    """Sans-IO: the plan's copy becomes ``DELAYED_COPY`` when the scheduler
    sends it, gated on the copies held then (not when it was planned), with a
    fresh token; a resend keeps its token and is numbered as if first sent now;
    its reply settles it, with the writes to count only once committed (by it,
    or -- its receipt says -- by an earlier send)."""
    from trio_redis_finalize._core.reliable_list.liveness import delayed_parts, receipts_key

    outcome = retry_after(1)
    for i in range(writes):
        outcome = outcome.with_writes(("INCR", f"{{q}}:w{i}"))
    g = _gates(b"X", b"X", b"Y")
    later = _later(outcome)
    cmd = g.send_later(later)
    assert delayed_parts(cmd) == (b"X", 2, writes)
    assert cmd[3:6] == (P, "q", receipts_key(P))
    assert g.unsent == {b"X": 1, b"Y": 1} and g.in_hand == {b"X": 2, b"Y": 1} and g.delayed == {b"X": 1}
    again = g.send_later(cmd)  # not run, or its outcome unknown
    assert delayed_parts(again) == (b"X", 2, writes) and _argv(again)[2] == _argv(cmd)[2]  # token
    g.unsent[b"X"] -= 1  # the other X's removal sent meanwhile: a resend takes what is left
    assert delayed_parts(g.send_later(cmd)) == (b"X", 1, writes)
    # committed (1), or by the first send (2: the receipt): counted once, its token forgotten next
    assert g.later_answered(again, 2) == ("released", writes)
    token = _argv(cmd)[2]
    assert g.in_hand == {b"X": 1, b"Y": 1} and g.delayed == {} and g.forget == [token]
    nxt = _argv(g.send_later(_later(outcome, b"Y")))
    assert g.forget == [] and nxt[2] != token and nxt[3:6] == (1, 1, token)  # n, nf, forget


def test_a_delayed_copy_whose_gate_closed_or_failed_counts_no_writes() -> None:
    from redis import exceptions as rexc

    outcome = retry_after(1).with_writes(("INCR", "{q}:w"))
    g = _gates(b"X", b"X")
    cmd = g.send_later(_later(outcome))
    assert g.later_answered(cmd, None) == ("gate_closed", 0)
    # n = 2 closed: a copy this consumer handled may be left: the next rescan looks
    assert g.leftover == {b"X": 1} and g.rescan_wanted and g.forget == []
    cmd = g.send_later(_later(outcome))
    assert g.later_answered(cmd, rexc.ResponseError("WRONGTYPE write 1")) == ("failed", 0)
    assert g.in_hand == {} and g.unsent == {} and g.delayed == {}


def test_other_commands_are_not_delayed_copies() -> None:
    g = _gates(b"X")
    for cmd in [("LREM", P, -1, b"X"), ("LPUSH", "other", b"X"),
                LIST_COPY_REMOVE.command(("other", DEST), (b"X", b"c")),
                ("PUBLISH", "c", b"X")]:
        assert g.send_later(cmd) == cmd and g.later_answered(cmd, 1) is None
    assert g.unsent == g.in_hand == {b"X": 1}
    from trio_redis_finalize._core.reliable_list.gates import ListGates

    later = _later(retry_after(1))
    assert ListGates().send_later(later) == later  # no target yet: as it is


async def test_delayed_copy_script_commits_once_per_token(client: Client) -> None:
    """The script on a real server: the counted gate, the receipt a resend
    finds (2: nothing again, beside another copy of the same bytes), the
    writes in the same step, receipts deleted by the next copy."""
    from trio_redis_finalize._core._writes import encode_writes
    from trio_redis_finalize._core.reliable_list.liveness import delayed_copy, receipts_key

    w = encode_writes((("INCR", "{q}:w"),))
    await client.execute("RPUSH", P, b"X", b"X")
    one = delayed_copy(P, DEST, b"X", b"c", b"t1", 2, (), w, ("{q}:w",))
    assert await client.pipeline([one]) == [1]
    assert await client.pipeline([one]) == [2]  # its reply lost, sent again: the receipt
    assert await lrange(client, P) == [b"X"] and await lrange(client, DEST) == [b"c"]
    assert await client.execute("GET", "{q}:w") == b"1"
    # another token, gated on 2 copies: closed, nothing written
    assert await client.pipeline([delayed_copy(P, DEST, b"X", b"c", b"t2", 2, (), w, ("{q}:w",))]) == [None]
    assert await client.execute("GET", "{q}:w") == b"1"
    # the next copy deletes the answered receipts it names, then does its own
    assert await client.pipeline([delayed_copy(P, DEST, b"X", b"c", b"t3", 1, (b"t1",))]) == [1]
    assert await client.execute("HKEYS", receipts_key(P)) == [b"t3"]
    assert await lrange(client, P) == [] and await lrange(client, DEST) == [b"c", b"c"]
