"""``trio-redis-finalize inspect KEY``: a stream's or a list's state, as
tables or (``--json``) as the dicts ``_queues`` reads.

A stream: groups, consumers with their heartbeats and what is stranded,
retention; a list: its processing lists and their owners' heartbeats; both:
the delay set, the dead letter, and with ``--entries N`` the oldest entries
(a dead letter's with why each is there).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio

from .._keys import derived
from .._subscription import DEAD_SUFFIX, default_dead_letter
from .._transport import open_client
from ._common import (
    CliError,
    Command,
    as_str,
    check_url,
    key_type,
    non_negative,
    positive_int,
    print_table,
    url_arg,
)
from ._queues import (
    _dead_letter,
    _delay_set,
    _entries,
    _has_list_traces,
    _id_time,
    inspect_list,
    inspect_stream,
)
from .requeue import refusal

__all__ = ["COMMAND", "arguments", "execute", "print_inspect"]


def arguments(p: argparse.ArgumentParser) -> None:
    """The ``inspect`` command's options (run as :func:`execute`)."""
    p.add_argument("key", metavar="KEY", help="the stream or list")
    p.add_argument("--group", default=None, help="only this consumer group (streams)")
    url_arg(p)
    p.add_argument("--delay-key", default=None, help="the durable delay set (default {KEY}:delayed)")
    p.add_argument("--dead-letter", default=None, metavar="KEY", help="also show this dead letter")
    p.add_argument("--heartbeat", type=non_negative, default=30.0, metavar="SECONDS",
                   help="the subscriptions' heartbeat setting, to estimate heartbeat age from the "
                        "heartbeat key's TTL (lists; default 30, the library's default)")
    p.add_argument("--entries", type=positive_int, default=None, metavar="N",
                   help="also list the N oldest entries (stream) or elements (list); for a dead "
                        "letter, with why each was dead-lettered (reason, error, source, entry id "
                        "or processing list, group, attempt, time)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _heartbeat_text(c: dict[str, Any]) -> str:
    if c["heartbeat"] == "alive":
        return "alive" + ("" if c["heartbeat_ttl"] is None else f" (expires in {c['heartbeat_ttl']:.3f} s)")
    if c["heartbeat"] == "lapsed":
        return "lapsed (dead)"
    if c["heartbeat"] == "stopped":
        return "stopped (cleanly)"
    return "none"


def _stranded_text(c: dict[str, Any]) -> str:
    if not c["stranded"]:
        return "-"
    if c["heartbeat"] == "stopped":
        return "handed back: a live mount takes them at once"
    if c["heartbeat"] == "lapsed":
        if c["mode"] == "claiming":
            return "yes: a CLAIMING mount claims them back once idle min_idle"
        return "yes: a live PLAIN/RECLAIM mount takes them over"
    return "yes: no heartbeat; only Mode.RECLAIM (min_idle) or XCLAIM takes them"


async def _inspect(url: str, key: str, group: str | None, delay_key: str | None,
                   dead_letter: str | None, heartbeat: float, entries: int | None = None
                   ) -> dict[str, Any]:
    async with open_client(url, name="trf-cli:inspect", max_connections=2) as client:
        kind = await key_type(client, key)
        if kind == "none" and await _has_list_traces(client, key):
            kind = "list"  # an empty queue (Redis deletes empty lists) with live consumers
        if kind == "none":
            raise CliError(f"key {key!r} does not exist")
        if kind not in ("stream", "list"):
            raise CliError(f"key {key!r} is a {kind}, not a stream or a list")
        if kind == "stream":
            info = await inspect_stream(client, key, group)
        else:
            if group is not None:
                raise CliError(f"--group: key {key!r} is a list, not a stream")
            info = await inspect_list(client, key, heartbeat)
        # a dead letter (what this library wrote, no group reading it) has no
        # delay set nor a dead letter of its own: no rows for them
        info["is_dead_letter"] = is_dead = (
            (int(info["length"]) > 0 or key.endswith(DEAD_SUFFIX))
            and await refusal(client, key, kind) is None)
        info["delay_set"] = (await _delay_set(client, delay_key or derived(key, ":delayed"))
                             if delay_key or not is_dead else None)
        dead_letter = dead_letter or (None if is_dead else default_dead_letter(key))
        info["dead_letter"] = await _dead_letter(client, dead_letter) if dead_letter else None
        if entries is not None:
            info["entries"] = await _entries(client, key, kind, entries)
        return info


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def print_inspect(info: dict[str, Any]) -> None:
    rows: list[list[str]] = [["type", info["type"]], ["length", str(info["length"])]]
    if info["type"] == "stream":
        rows.append(["first id", info["first_id"] or "-"])
        shown = info.get("entries")
        if shown is not None and len(shown) < info["length"]:
            # --entries N lists N entries: the newest, not among them, by its time only
            newest = _id_time(as_str(info["last_id"])) or "-"
            rows.append(["entries shown", f"the {len(shown)} oldest of {info['length']} "
                                          f"(the newest written {newest})"])
        else:
            rows.append(["last id", info["last_id"]])
        ret = info["retention"]
        if ret["oldest_needed_id"] is None:
            rows.append(["oldest needed", "- (no groups: a trim leaves the stream alone)"])
        else:
            rows.append(["oldest needed", f"{ret['oldest_needed_id']} (over all groups)"])
            more = "+" if ret["trimmable_capped"] else ""
            rows.append(["trim would remove", f"{ret['trimmable']}{more} entries"])
    if info.get("is_dead_letter"):
        rows.append(["dead letter", "yes (written by trio_redis_finalize; requeue moves it back)"])
    ds = info["delay_set"]
    if ds is not None:
        due = ds["oldest_due_in"]
        due_text = "" if due is None else (f", oldest due in {due:.3f} s" if due >= 0
                                           else f", oldest overdue by {-due:.3f} s")
        rows.append(["delay set", f"{ds['key']}: {ds['size']}{due_text}" + (
            f" ({ds['error']})" if "error" in ds else "")])
    dl = info["dead_letter"]
    if dl is not None:
        rows.append(["dead letter", f"{dl['key']}: {dl['length']}" + (
            f" ({dl['error']})" if "error" in dl else "" if dl["type"] != "none" else " (absent)")])
    print_table(["", info["key"]], rows)
    if info["type"] == "stream":
        print()
        grows = []
        for g in info["groups"]:
            o = g["oldest_idle_pending"]
            oldest = "-" if o is None else (
                f"{o['id']} idle {o['idle']:.3f} s, {o['deliveries']} deliveries, {o['consumer']}")
            grows.append([g["name"], str(g["consumers"]), str(g["pending"]), g["last_delivered_id"],
                          "-" if g["lag"] is None else str(g["lag"]), oldest, g["oldest_needed_id"]])
        print_table(["group", "consumers", "pending", "last delivered", "lag",
                     "oldest idle pending", "oldest needed"],
                    grows or [["(no groups)", "", "", "", "", "", ""]])
        for g in info["groups"]:
            if g["consumer_list"]:
                print()
                print_table(
                    [f"consumer of {g['name']}", "pending", "idle", "heartbeat", "stranded"],
                    [[c["name"], str(c["pending"]), _seconds(c["idle"]), _heartbeat_text(c),
                      _stranded_text(c)] for c in g["consumer_list"]],
                )
                if g["stranded"]:
                    print(f"stranded in group {g['name']}: {g['stranded']} pending entries under "
                          "consumers with no live heartbeat")
    else:
        print()
        prows = [[p["key"], p["owner"], str(p["length"]),
                  _seconds(p["heartbeat_age"]) if p["alive"] else "none (owner dead)",
                  _seconds(p["heartbeat_ttl"])]
                 for p in info["processing"]]
        print_table(["processing list", "owner", "length", "heartbeat age", "expires in"],
                    prows or [["(none)", "", "", "", ""]])
    if "entries" in info:
        print()
        print_entries(info["type"], info["entries"])


def _fields_text(fields: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def print_entries(kind: str, entries: list[dict[str, Any]]) -> None:
    """The ``--entries`` table: dead-letter columns when any entry is a dead letter."""
    if kind == "stream":
        if any(e["dead"] for e in entries):
            rows = []
            for e in entries:
                d = e["dead"] or {}
                rows.append([e["id"], e["time"] or "-", d.get("reason", "-"), d.get("source", "-"),
                             d.get("id", "-"), d.get("group", "-"), d.get("attempt", "-"),
                             d.get("error", "-"), _fields_text(e["fields"])])
            print_table(["entry", "dead-lettered at", "reason", "source", "source id", "group",
                         "attempt", "error", "fields"], rows)
        else:
            print_table(["entry", "written at", "fields"],
                        [[e["id"], e["time"] or "-", _fields_text(e["fields"])] for e in entries]
                        or [["(empty)", "", ""]])
        return
    def origin(e: dict[str, Any]) -> str:
        return str(e["origin"] or (e["corrupt"] and f"corrupt: {e['corrupt']}") or "-")

    if any(e["dead"] for e in entries):
        rows = []
        for i, e in enumerate(entries):
            d = e["dead"] or {}
            rows.append([str(i), e["time"] or "-", str(d.get("reason", "-")),
                         str(d.get("source", "-")), str(d.get("attempt", "-")),
                         str(d.get("error", "-")), origin(e), e["data"]])
        print_table(["#", "dead-lettered at", "reason", "source", "attempt", "error", "origin",
                     "data"], rows)
        return
    print_table(["#", "data", "retries", "origin"],
                [[str(i), e["data"], "-" if e["retries"] is None else str(e["retries"]), origin(e)]
                 for i, e in enumerate(entries)] or [["(empty)", "", "", ""]])


def execute(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    info = anyio.run(_inspect, url, args.key, args.group, args.delay_key, args.dead_letter,
                     args.heartbeat, args.entries, backend="trio")
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print_inspect(info)
    return 0


COMMAND = Command(
    "inspect", arguments, execute,
    help="show a stream's or list's state: groups, pending, delay set, dead letter",
    description=("For a stream: length, consumer groups (consumers, pending, last delivered id, "
                 "oldest needed entry, lag, oldest idle pending entry), consumers, the oldest "
                 "entry any group still needs and how many entries below it a trim "
                 "(Retention.TRIM_ACKED) would remove. For a list: length and the "
                 "processing lists ({KEY}:processing:* and those registered in "
                 "{KEY}:list-consumers:<KEY>) "
                 "with their owners' heartbeat age. "
                 "For both: the delay set ({KEY}:delayed unless --delay-key) and, with "
                 "--dead-letter, the dead letter's length."),
)
"""This command's row of ``_cli.COMMANDS``."""
