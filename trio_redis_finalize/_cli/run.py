"""``trio-redis-finalize run MODULE:FACTORY``: a consumer your code mounts.

The factory is loaded (``MODULE:FACTORY``, the current directory
importable), a consumer opened and ``FACTORY(consumer)`` awaited; then the
consumer runs until SIGINT or SIGTERM (:func:`_watch_signals`: the first stops
gracefully, another one after :data:`SIGNAL_DEBOUNCE` exits at once), with
Prometheus metrics served when ``--metrics-port`` asks, and a one-line
:func:`shutdown_summary` at the stop.  ``--workers N`` hands over to the
supervisor of N such processes (``_workers``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect as pyinspect
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis import exceptions as rexc

from .._core._types import Effect
from .._transport import open_client, parse_url
from ._common import (
    PROG,
    CliError,
    Command,
    as_str,
    check_url,
    describe,
    non_negative,
    port,
    positive_int,
    url_arg,
)

__all__ = [
    "COMMAND", "SIGNAL_DEBOUNCE", "arguments", "execute", "load_factory", "shutdown_summary",
]

log = logging.getLogger("trio_redis_finalize.cli")


def arguments(p: argparse.ArgumentParser) -> None:
    """The ``run`` command's options (run as :func:`execute`)."""
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. myapp.worker:setup")
    url_arg(p)
    p.add_argument("--name", default=None,
                   help="consumer name (stable names let a restart recover pending work; "
                        "default: host-pid-random); with --workers N: the base of the workers' "
                        "names NAME-1 ... NAME-N (default: the host name)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="run N worker processes of FACTORY under a supervisor, consumer names "
                        "NAME-1 ... NAME-N (NAME: --name, default the host name); a worker that "
                        "dies is started again under its name (its own pending work re-read at "
                        "once); SIGTERM/SIGINT is forwarded once to each; exit status 1 when a "
                        "worker died or failed its stop")
    p.add_argument("--takeover", action="store_true",
                   help="mount even when another live process holds this consumer name "
                        "(default: refused; it would handle the same pending entries)")
    p.add_argument("--shutdown-grace", type=non_negative, default=10.0, metavar="SECONDS",
                   help="seconds in-flight handlers get to finish on shutdown (default 10)")
    p.add_argument("--backend", default="trio", choices=["trio", "asyncio"],
                   help="the event loop the consumer and your handlers run on: trio (default) "
                        "or asyncio (for handlers that use asyncio libraries)")
    p.add_argument("--metrics-port", type=port, default=None, metavar="N",
                   help="serve Prometheus metrics on http://HOST:N/metrics, with the "
                        "process metrics (needs the [prometheus] extra)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics are served on (default 127.0.0.1: this host "
                        "only; 0.0.0.0: every interface, e.g. scraped from outside a container)")
    p.add_argument("--metrics-prefix", default="trf", metavar="PREFIX",
                   help="prefix of the metric names (default trf)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")


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
        raise CliError(f"factory {spec!r}: importing {module_name!r} failed: {describe(e)}") from None
    except Exception as e:
        log.debug("factory %r: importing %r raised", spec, module_name, exc_info=e)
        raise CliError(f"factory {spec!r}: importing {module_name!r} failed: {describe(e)}") from None
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
                        failure = f"factory {spec!r} failed: {describe(e)}"
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
                    if t.group:  # a stream's group: what its PEL holds for the consumer
                        rows = (await client.execute("XPENDING", t.source, t.group))[3] or []
                        held += sum(int(n) for c, n in rows if as_str(c) == consumer.name)
                    elif t.processing:  # a reliable list: the consumer's processing list
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


def execute(args: argparse.Namespace) -> int:
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


COMMAND = Command(
    "run", arguments, execute,
    help="run a consumer whose subscriptions your code mounts",
    description=("Import MODULE, open a consumer and await FACTORY(consumer), e.g. "
                 "'async def setup(consumer): await consumer.mount(StreamSubscription(...), "
                 "handle)'; then run until SIGINT or SIGTERM: the first stops gracefully "
                 "(in-flight handlers finish, outcomes are finalized), a second exits at once "
                 "(code 128+signal). Logs go to stderr. The current directory is importable."),
)
"""This command's row of ``_cli.COMMANDS``."""
