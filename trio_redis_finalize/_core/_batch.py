"""A finalizer batch's first round: commands, their owners, the steps left.

Sans-IO: the finalizer (``_finalizer``) sends what this decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._commands import Command
from ._plan import Effect, Plan

__all__ = ["FAST_ONLY", "first_round", "merge_commands"]


FAST_ONLY = (-1,)
"""Owner of a command that removes the hot path's deliveries (no plan)."""


def first_round(
    fast: Sequence[Command], plans: Sequence[Plan]
) -> tuple[list[Command], list[tuple[int, ...]], list[list[Command]]]:
    """The first pipeline of a batch: commands, their owners, the steps left.

    ``owners[i]``: the indexes of the plans that command ``i`` serves (``-1``:
    the hot path's removals ``fast``).  Single-``XACK`` commands merge per
    stream and group, as :func:`merge_commands` does.  A plan that is not
    gated and has several steps (a cross-slot copy, then the removal of the
    original) sends only its first step; ``rest[j]`` holds the others, each
    sent once the one before it succeeded: a removal never follows a copy
    that failed or whose outcome is unknown.
    """
    out: list[Any] = []
    owners: list[list[int]] = []
    rest: list[list[Command]] = [[] for _ in plans]
    xacks: dict[tuple[Any, Any], int] = {}

    def add(cmds: Sequence[Command], j: int) -> None:
        if len(cmds) == 1 and cmds[0][0] == "XACK":
            c = cmds[0]
            key = (c[1], c[2])
            at = xacks.get(key)
            if at is None:
                xacks[key] = len(out)
                out.append(["XACK", c[1], c[2], *c[3:]])
                owners.append([j])
            else:
                out[at].extend(c[3:])
                if j not in owners[at]:
                    owners[at].append(j)
            return
        for c in cmds:
            out.append(c)
            owners.append([j])

    if len(fast) == 1:
        add(fast, -1)
    else:
        for c in fast:
            add((c,), -1)
    for j, p in enumerate(plans):
        cmds = p.commands
        if len(cmds) == 1 and cmds[0][0] != "XACK":  # one script (the common case), inline
            out.append(cmds[0])
            owners.append([j])
            continue
        if not p.gated and len(cmds) > 1:
            rest[j] = list(cmds[1:])
            cmds = cmds[:1]
        add(cmds, j)
    commands: list[Command] = [tuple(c) if isinstance(c, list) else c for c in out]
    return commands, [tuple(o) for o in owners], rest




def merge_commands(groups: Sequence[Sequence[Command]]) -> list[Command]:
    """Concatenate plans' commands, merging single-XACK plans per stream and group.

    What :func:`first_round` sends for gated plans of these commands (a plan
    of one ``XACK`` needs no order with other plans, so all of them become
    one ``XACK key group id id ...`` at the place of the first; multi-command
    plans keep their own order).
    """
    commands, _, _ = first_round((), [Plan(Effect.NOTHING, tuple(g)) for g in groups])
    return commands
