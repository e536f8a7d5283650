"""An outcome's writes carried by a form's gated steps (sans-IO): what the
stream's and the reliable list's cells share of it.

:func:`carry_writes` walks a plan's commands for ``Cells.with_writes`` (each
form says how its own commands and gated scripts carry the writes);
:func:`argv_at` reads where a built script call's arguments start, for the
batchers that take calls carrying writes apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._commands import Arg, Command

__all__ = ["Carry", "OwnCarry", "argv_at", "carry_writes"]

Carry = Callable[[Command, Sequence[Arg], Sequence[Any]], Command]
"""A gated script's call as the step carrying an outcome's writes (encoded;
their keys)."""
OwnCarry = Callable[[Sequence[Command], int, Sequence[Arg], Sequence[Any]], tuple[Command, int] | None]
"""A form's own command ``commands[i]`` (not a script) as the step carrying
the writes, and how many commands from ``i`` that step stands for; None: it
carries none."""


def carry_writes(commands: Sequence[Command], writes: Sequence[Arg], keys: Sequence[str | bytes],
                 own: OwnCarry, carry: Mapping[object, Carry]) -> tuple[Command, ...] | None:
    """``commands`` with each step that removes the original carrying
    ``writes`` (encoded; their ``keys``), else None (no step can): a script
    call by ``carry[sha]``, another command by ``own``; one that carries
    nothing (a copy to another Cluster slot before the removal) as it is."""
    out: list[Command] = []
    carried = False
    i = 0
    while i < len(commands):
        cmd = commands[i]
        used = 1
        step: Command | None = None
        if cmd[0] == b"EVALSHA":
            how = carry.get(cmd[1])
            if how is not None:
                step = how(cmd, writes, keys)
        else:
            got = own(commands, i, writes, keys)
            if got is not None:
                step, used = got
        if step is None:
            out.append(cmd)
        else:
            out.append(step)
            carried = True
        i += used
    return tuple(out) if carried else None


def argv_at(cmd: Command, keys: int, args: int) -> int | None:
    """Where ``ARGV[1]`` of the script call ``cmd`` sits (``3 + numkeys``),
    when it sends at least ``keys`` keys and ``args`` arguments; else None
    (a call of another layout)."""
    nk = cmd[2]
    if nk.__class__ is not int or nk < keys or len(cmd) < 3 + nk + args:
        return None
    return 3 + nk
