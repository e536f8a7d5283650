"""What every command of the command line shares: :class:`CliError` (bad
input), the program's name and default URL, aligned tables (``rich`` on a
terminal when installed), one-line error texts, the URL and key checks,
the argparse pieces each command's parser is built from, and
:class:`Command`, the row of the command line's table each command declares.

The bottom of ``_cli``: the commands (``run``, ``inspect``, ``requeue``,
``demo``, ``dashboard``) import from here, never from each other's parsers or
from ``_cli/__init__`` (the parser and ``main``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._transport import Client, parse_url

__all__ = ["DEFAULT_URL", "PROG", "CliError", "Command", "print_table"]

PROG = "trio-redis-finalize"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


class CliError(Exception):
    """Bad input: printed as one line on stderr, exit code 2."""


# -- output -------------------------------------------------------------------


def _rich_console() -> Any:
    """A ``rich`` console when rich is installed and stdout is a terminal."""
    if os.environ.get("NO_COLOR") or not sys.stdout.isatty():
        return None
    try:
        return importlib.import_module("rich.console").Console()
    except ImportError:
        return None


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None) -> None:
    """Print an aligned table (with ``rich`` on a terminal when it is installed)."""
    console = _rich_console()
    if console is not None:
        table = importlib.import_module("rich.table").Table(title=title)
        for h in headers:
            table.add_column(h)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))
    if title:
        print(title)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


def one_line(text: str) -> str:
    return " ".join(text.split())


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions of ``exc``: itself, or every leaf of a group."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (of its first leaf, for a group), on one line."""
    found = leaves(exc)
    first = found[0] if found else exc
    text = one_line(str(first))
    return f"{type(first).__name__}: {text}" if text else type(first).__name__


# -- replies, URLs and keys ---------------------------------------------------------


def as_str(value: Any) -> str:
    """A reply as text (bytes decoded, undecodable bytes escaped)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def pairs(flat: Sequence[Any]) -> dict[str, Any]:
    """A RESP2 flat ``[name, value, name, value, ...]`` reply as a dict."""
    return {as_str(k): v for k, v in zip(flat[::2], flat[1::2], strict=False)}


def check_url(url: str) -> str:
    """Parse ``url`` now so a bad one fails before anything starts."""
    try:
        parse_url(url)
    except ValueError as e:
        raise CliError(str(e)) from None
    return url


async def key_type(client: Client, key: str) -> str:
    return as_str(await client.execute("TYPE", key))


async def require_key(client: Client, key: str, what: str, types: Sequence[str]) -> str:
    kind = await key_type(client, key)
    if kind == "none":
        raise CliError(f"{what} {key!r} does not exist")
    if kind not in types:
        raise CliError(f"{what} {key!r} is a {kind}, not a {' or a '.join(types)}")
    return kind


# -- the parser's pieces --------------------------------------------------------------


_N = TypeVar("_N", int, float)


def checked(
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


positive_int = checked(int, "an integer", lambda v: v >= 1, "must be >= 1")
port = checked(int, "a port number", lambda v: 0 <= v <= 65535, "is not a port number (0-65535)")
non_negative = checked(float, "a number", lambda v: v >= 0, "must be >= 0")  # NaN: refused


def url_arg(p: argparse.ArgumentParser) -> None:
    """The ``--url`` option (every command but ``demo``, whose default differs)."""
    p.add_argument(
        "--url", default=DEFAULT_URL,
        help=f"Redis URL: redis://[user:password@]host:port/db, rediss://... (TLS), "
             f"unix://path, redis+cluster://host:port[,host:port...] (Redis Cluster), "
             f"redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db] "
             f"(Sentinel) (default: {DEFAULT_URL})",
    )


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of the command line: its row of ``_cli.COMMANDS`` (each
    command's module declares its own as ``COMMAND``)."""

    name: str
    arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the command's options to its parser."""
    execute: Callable[[argparse.Namespace], int]
    """Runs the command with the parsed arguments: the exit code."""
    help: str
    """Its line in ``--help``'s list."""
    description: str
    """What its own ``--help`` says first."""

    def add_to(self, sub: argparse._SubParsersAction[Any]) -> None:
        """This command's parser in ``sub``, run as :attr:`execute`."""
        p: argparse.ArgumentParser = sub.add_parser(self.name, help=self.help,
                                                    description=self.description)
        p.set_defaults(func=self.execute)
        self.arguments(p)
