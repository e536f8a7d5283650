"""``trio-redis-finalize dashboard``: the web dashboard (``_dashboard``) served
on its own, read-only unless credentials are given.  The dashboard itself
(its pages, its data, its actions) is imported only when the command runs:
it needs the ``[dashboard]`` extra."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import anyio

from ._common import CliError, Command, check_url, port, url_arg

__all__ = ["COMMAND", "arguments", "execute"]

log = logging.getLogger("trio_redis_finalize.dashboard")


def _basic(text: str) -> tuple[str, str]:
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise argparse.ArgumentTypeError("must look like USER:PASSWORD")
    return user, password


def arguments(p: argparse.ArgumentParser) -> None:
    """The ``dashboard`` command's options (run as :func:`execute`)."""
    url_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=port, default=8000, help="default 8000")
    p.add_argument("--token", default=os.environ.get("TRF_DASHBOARD_TOKEN"),
                   help="enable actions for this bearer token / login (default: $TRF_DASHBOARD_TOKEN)")
    p.add_argument("--basic-auth", type=_basic, default=None, metavar="USER:PASSWORD",
                   help="enable actions for these HTTP basic credentials")
    p.add_argument("--read-only", action="store_true", help="refuse actions even with credentials")
    p.add_argument("--key", action="append", default=[], metavar="KEY",
                   help="show this stream or list (repeat; default: every subscription SCAN finds)")
    p.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between a page's refreshes (default 5)")
    p.add_argument("--backend", default="trio", choices=["trio", "asyncio"])


def execute(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = check_url(args.url)
    try:
        from .. import dashboard
    except ImportError as e:
        raise CliError(str(e)) from None
    auth = args.token is not None or args.basic_auth is not None
    mode = "read-only" if args.read_only or not auth else "actions enabled (authenticated)"

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            try:
                port = await tg.start(lambda task_status: dashboard.serve(
                    url, args.port, host=args.host, task_status=task_status, token=args.token,
                    basic_auth=args.basic_auth, read_only=args.read_only, keys=args.key,
                    refresh=args.refresh))
            except OSError as e:
                raise CliError(f"--port {args.port}: {e.strerror or e}") from None
            where = "this host only" if args.host in ("127.0.0.1", "localhost", "::1") else (
                "reachable from other hosts" + ("" if auth else ", with no authentication"))
            print(f"dashboard on http://{args.host}:{port}/ ({where}; {mode})", file=sys.stderr,
                  flush=True)
            if not auth and where != "this host only":
                log.warning("listening on %s without --token or --basic-auth: anyone who can reach "
                            "it reads your queues (actions stay off)", args.host)

    try:
        anyio.run(run, backend=args.backend)
    except KeyboardInterrupt:
        return 0
    return 0


COMMAND = Command(
    "dashboard", arguments, execute,
    help="serve the web dashboard: health, dead letters, the last hour (needs the [dashboard] extra)",
    description=("Serve the web dashboard on http://HOST:PORT/: every subscription found "
                 "(problems first: stranded entries, lapsed consumers, overdue delays, growing "
                 "dead letters) with lag, pending, delay set, dead letters and the last hour; a "
                 "page per subscription and per dead letter (requeue, delete: confirmed, "
                 "logged). Read-only unless --token or --basic-auth is given."),
)
"""This command's row of ``_cli.COMMANDS``."""
