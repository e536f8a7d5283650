"""``_core._carrying``: the walk both gated forms' ``Cells.with_writes`` share, and ``argv_at``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trio_redis_finalize._core._carrying import argv_at, carry_writes
from trio_redis_finalize._core._commands import Arg, Command


def _own(commands: Sequence[Command], i: int, writes: Sequence[Arg],
         keys: Sequence[Any]) -> tuple[Command, int] | None:
    """A plain removal ``DEL k`` carried, with the ``UNLINK`` right after it if any."""
    cmd = commands[i]
    if cmd[0] != "DEL":
        return None
    both = i + 1 < len(commands) and commands[i + 1][0] == "UNLINK"
    return ("CARRIED", cmd[1], *keys, *writes), 2 if both else 1


def _script(cmd: Command, writes: Sequence[Arg], keys: Sequence[Any]) -> Command:
    return ("SCRIPT", cmd[1], *keys, *writes)


CARRY = {"sha1": _script}


def test_each_removal_carries_the_writes_and_the_rest_stays_as_it_is() -> None:
    commands = [("SET", "a", 1), ("DEL", "k"), ("UNLINK", "k"), (b"EVALSHA", "sha1", 1, "x"),
                (b"EVALSHA", "other", 0), ("DEL", "j")]
    assert carry_writes(commands, ["w"], ["wk"], _own, CARRY) == (
        ("SET", "a", 1),
        ("CARRIED", "k", "wk", "w"),  # the UNLINK after it: in the one step
        ("SCRIPT", "sha1", "wk", "w"),
        (b"EVALSHA", "other", 0),  # a script no entry carries: as it is
        ("CARRIED", "j", "wk", "w"),
    )


def test_no_step_carries_none() -> None:
    assert carry_writes([("SET", "a", 1), (b"EVALSHA", "other", 0)], ["w"], [], _own, CARRY) is None
    assert carry_writes([], ["w"], [], _own, CARRY) is None


def test_argv_at() -> None:
    cmd: Command = (b"EVALSHA", "sha", 2, "k1", "k2", "a1", "a2", "a3")
    assert argv_at(cmd, 2, 3) == 5 and cmd[5] == "a1"
    assert argv_at(cmd, 2, 4) is None  # too few arguments
    assert argv_at(cmd, 3, 0) is None  # too few keys
    assert argv_at((b"EVALSHA", "sha", "2", "k1", "k2", "a1"), 2, 1) is None  # numkeys not an int
