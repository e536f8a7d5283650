"""What the gated forms' cells share (sans-IO): the stream's and the reliable list's.

:class:`GatedCells` is the row of a form whose originals are removed behind a
gate: ACK and DROP remove the original, and an outcome's writes ride on the
step that removes it (:meth:`~GatedCells.with_writes`, walked by
:func:`carry_writes`: each form says how its own commands and gated scripts
carry the writes); :func:`argv_at` reads where a built script call's
arguments start, for the batchers that take calls carrying writes apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ._commands import Arg, Command
from ._types import REMOVED, Cells, Target

__all__ = ["Carry", "GatedCells", "OwnCarry", "argv_at", "carry_writes"]

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


class GatedCells(Cells):
    """The row of a gated form (the stream's, the reliable list's): ACK and
    DROP remove the original, ACKs and DROPs carrying writes go as batched
    calls, and any step that removes the original can carry an outcome's
    writes."""

    __slots__ = ()

    gated: ClassVar[bool] = True
    writes_calls: ClassVar[bool] = True
    removals = REMOVED
    carry: ClassVar[Mapping[object, Carry]] = {}
    """The gated scripts of this form's plans that remove the original, by
    sha: how each becomes the step that carries an outcome's writes."""

    def with_writes(self, t: Target, commands: Sequence[Command], writes: Sequence[Arg],
                    keys: Sequence[str | bytes]) -> tuple[Command, ...] | None:
        # a gated script as carry says, the form's own removal as own_with_writes
        return carry_writes(commands, writes, keys, self.own_with_writes, self.carry)

    def own_with_writes(self, commands: Sequence[Command], i: int, writes: Sequence[Arg],
                        keys: Sequence[Any]) -> tuple[Command, int] | None:
        """The form's own command ``commands[i]`` (not a script: a plain
        removal) as the step carrying ``writes`` (encoded; their ``keys``), and
        how many commands from ``i`` that step stands for (:data:`OwnCarry`);
        None: it carries none."""
        raise NotImplementedError
