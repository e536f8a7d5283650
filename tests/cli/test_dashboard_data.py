"""The dashboard's page data against a real server (and through Sentinel and Cluster URLs).

What a queue in trouble (``_dashboard_scenario``) looks like on the
overview: lag, pending, the stranded entries of a lapsed consumer, an
overdue delay, the dead letters with their reasons, the last hour from the
consumers' per-minute history; what a refresh costs (commands counted by
the server), and the history record's bounds and faults.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import anyio
import pytest
from _dashboard_scenario import BAD, DEAD, GROUP, LAG, STRANDED, STREAM, make_trouble

from trio_redis_finalize import Mode, _history
from trio_redis_finalize._core._plan import why_key
from trio_redis_finalize._core.stream import liveness as presence
from trio_redis_finalize._dashboard import _render
from trio_redis_finalize._dashboard._data import LAG_CAP, Row, dead_letter, overview, subscription
from trio_redis_finalize._dashboard._discover import discover
from trio_redis_finalize._transport import Client, open_client

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


async def processed(client: Client) -> int:
    """Commands the server (or its node) processed so far (``INFO stats``)."""
    info = (await client.execute("INFO", "stats")).decode()
    line = next(x for x in info.splitlines() if x.startswith("total_commands_processed:"))
    return int(line.split(":")[1])


def check_trouble(row: Row, stream: str = STREAM, *, lag: int = LAG) -> None:
    assert row.sub.key == stream and row.sub.group == GROUP
    # Redis 6.2 has no lag in XINFO GROUPS: counted up to LAG_CAP
    assert (row.lag, row.lag_capped) in ((lag, False), (LAG_CAP, True))
    assert row.pending == STRANDED
    assert row.stranded == STRANDED and row.stranded_consumers == ["worker-dead"]
    assert (row.alive, row.lapsed) == (1, 1)
    assert row.overdue is not None and 110 < row.overdue < 600
    assert row.delay_size == 1
    assert row.dead_depth == BAD and row.sub.dead_letter == "{" + stream + "}:dead"
    assert sum(row.history["ack"]) == 4 - BAD and sum(row.history["dead"]) == BAD
    assert sum(row.history["retry"]) == BAD  # the RETRYs that were dead-lettered
    assert len(row.history["ack"]) == _history.KEEP_MINUTES
    levels = [lvl for lvl, _ in row.problems]
    assert levels[:3] == ["bad", "bad", "bad"] and row.level == 0
    assert "3 stranded under worker-dead" in row.problems[0][1]
    assert row.path == "fallback" or row.path.startswith("native: xackdel")  # Redis 8.2+: native


async def test_a_queue_in_trouble_on_the_overview(redis_url: str, server_caps: Any) -> None:
    async with open_client(redis_url) as client:
        await make_trouble(redis_url, client)
        await client.execute("XADD", "quiet", "*", "n", "1")
        await client.execute("XGROUP", "CREATE", "quiet", "g", "$")
        found = await discover(client)  # found by SCAN: the dashboard starts after the consumers
        assert [(s.key, s.group) for s in found.subs] == [("orders", "billing"), ("quiet", "g")]
        assert [(d.key, d.source, d.group) for d in found.dead] == [(DEAD, STREAM, GROUP)]
        before = await processed(client)
        ov = await overview(client, found)
        after = await processed(client)
        # problems first: the troubled subscription above the quiet one
        assert [r.sub.key for r in ov.rows] == ["orders", "quiet"]
        check_trouble(ov.rows[0])
        assert ov.rows[1].problems == [] and ov.rows[1].lag == 0
        native = client.native and server_caps.names
        assert ov.rows[0].path == (f"native: {', '.join(server_caps.names)}" if native else "fallback")
        # what the docs state: 1 + per stream 1 + per group 4 + per delay set 2 + per dead letter 1,
        # then a PTTL per registered consumer (+ an XRANGE per group on 6.2): two round trips
        first = 1 + 2 * 1 + 2 * 4 + 2 * 2 + 1
        # two registered consumers; Redis 6.2 (no lag in XINFO GROUPS): + an XRANGE per group
        assert ov.commands in (first + 2, first + 2 + 1, first + 2 + 2)
        assert ov.round_trips == 2
        assert after - before == ov.commands + 1  # +1: the INFO itself
        # by name, without SCAN (a dead letter named too): the same subscriptions
        named = await discover(client, ["quiet", STREAM, DEAD])
        assert named.subs == found.subs and named.dead == found.dead
        html = _render.overview_body(ov, "")
        assert "worker-dead" in html and "stranded 3" in html


async def test_the_dead_letters_with_their_reasons(redis_url: str) -> None:
    async with open_client(redis_url) as client:
        await make_trouble(redis_url, client)
        info = await dead_letter(client, DEAD)
        assert info["kind"] == "stream" and info["length"] == BAD
        (reason,) = info["reasons"]
        assert "max_attempts=1" in reason and info["reasons"][reason] == BAD
        e = info["entries"][0]
        assert e["dead"]["source"] == STREAM and e["dead"]["group"] == GROUP
        assert e["dead"]["attempt"] == "1" and e["fields"]["bad"] == "yes" and e["time"]
        page = await dead_letter(client, DEAD, after=e["id"])
        assert [x["id"] for x in page["entries"]] == [info["entries"][1]["id"]]
        other = await dead_letter(client, DEAD, reason="nope")
        assert other["entries"] == [] and other["reasons"] == info["reasons"]
        # a key that is not a dead letter says so
        await client.execute("SET", "plain", "x")
        assert (await dead_letter(client, "plain"))["kind"] == "string"


async def test_a_subscription_page(redis_url: str) -> None:
    async with open_client(redis_url) as client:
        await make_trouble(redis_url, client)
        (sub,) = (await discover(client, [STREAM])).subs
        info = await subscription(client, sub)
        (g,) = info["groups"]
        consumers = {c["name"]: c for c in g["consumer_list"]}
        assert consumers["worker-dead"]["stranded"] and consumers["worker-dead"]["heartbeat"] == "lapsed"
        assert consumers["worker-live"]["heartbeat"] == "alive"
        assert [p["consumer"] for p in info["pending_page"]] == ["worker-dead"] * STRANDED
        assert all(p["attempt"] == 1 for p in info["pending_page"])
        # retention: everything below the stranded entries was finalized by the group
        assert info["retention"]["trimmable"] == 4
        assert info["delay_set"]["size"] == 1 and info["delay_set"]["oldest_due_in"] < -100
        page2 = await subscription(client, sub, after=info["pending_page"][0]["id"])
        assert len(page2["pending_page"]) == STRANDED - 1


async def test_history_is_bounded_expires_and_carries_what_did_not_run(redis_url: str) -> None:
    from trio_redis_finalize._stats import MountStats

    async with open_client(redis_url) as client:
        stats = MountStats("s")
        h = _history.History(_history.history_key("s", "g"), stats)
        assert not await h.write(client)  # nothing counted: nothing sent
        assert not await client.execute("EXISTS", h.key)
        # old minutes beyond the hour, as left by consumers long ago
        secs, _ = await client.execute("TIME")
        now = int(secs) // 60
        await client.pipeline([("HSET", h.key, f"{now - 70 - i}:ack", 1) for i in range(300)])
        stats.outcomes["ack"] += 5
        stats.effects["dead_lettered"] += 1
        assert await h.write(client)
        got = await client.execute("HGETALL", h.key)
        assert len(got) // 2 == 2  # the old minutes trimmed: this minute's ack and dead
        ttl = int(await client.execute("TTL", h.key))
        assert 0 < ttl <= (_history.KEEP_MINUTES + 2) * 60
        # refused (OOM: did not run): carried into the next write, counted once
        stats.outcomes["ack"] += 2
        await client.execute("CONFIG", "SET", "maxmemory", "1")
        try:
            assert not await h.write(client)
        finally:
            await client.execute("CONFIG", "SET", "maxmemory", "0")
        assert await h.write(client)
        counts = _history.buckets(await client.execute("HGETALL", h.key), now + 1, 3)
        assert sum(counts["ack"]) == 7 and sum(counts["dead"]) == 1


async def test_overview_through_sentinel(redis_sentinel: Any) -> None:
    url = redis_sentinel.url
    with anyio.fail_after(60):
        async with open_client(url) as client:
            await make_trouble(url, client)
            ov = await overview(client, await discover(client))
            check_trouble(ov.rows[0])


async def test_overview_and_dead_letters_on_a_cluster(redis_cluster_url: str) -> None:
    url = redis_cluster_url
    with anyio.fail_after(60):
        async with open_client(url) as client:
            await make_trouble(url, client)
            await make_trouble(url, client, "other-stream", lag=5)  # likely on another node
            found = await discover(client)  # SCAN on every master
            assert sorted(s.key for s in found.subs) == ["orders", "other-stream"]
            ov = await overview(client, found)
            rows = {r.sub.key: r for r in ov.rows}
            check_trouble(rows["orders"])
            check_trouble(rows["other-stream"], "other-stream", lag=5)
            info = await dead_letter(client, DEAD)
            assert info["length"] == BAD


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_fifty_subscriptions_of_ten_consumers(redis_url: str, backend: str) -> None:
    """The overview of 50 subscriptions x 10 consumers: its commands (counted
    by the server) and round trips; the time it took is printed, not asserted."""

    async def main() -> tuple[float, int]:
        async with open_client(redis_url) as client:
            cmds: list[tuple[Any, ...]] = []
            for i in range(50):
                s = f"s{i:02d}"
                cmds.append(("XADD", s, "*", "n", 1))
                cmds.append(("XGROUP", "CREATE", s, "g", "0"))
                for c in range(10):
                    cmds.append(("HSET", presence.registry_key(s, "g"), f"c{c}",
                                 presence.registration_value(30.0, Mode.PLAIN)))
                    cmds.append(("SET", presence.heartbeat_key(s, "g", f"c{c}"), 1, "PX", 600_000))
                    cmds.append(("XGROUP", "CREATECONSUMER", s, "g", f"c{c}"))
            await client.pipeline(cmds)
            found = await discover(client)
            assert len(found.subs) == 50
            took = []
            for _ in range(5):
                before = await processed(client)
                t0 = time.perf_counter()
                ov = await overview(client, found)
                _render.overview_body(ov, "")
                took.append(time.perf_counter() - t0)
                assert await processed(client) - before == ov.commands + 1
            assert ov.round_trips == 2 and all(r.alive == 10 for r in ov.rows)
            return min(took), ov.commands

    took, commands = anyio.run(main, backend=backend)
    # 1 TIME + 50 x (XINFO GROUPS, XINFO CONSUMERS, HGETALL registry, XPENDING, HGETALL history,
    # ZCARD, ZRANGE) + 500 PTTL (Redis 6.2: + 50 XRANGE for the lag)
    assert commands in (1 + 50 * 7 + 500, 1 + 50 * 7 + 500 + 50)
    print(f"\noverview of 50 subscriptions x 10 consumers ({backend}): {took * 1000:.0f} ms, "
          f"{commands} commands in 2 round trips")


async def test_a_reliable_list_in_trouble(redis_url: str) -> None:
    """A reliable list: its dead letter (a list and its reason hash, found by SCAN) and the
    processing list of a lapsed owner (stranded); requeued whole through the safe requeue."""
    from _dashboard_scenario import totals

    from trio_redis_finalize import ACK, RETRY, Delivery, Outcome, ReliableListSubscription, open_consumer
    from trio_redis_finalize._core.reliable_list.liveness import registry_key
    from trio_redis_finalize._dashboard._actions import apply, plan

    async def handle(d: Delivery) -> Outcome:
        return RETRY if d.data == b"bad" else ACK

    async with open_client(redis_url) as client:
        await client.execute("LPUSH", "jobs", b"ok", b"bad", b"ok", b"bad")
        every = _history.EVERY
        _history.EVERY = 0.05
        try:
            with anyio.fail_after(20):
                async with open_consumer(redis_url, name="w-live", shutdown_grace=1.0) as consumer:
                    await consumer.mount(ReliableListSubscription(
                        "jobs", max_attempts=1, dead_letter="{jobs}:dead", block=0.1), handle)
                    while totals(await client.execute("HGETALL", _history.history_key("jobs"))
                                 ).get("dead") != 2 or totals(await client.execute(
                                     "HGETALL", _history.history_key("jobs"))).get("ack") != 2:
                        await anyio.sleep(0.02)
                    # a second owner, dead, with an element in its processing list
                    await client.execute("HSET", registry_key("jobs"), "w-dead", "{jobs}:processing:w-dead")
                    await client.execute("LPUSH", "{jobs}:processing:w-dead", b"held")
                    await client.execute("LPUSH", "jobs", *[b"wait"] * 3)
                    found = await discover(client)
                    (sub,) = found.subs
                    assert (sub.kind, sub.key, sub.dead_letter) == ("list", "jobs", "{jobs}:dead")
                    ov = await overview(client, found)
        finally:
            _history.EVERY = every
        (row,) = ov.rows
        assert row.stranded == 1 and row.stranded_consumers == ["w-dead"]
        assert (row.alive, row.lapsed) == (1, 1) and row.pending == 1
        assert row.lag is not None and row.lag <= 3 and row.dead_depth == 2
        assert sum(row.history["dead"]) == 2 and row.problems[0][0] == "bad"
        info = await dead_letter(client, "{jobs}:dead")
        (reason,) = info["reasons"]
        assert info["reasons"][reason] == 2 and info["entries"][0]["data"] == "bad"
        page = await subscription(client, sub)
        dead_owner = next(p for p in page["processing"] if p["owner"] == "w-dead")
        assert not dead_owner["alive"] and dead_owner["length"] == 1
        held = [e for e in page["pending_page"] if e["owner"] == "w-dead"]
        assert [(e["data"], e["attempt"]) for e in held] == [("held", 1)]
        # requeued whole, to the queue its reason records name (no consumers left: not refused)
        await client.execute("DEL", registry_key("jobs"), "{jobs}:processing:w-dead")
        p = await plan(client, "{jobs}:dead", "requeue", "all")
        assert (p.count, p.targets, p.refusal) == (2, {"jobs": 2}, None)
        before = int(await client.execute("LLEN", "jobs"))
        assert await apply(client, p) == 2
        assert int(await client.execute("LLEN", "jobs")) == before + 2
        assert not await client.execute("EXISTS", "{jobs}:dead")


async def test_a_confirmed_list_action_acts_only_on_what_its_dry_run_counted(redis_url: str) -> None:
    """A list dead letter that grew between the dry run and the confirmation (a
    consumer dead-lettered meanwhile, ``LPUSH`` at the head): a delete of all
    deletes nothing and says so; a requeue of all moves only the oldest it
    counted.  Before, both acted on the whole list: the delete lost a dead
    letter nobody was shown."""
    from trio_redis_finalize._dashboard._actions import ActionError, apply, plan, seen_of

    dead = "{mail}:dead"
    async with open_client(redis_url) as client:
        await client.execute("LPUSH", dead, b"d1", b"d2")
        dry = await plan(client, dead, "delete", "all", force=True)
        assert dry.count == 2 and dry.upto is not None
        await client.execute("LPUSH", dead, b"late")  # dead-lettered while the operator reads
        now = await plan(client, dead, "delete", "all", force=True)
        with pytest.raises(ActionError, match="changed since the dry run"):
            await apply(client, now, force=True, seen=seen_of(now, str(dry.count), dry.upto))
        assert await client.execute("LRANGE", dead, 0, -1) == [b"late", b"d2", b"d1"]
        # as counted (a dry run after the change): deleted
        again = await plan(client, dead, "delete", "all", force=True)
        assert await apply(client, again, force=True,
                           seen=seen_of(again, str(again.count), again.upto)) == 3
        assert not await client.execute("EXISTS", dead)
        # requeue: the dead letter's oldest name their queue ("mail"); one more arrives after
        await client.execute("LPUSH", dead, b"r1", b"r2")
        records = [json.dumps({"source": "mail", "reason": "x"}) for _ in range(2)]
        for element, record in zip((b"r1", b"r2"), records, strict=True):
            await client.execute("HSET", why_key(dead), hashlib.sha1(element).hexdigest(), record)
        dry = await plan(client, dead, "requeue", "all", force=True)
        assert (dry.count, dry.targets) == (2, {"mail": 2})
        await client.execute("LPUSH", dead, b"r3")
        now = await plan(client, dead, "requeue", "all", force=True)
        assert await apply(client, now, force=True, seen=seen_of(now, str(dry.count), dry.upto)) == 2
        assert await client.execute("LRANGE", dead, 0, -1) == [b"r3"]
        assert sorted(await client.execute("LRANGE", "mail", 0, -1)) == [b"r1", b"r2"]


@pytest.mark.parametrize("fault", ["lost", "BUSY", "READONLY"])
async def test_a_history_write_on_the_wire(redis_server: Any, redis_url: str, fault: str) -> None:
    """Through the command proxy: a write whose reply is lost (it ran) is not sent
    again (counted once, never twice); one refused without running (BUSY, READONLY)
    is carried into the next write (counted once, not lost)."""
    from faults.cmdproxy import LOST, CommandProxy, error

    from trio_redis_finalize._stats import MountStats

    async with open_client(redis_url) as admin:
        flavour = "valkey" if b"valkey" in (await admin.execute("INFO", "server")).lower() else "redis"
        proxy = CommandProxy(redis_server.port, flavour=flavour)
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            with anyio.fail_after(30):
                async with open_client(proxy.url) as client:
                    stats = MountStats("s")
                    h = _history.History(_history.history_key("s", "g"), stats)
                    stats.outcomes["ack"] += 5
                    proxy.arm("EVALSHA:history_record", LOST if fault == "lost" else error(fault))
                    wrote = await h.write(client)
                    assert len(proxy.fired) == 1
                    assert wrote == (fault == "lost")
                    stats.outcomes["ack"] += 2
                    assert await h.write(client)
            tg.cancel_scope.cancel()
        secs, _ = await admin.execute("TIME")
        counts = _history.buckets(await admin.execute("HGETALL", h.key), int(secs) // 60, 2)
        assert sum(counts["ack"]) == 7  # lost reply: 5 (ran) + 2; refused: 7 in the second write


@pytest.mark.parametrize("fault", ["lost", "READONLY"])
@pytest.mark.parametrize("kind", ["stream", "list"])
async def test_a_confirmed_delete_on_the_wire(redis_server: Any, redis_url: str, kind: str,
                                              fault: str) -> None:
    """Through the command proxy, the confirmed delete of all (``XTRIM ... MINID``,
    ``DELETE_LIST_DEAD``) meets a lost reply (it ran) or a refusal (it did not):
    the action fails saying so, and the same confirmation sent again deletes
    nothing it did not count -- a dead letter written meanwhile stays."""
    from faults.cmdproxy import LOST, CommandProxy, error, serving

    from trio_redis_finalize._dashboard._actions import ActionError, apply, plan, seen_of

    dead = "{mail}:dead"
    async with open_client(redis_url) as admin:
        flavour = "valkey" if b"valkey" in (await admin.execute("INFO", "server")).lower() else "redis"
        if kind == "stream":
            for n in range(2):
                await admin.execute("XADD", dead, "*", "n", str(n))
        else:
            await admin.execute("LPUSH", dead, b"d1", b"d2")
        with anyio.fail_after(30):  # a bound
            async with serving(CommandProxy(redis_server.port, flavour=flavour)) as proxy, \
                    open_client(proxy.url) as client:
                dry = await plan(client, dead, "delete", "all", force=True)
                assert dry.count == 2
                proxy.arm("XTRIM" if kind == "stream" else "EVALSHA:delete_list_dead",
                          LOST if fault == "lost" else error(fault))
                seen = seen_of(dry, str(dry.count), dry.upto)
                with pytest.raises(Exception):  # noqa: B017 -- the lost reply's, or the refusal
                    await apply(client, dry, force=True, seen=seen)
                assert len(proxy.fired) == 1
                late = (await admin.execute("XADD", dead, "*", "n", "late") if kind == "stream"
                        else await admin.execute("LPUSH", dead, b"late"))
                assert late
                try:  # the confirmation again
                    await apply(client, dry, force=True, seen=seen)
                except ActionError as e:  # a list changed since its dry run: nothing deleted
                    assert kind == "list" and "changed since the dry run" in str(e)
        if kind == "stream":
            rows = await admin.execute("XRANGE", dead, "-", "+")
            assert [r[1] for r in rows] == [[b"n", b"late"]]
        else:
            left = await admin.execute("LRANGE", dead, 0, -1)
            # lost: the delete ran, the late one stays; refused: nothing ran, the
            # second confirmation refused (the list grew): all three stay
            assert left == ([b"late"] if fault == "lost" else [b"late", b"d2", b"d1"])
