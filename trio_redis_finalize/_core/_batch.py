"""A finalizer batch's first round: commands, their owners, the steps left.

Sans-IO: the finalizer (``_finalizer``) sends what this decides.  Which
gated scripts can share a batched call, and how that call is built and read
back, each form's cells say (``Cells.batchers``, ``Cells.batched``: the
stream's RETRY copies, dead letters, durable delays and ACKs carrying writes,
the reliable list's removals carrying writes); this module only groups them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _lua
from ._commands import Arg, Command
from ._plan import BATCHED as _BATCHED_BY_SHA
from ._plan import BATCHERS, counted_removals, gate_range, with_counts
from ._types import Batcher, Effect, Plan

__all__ = [
    "BATCHED", "COPIED", "batch_part", "batch_replies", "batch_singles",
    "counted_removals", "fast_index", "fast_owner",
    "first_round", "gate_range", "is_batched", "merge_commands", "with_counts",
]


def fast_owner(i: int) -> int:
    """The owner of the hot path's command ``i`` (no plan): ``-(i + 1)``,
    negative where a plan's index is not."""
    return -(i + 1)


def fast_index(owner: int) -> int:
    """The hot path's command that ``owner`` (< 0, :func:`fast_owner`) stands for."""
    return -owner - 1


BATCHED = frozenset(_BATCHED_BY_SHA)
"""The shas of the batched scripts: :func:`batch_replies` reads their reply
as one element per owner."""


COPIED = 1
"""The element :func:`batch_replies` gives a delivery of a batched call that
its reply did not list: copied (or added to the delay set), its original
removed (the single script answers the new id or the due time; no
settlement reads it)."""


def batch_replies(reply: object, n: int) -> list[Any] | None:
    """The elements of a batched call's ``reply``, one per delivery in order
    (what each delivery's single script would have answered), or None when
    ``reply`` is not a reply of ``n`` deliveries.

    The batched scripts answer ``[n, at, element, ...]``: only the
    deliveries not finalized, by place (1-based), a closed gate's nil or an
    error; the others get :data:`COPIED`.
    """
    if reply.__class__ is not list:
        return None
    if not reply or reply[0] != n or len(reply) % 2 != 1:
        return None
    out: list[Any] = [COPIED] * n
    for k in range(1, len(reply), 2):
        at = reply[k]
        if at.__class__ is not int or not 0 < at <= n:
            return None
        out[at - 1] = reply[k + 1]
    return out


def is_batched(cmd: Command) -> bool:
    """True for a batched script call (its reply: see :func:`batch_replies`)."""
    return cmd[0] == b"EVALSHA" and cmd[1] in BATCHED


def batch_singles(cmd: Command) -> list[Command]:
    """The single-script commands a batched call ``cmd`` carries, in the order
    of its reply's elements (what each delivery's plan would send alone)."""
    batcher = _BATCHED_BY_SHA.get(cmd[1])
    if batcher is None:
        raise ValueError(f"not a batched script call: {cmd[:2]!r}")
    return batcher.singles(cmd)


def batch_part(cmd: Command) -> tuple[tuple[Arg, ...], tuple[Arg, ...]] | None:
    """``(key, part)`` of a gated script that a batched call can carry, else
    None (``Batcher.part``).

    ``key``: what the deliveries of one batched call share -- the batched
    script, its keys (stream; destination stream or delay set) and its fixed
    arguments (group, delete, cap); ``part``: this delivery's arguments in
    the batched call (see ``stream.scripts.STREAM_COPY_ACK_BATCH`` /
    ``STREAM_ZADD_ACK_BATCH``).
    """
    if cmd[0] != b"EVALSHA":
        return None
    batcher = BATCHERS.get(cmd[1])
    return None if batcher is None else batcher.part(cmd)


def first_round(
    fast: Sequence[Command], plans: Sequence[Plan]
) -> tuple[list[Command], list[tuple[int, ...]], list[list[Command]]]:
    """The first pipeline of a batch: commands, their owners, the steps left.

    ``owners[i]``: the indexes of the plans that command ``i`` serves
    (negative: the hot path's removal command ``fast[k]``, see
    :func:`fast_owner`), each sent as it is.  Plans' single-``XACK``
    commands merge per stream and group, as :func:`merge_commands` does,
    never into a hot-path removal: its own reply settles it (a short
    ``XACK`` count is ``gate_closed``).  Plans of one gated
    script that share its keys and fixed arguments (RETRY copies,
    dead letters, durable delays of one subscription; ACKs and DROPs carrying
    writes, a stream's or a reliable list's, whose calls declare every
    delivery's write keys) go in batched script
    calls (:func:`batch_part`), at most ``STREAM_BATCH_MAX`` deliveries and
    about ``STREAM_BATCH_VALUES`` values each, at the place of their first
    plan; the owners of a batched call are its deliveries' plans, in the
    order of its reply's elements; a call that would carry one delivery is
    that plan's own command.  A plan that is not
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

    for i, c in enumerate(fast):
        # the hot path's removals go as they are, never merged with a plan's
        # XACK: their own reply is what settles them (a short XACK is gate_closed)
        out.append(c)
        owners.append([fast_owner(i)])
    # batched calls being filled: key -> [place in out, plans, their single
    # commands, arguments, values, the batcher of the first]
    batches: dict[tuple[Arg, ...], list[Any]] = {}
    placed: list[list[Any]] = []
    cap = _lua.STREAM_BATCH_MAX
    room = _lua.STREAM_BATCH_VALUES
    batchers = BATCHERS
    for j, p in enumerate(plans):
        cmds = p.commands
        if len(cmds) == 1 and cmds[0][0] != "XACK":  # one script (the common case), inline
            c = cmds[0]
            batcher: Batcher | None
            if c[0] == b"EVALSHA" and p.gated and (batcher := batchers.get(c[1])) is not None:
                bp = batcher.part(c)
                if bp is not None:  # into the batched call of its key
                    key, part = bp
                    b = batches.get(key)
                    size = len(part)
                    if b is None or len(b[1]) >= cap or b[4] + size > room:
                        b = batches[key] = [len(out), [], [], [], 0, batcher]
                        placed.append(b)
                        out.append(None)
                        owners.append([])
                    b[1].append(j)
                    b[2].append(c)
                    b[3] += part
                    b[4] += size
                    continue
            out.append(c)
            owners.append([j])
            continue
        if not p.gated and len(cmds) > 1:
            rest[j] = list(cmds[1:])
            cmds = cmds[:1]
        add(cmds, j)
    for at, members, singles, args, _, batcher in placed:
        owners[at] = members
        out[at] = singles[0] if len(members) == 1 else batcher.call(singles, args)
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
