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

One module per command (``run``, ``inspect``, ``requeue``, ``demo``,
``dashboard``), each with its parser's options and what it runs, and
declaring its row of :data:`COMMANDS` (a ``_common.Command``); what they
share in ``_common``; the queues' state ``inspect`` and the dashboard read
in ``_queues``; here only the table, the parser it makes and :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from redis import exceptions as rexc

from . import dashboard, demo, inspect, requeue, run
from ._common import PROG, CliError, Command, leaves, one_line

__all__ = ["COMMANDS", "CliError", "build_parser", "main"]


COMMANDS: tuple[Command, ...] = (
    demo.COMMAND, run.COMMAND, inspect.COMMAND, requeue.COMMAND, dashboard.COMMAND,
)
"""The command line's table: a row per command (its name, its options, what it
runs and its help texts, declared in its module), in the order ``--help``
lists them."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # bad input is one line on stderr, exit 2 (no usage block); --help shows the usage
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    for row in COMMANDS:
        row.add_to(sub)
    return parser


_BAD_INPUT = (CliError, ValueError, rexc.RedisError, OSError)


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
        found = leaves(exc)
        if any(isinstance(e, KeyboardInterrupt) for e in found):
            return 130
        if isinstance(exc, SystemExit):
            raise
        bad = [e for e in found if isinstance(e, _BAD_INPUT)]
        if bad and len(bad) == len(found):
            print(f"{PROG} {args.command}: error: {one_line(str(bad[0]))}", file=sys.stderr)
            return 2
        raise
