"""The command line: ``python -m trio_redis_finalize`` / ``trio-redis-finalize``.

Commands (``--help`` on each)::

    demo [--url URL]                                every form x every outcome, as observed
    run MODULE:FACTORY [--url URL] [--backend trio|asyncio] [--metrics-port N] [--metrics-host H]
                                                    run a consumer defined in your code
    inspect KEY [--group G] [--entries N] [--url URL] [--json]
                                                    a queue's state (table, or --json)
    requeue DEAD_LETTER [--to KEY] [--limit N] [--force] [--url URL]
                                                    move dead-lettered messages back
    dashboard [--url URL] [--host H] [--port N] [--token T | --basic-auth U:P] [--read-only]
                                                    serve the web dashboard (_dashboard)

``--url`` defaults to ``redis://127.0.0.1:6379/0`` (``demo`` without
``--url`` starts a private redis-server instead).

Exit codes: 0 success; 1 failure at run time (the demo lost messages); 2 bad
input (unknown URL scheme, unreachable server, missing key, bad argument, a
factory module that fails to import, a factory that raises or mounts
nothing): one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import inspect as pyinspect
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from .._core._plan import Effect
from .._keys import derived, same_slot
from .._subscription import DEAD_SUFFIX, Form, default_dead_letter, source_of_dead_letter
from .._table import CliError, print_table
from .._transport import open_client, parse_url
from .inspect import (
    _dead_letter,
    _delay_set,
    _entries,
    _has_list_traces,
    _id_time,
    _str,
    inspect_list,
    inspect_stream,
    key_type,
    require_key,
)
from .inspect import why_records as why_records  # moved from here (names kept)
from .requeue import _requeue_list as _requeue_list
from .requeue import _requeue_stream, refusal

__all__ = ["CliError", "main"]

PROG = "trio-redis-finalize"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

log = logging.getLogger("trio_redis_finalize.cli")


# -- output -------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- connections and key checks ---------------------------------------------------


def check_url(url: str) -> str:
    """Parse ``url`` now so a bad one fails before anything starts."""
    try:
        parse_url(url)
    except ValueError as e:
        raise CliError(str(e)) from None
    return url


# -- run ----------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[Any], Awaitable[None]]:
    """``package.module:function`` -> the function (cwd is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"factory {spec!r} must look like MODULE:FACTORY (e.g. myapp.worker:setup)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise CliError(f"factory {spec!r}: no module named {e.name!r}") from None
        raise CliError(f"factory {spec!r}: importing {module_name!r} failed: {_describe(e)}") from None
    except Exception as e:
        log.debug("factory %r: importing %r raised", spec, module_name, exc_info=e)
        raise CliError(f"factory {spec!r}: importing {module_name!r} failed: {_describe(e)}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"factory {spec!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise CliError(f"factory {spec!r} is not callable")
    factory: Callable[[Any], Awaitable[None]] = obj
    return factory


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (of its first leaf, for a group), on one line."""
    leaves = _leaves(exc)
    first = leaves[0] if leaves else exc
    text = _one_line(str(first))
    return f"{type(first).__name__}: {text}" if text else type(first).__name__


def shutdown_summary(stats: dict[str, dict[str, Any]], held: int | None = None) -> str:
    """One line: what the consumer finalized and what it handed back.

    ``held``: what Redis holds for this consumer after the stop (its pending
    entries, its processing lists: :func:`_held_in_redis`), counted as
    "handed back"; ``None`` (Redis not asked): estimated from the stats."""
    effects: dict[str, int] = {}
    received = handled = 0
    for name, s in stats.items():
        received += int(s.get("received", 0))
        handled += sum(int(n) for n in s.get("outcomes", {}).values())
        for effect, n in s.get("effects", {}).items():
            if effect == Effect.NOTHING.value and name.startswith(("stream ", "reliable list ")):
                continue  # there: a give-back at the stop, not a finalization
            effects[effect] = effects.get(effect, 0) + int(n)
    # effects of finalizing a delivery (not: recovered lists, moves out of the delay set, ...)
    kinds = {e.value for e in Effect} - {Effect.LEFT_PENDING.value}
    finalized = sum(n for e, n in effects.items() if e in kinds)
    detail = ", ".join(f"{e} {n}" for e, n in sorted(effects.items()) if n and e in kinds)
    back = held if held is not None else (
        max(0, received - handled) + effects.get("left_pending", 0) + effects.get("backed_off", 0))
    stranded = [f"{n} in {name}" for name, s in stats.items() if (n := s.get("stranded"))]
    return (f"stopped: finalized {finalized} deliver{'y' if finalized == 1 else 'ies'}"
            f"{f' ({detail})' if detail else ''}; handed back {back} (pending in Redis, "
            "delivered again)" + (
                f"; stranded: {', '.join(stranded)} (entries pending for other consumers of the "
                "group with no live heartbeat, as last seen: dead ones are taken over by the "
                "next live consumer, those that never kept one are not -- see inspect KEY "
                "--group G)" if stranded else ""))


SIGNAL_DEBOUNCE = 1.0
"""Seconds after the first SIGINT/SIGTERM during which another one is ignored
(a wrapper and its process group often send two at once): only a signal
after it exits at once."""


async def _watch_signals(signals: Any, stop: anyio.CancelScope) -> None:
    first: float | None = None
    async for signum in signals:
        name = signal.Signals(signum).name
        now = anyio.current_time()
        if first is None:
            first = now
            log.warning("%s: shutting down gracefully (send it again, %g s later or more, to "
                        "exit at once)", name, SIGNAL_DEBOUNCE)
            stop.cancel()
        elif now - first < SIGNAL_DEBOUNCE:
            log.info("%s %.3f s after the first: ignored (a second signal counts after %g s)",
                     name, now - first, SIGNAL_DEBOUNCE)
        else:
            log.warning("%s again: exiting now", name)
            logging.shutdown()
            os._exit(128 + int(signum))


async def _run(url: str, factory: Callable[[Any], Awaitable[None]], spec: str, name: str | None,
               grace: float, metrics_port: int | None, metrics_prefix: str,
               metrics_host: str = "127.0.0.1", takeover: bool = False) -> int:
    from .._consumer import open_consumer

    failure: str | None = None
    summary = ""
    running: Any = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as outer:
            stop = anyio.CancelScope()
            outer.start_soon(_watch_signals, signals, stop)
            with stop:
                async with open_consumer(url, name=name, shutdown_grace=grace,
                                         takeover=takeover) as consumer:
                    running = consumer
                    if metrics_port is not None:  # before the factory: serves from the first mount
                        await outer.start(_serve_metrics, consumer, metrics_host, metrics_port,
                                          metrics_prefix)
                    log.info("consumer %s connected to %s; calling %s", consumer.name,
                             parse_url(url).address, spec)
                    try:
                        result = factory(consumer)
                        if not pyinspect.isawaitable(result):
                            failure = (
                                f"factory {spec!r} must be an async function taking the consumer "
                                "(async def setup(consumer): await consumer.mount(...))"
                            )
                        else:
                            await result
                    except Exception as e:
                        failure = f"factory {spec!r} failed: {_describe(e)}"
                        log.debug("factory %r raised", spec, exc_info=e)  # --log-level DEBUG
                    if failure is None and not consumer.mounts:
                        failure = (f"factory {spec!r} mounted nothing "
                                   "(call await consumer.mount(subscription, handler))")
                    if failure is None:
                        log.info("running %d subscription(s); SIGINT/SIGTERM to stop",
                                 len(consumer.mounts))
                        await anyio.sleep_forever()
            if failure is None and running is not None:
                held = await _held_in_redis(url, running)
                summary = shutdown_summary(running.stats(), held)
            outer.cancel_scope.cancel()
    if failure is not None:
        raise CliError(failure)
    log.info("stopped")
    print(f"{PROG} run: {summary}", file=sys.stderr, flush=True)
    return 0


async def _held_in_redis(url: str, consumer: Any) -> int | None:
    """What Redis holds for ``consumer`` after its stop: its entries pending in
    each stream group (XPENDING), its processing lists' lengths; ``None`` when
    Redis does not answer within 2 s."""
    try:
        with anyio.fail_after(2.0):
            async with open_client(url, name="trf-cli:run", max_connections=1) as client:
                held = 0
                for m in consumer.mounts:
                    t = m.target
                    if t.form is Form.STREAM:
                        rows = (await client.execute("XPENDING", t.source, t.group))[3] or []
                        held += sum(int(n) for c, n in rows if _str(c) == consumer.name)
                    elif t.form is Form.RELIABLE_LIST:
                        held += int(await client.execute("LLEN", t.processing))
                return held
    except (rexc.RedisError, OSError, TimeoutError) as e:
        log.debug("counting what Redis holds for the consumer failed: %s", e)
        return None


async def _serve_metrics(consumer: Any, host: str, port: int, prefix: str, *,
                         task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    try:
        from .. import prometheus
    except ImportError as e:
        raise CliError(str(e)) from None
    try:
        await prometheus.serve(consumer, port, host=host, prefix=prefix, task_status=task_status)
    except OSError as e:  # cannot listen (before started: the port in use, say)
        raise CliError(f"--metrics-port {port}: {e.strerror or e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    url = check_url(args.url)
    if args.workers is not None:
        return _run_workers(args, url)
    factory = load_factory(args.factory)
    code: int = anyio.run(_run, url, factory, args.factory, args.name, args.shutdown_grace,
                          args.metrics_port, args.metrics_prefix, args.metrics_host,
                          args.takeover, backend=args.backend)
    return code


def _run_workers(args: argparse.Namespace, url: str) -> int:
    """``run --workers N``: the supervisor of N ``run`` processes (``_workers``)."""
    from .. import _workers

    load_factory(args.factory)  # bad input is told here, once, not by N workers
    names = _workers.worker_names(args.name, args.workers)
    argvs = []
    for k, name in enumerate(names):
        options = ["--url", url, "--shutdown-grace", str(args.shutdown_grace),
                   "--backend", args.backend, "--log-level", args.log_level,
                   "--metrics-prefix", args.metrics_prefix, "--metrics-host", args.metrics_host]
        if args.metrics_port is not None:
            options += ["--metrics-port", str(args.metrics_port + k)]
        argvs.append(_workers.worker_argv(args.factory, name, options))
    log.info("starting %d workers of %s: %s", args.workers, args.factory, ", ".join(names))
    code: int = anyio.run(_workers.supervise, argvs, names)
    return code


# -- inspect ------------------------------------------------------------------


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
            newest = _id_time(_str(info["last_id"])) or "-"
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


def cmd_inspect(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    info = anyio.run(_inspect, url, args.key, args.group, args.delay_key, args.dead_letter,
                     args.heartbeat, args.entries, backend="trio")
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print_inspect(info)
    return 0


# -- requeue ------------------------------------------------------------------

async def _requeue(url: str, dead: str, dest: str, limit: int | None, force: bool = False) -> int:
    if dead == dest:
        raise CliError("--to must differ from the dead letter")
    async with open_client(url, name="trf-cli:requeue", max_connections=2) as client:
        kind = await require_key(client, dead, "dead letter", ("stream", "list"))
        dest_kind = await key_type(client, dest)
        if dest_kind not in ("none", kind):
            raise CliError(f"--to {dest!r} is a {dest_kind}, but dead letter {dead!r} is a {kind}")
        if not force:
            why = await refusal(client, dead, kind)
            if why is not None:
                raise CliError(f"{why}; nothing moved (--force moves anyway)")
        split = bool(client.params.cluster_seeds) and not same_slot(dead, dest)
        if kind == "stream":
            return await _requeue_stream(client, dead, dest, limit, split)
        return await _requeue_list(client, dead, dest, limit, split)


def cmd_requeue(args: argparse.Namespace) -> int:
    url = check_url(args.url)
    if args.to is None:  # a default dead letter names its source
        args.to = source_of_dead_letter(args.dead_letter)
        if args.to is None:
            raise CliError(f"--to KEY is needed: {args.dead_letter!r} is not a default dead "
                           f"letter ('{{SOURCE}}:dead') (see {PROG} requeue --help)")
    moved = anyio.run(_requeue, url, args.dead_letter, args.to, args.limit, args.force, backend="trio")
    print(f"requeued {moved} message{'s' if moved != 1 else ''} from {args.dead_letter} to {args.to}")
    return 0


# -- demo ---------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import demo

    if args.url is not None:
        check_url(args.url)
    return demo(args.url, verbose=args.verbose, per_cell=args.messages)


# -- parser -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # bad input is one line on stderr, exit 2 (no usage block); --help shows the usage
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_N = TypeVar("_N", int, float)


def _checked(
    convert: Callable[[str], _N], noun: str, ok: Callable[[_N], bool], refusal: str
) -> Callable[[str], _N]:
    """An argparse ``type``: ``convert(text)`` (else "is not ``noun``"), kept
    when ``ok`` (else "``refusal``")."""

    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} {refusal}")
        return value

    return parse


_positive_int = _checked(int, "an integer", lambda v: v >= 1, "must be >= 1")
_port = _checked(int, "a port number", lambda v: 0 <= v <= 65535, "is not a port number (0-65535)")
_non_negative = _checked(float, "a number", lambda v: v >= 0, "must be >= 0")  # NaN: refused


def _url_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=DEFAULT_URL,
        help=f"Redis URL: redis://[user:password@]host:port/db, rediss://... (TLS), "
             f"unix://path, redis+cluster://host:port[,host:port...] (Redis Cluster), "
             f"redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db] "
             f"(Sentinel) (default: {DEFAULT_URL})",
    )


def _command(
    sub: argparse._SubParsersAction[_Parser],
    func: Callable[[argparse.Namespace], int], name: str, *, help: str, description: str,
) -> argparse.ArgumentParser:
    """The sub-command ``name``, run as ``func(args)``."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Consume Redis streams, lists and Pub/Sub from trio, finalizing every "
                    "delivery with the commands proper to its form and outcome.",
        epilog="Exit codes: 0 ok; 1 failure at run time (the demo lost messages); 2 bad input "
               "(one line on stderr).",
    )
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    p = _command(
        sub, cmd_demo, "demo",
        help="every form x every outcome against a real server; prints the observed table",
        description="Mount one subscription of every form (stream, claiming stream, stream with "
                    "a durable delay set, reliable list, simple list, channel, pattern), produce "
                    "messages whose handlers return every outcome, record with MONITOR the "
                    "Redis commands each finalization issued, print them as a form x outcome "
                    "table and check that nothing was lost (last line 'lost: N'; exit 1 if N > 0).",
    )
    p.add_argument("--url", default=None,
                   help="use this server (keys are prefixed trf-demo-<random> and deleted after); "
                        "default: start a private redis-server on a free port")
    p.add_argument("--messages", type=_positive_int, default=3, metavar="N",
                   help="messages per form and outcome (default 3)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the library's log records")

    p = _command(
        sub, cmd_run, "run",
        help="run a consumer whose subscriptions your code mounts",
        description="Import MODULE, open a consumer and await FACTORY(consumer), e.g. "
                    "'async def setup(consumer): await consumer.mount(StreamSubscription(...), "
                    "handle)'; then run until SIGINT or SIGTERM: the first stops gracefully "
                    "(in-flight handlers finish, outcomes are finalized), a second exits at once "
                    "(code 128+signal). Logs go to stderr. The current directory is importable.",
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. myapp.worker:setup")
    _url_arg(p)
    p.add_argument("--name", default=None,
                   help="consumer name (stable names let a restart recover pending work; "
                        "default: host-pid-random); with --workers N: the base of the workers' "
                        "names NAME-1 ... NAME-N (default: the host name)")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="run N worker processes of FACTORY under a supervisor, consumer names "
                        "NAME-1 ... NAME-N (NAME: --name, default the host name); a worker that "
                        "dies is started again under its name (its own pending work re-read at "
                        "once); SIGTERM/SIGINT is forwarded once to each; exit status 1 when a "
                        "worker died or failed its stop")
    p.add_argument("--takeover", action="store_true",
                   help="mount even when another live process holds this consumer name "
                        "(default: refused; it would handle the same pending entries)")
    p.add_argument("--shutdown-grace", type=_non_negative, default=10.0, metavar="SECONDS",
                   help="seconds in-flight handlers get to finish on shutdown (default 10)")
    p.add_argument("--backend", default="trio", choices=["trio", "asyncio"],
                   help="the event loop the consumer and your handlers run on: trio (default) "
                        "or asyncio (for handlers that use asyncio libraries)")
    p.add_argument("--metrics-port", type=_port, default=None, metavar="N",
                   help="serve Prometheus metrics on http://HOST:N/metrics, with the "
                        "process metrics (needs the [prometheus] extra)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics are served on (default 127.0.0.1: this host "
                        "only; 0.0.0.0: every interface, e.g. scraped from outside a container)")
    p.add_argument("--metrics-prefix", default="trf", metavar="PREFIX",
                   help="prefix of the metric names (default trf)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")

    p = _command(
        sub, cmd_inspect, "inspect",
        help="show a stream's or list's state: groups, pending, delay set, dead letter",
        description="For a stream: length, consumer groups (consumers, pending, last delivered id, "
                    "oldest needed entry, lag, oldest idle pending entry), consumers, the oldest "
                    "entry any group still needs and how many entries below it a trim "
                    "(Retention.TRIM_ACKED) would remove. For a list: length and the "
                    "processing lists ({KEY}:processing:* and those registered in "
                    "{KEY}:list-consumers:<KEY>) "
                    "with their owners' heartbeat age. "
                    "For both: the delay set ({KEY}:delayed unless --delay-key) and, with "
                    "--dead-letter, the dead letter's length.",
    )
    p.add_argument("key", metavar="KEY", help="the stream or list")
    p.add_argument("--group", default=None, help="only this consumer group (streams)")
    _url_arg(p)
    p.add_argument("--delay-key", default=None, help="the durable delay set (default {KEY}:delayed)")
    p.add_argument("--dead-letter", default=None, metavar="KEY", help="also show this dead letter")
    p.add_argument("--heartbeat", type=_non_negative, default=30.0, metavar="SECONDS",
                   help="the subscriptions' heartbeat setting, to estimate heartbeat age from the "
                        "heartbeat key's TTL (lists; default 30, the library's default)")
    p.add_argument("--entries", type=_positive_int, default=None, metavar="N",
                   help="also list the N oldest entries (stream) or elements (list); for a dead "
                        "letter, with why each was dead-lettered (reason, error, source, entry id "
                        "or processing list, group, attempt, time)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")

    p = _command(
        sub, cmd_requeue, "requeue",
        help="move dead-lettered messages back onto a queue",
        description="Move messages from DEAD_LETTER (oldest first) back to --to, with their "
                    "retry counter reset and their origin id kept. Stream entries lose the "
                    "trf-dead-* fields; each move is one script gated on the entry still being in "
                    "the dead letter (copy first, then XDEL / RPOP), so racing requeues move a "
                    "message once; a list element's reason record ({DEAD_LETTER}:why) goes with "
                    "it. Refused, unless --force: a stream whose entries lack the trf-dead-* "
                    "fields, a list whose elements have no reason record (not a dead letter this "
                    "library wrote), a stream a consumer group reads with entries pending, a list "
                    "consumers are reading.",
    )
    p.add_argument("dead_letter", metavar="DEAD_LETTER", help="the dead-letter stream or list")
    p.add_argument("--to", default=None, metavar="KEY",
                   help="where the messages go (default: the source of a default dead letter, "
                        "{KEY}:dead -> KEY)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                   help="move at most N messages (default: all)")
    p.add_argument("--force", action="store_true",
                   help="move even from a stream or list whose entries are not dead letters "
                        "written by this library, or that a consumer group reads with entries "
                        "pending, or from a list that consumers are reading (processing lists "
                        "exist)")
    _url_arg(p)

    from .._dashboard._command import add_command

    add_command(sub, _command, _url_arg, _port)
    return parser


# -- main ---------------------------------------------------------------------

_BAD_INPUT = (CliError, ValueError, rexc.RedisError, OSError)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m trio_redis_finalize`` and ``trio-redis-finalize``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        leaves = _leaves(exc)
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            return 130
        if isinstance(exc, SystemExit):
            raise
        bad = [e for e in leaves if isinstance(e, _BAD_INPUT)]
        if bad and len(bad) == len(leaves):
            print(f"{PROG} {args.command}: error: {_one_line(str(bad[0]))}", file=sys.stderr)
            return 2
        raise
