"""``trio-redis-finalize run MODULE:FACTORY --workers N``: N worker processes of
one factory, under a supervisor.

* **Names**: worker slot ``k`` (1 to N) runs as consumer ``<base>-<k>``, where
  ``<base>`` is ``--name`` when given, else the host name
  (``socket.gethostname()``): the same names on every start, so a worker
  started again (by this supervisor after a crash, or after a deploy) re-reads
  its own pending work at once -- a stream's own PEL, a reliable list's
  processing list ``{queue}:processing:<base>-<k>`` -- instead of waiting for
  another consumer to take it over once its heartbeat lapsed.  Two
  supervisors on one host need distinct ``--name``.
* **Each worker** is ``trio-redis-finalize run MODULE:FACTORY --name
  <base>-<k>`` with the supervisor's other options (``--metrics-port P``:
  worker ``k`` serves ``P + k - 1``), in a session of its own (a terminal's
  Ctrl-C reaches the supervisor only, which forwards it once), with
  ``TRF_WORKER_SLOT=k`` and ``TRF_WORKERS=N`` in its environment.
* **A worker that dies** (any exit the supervisor did not ask for: a crash,
  SIGKILL, the OOM killer) is started again under its name at once (when it
  dies again within ``QUICK_DEATH`` s of its start: after ``RESTART_QUICK`` s,
  doubling up to ``RESTART_MAX``); the death is logged with its exit
  status.  One that exits with status 2 (bad input: the factory cannot
  be imported, mounts nothing ...) is not: every worker is stopped, and the
  supervisor exits 2.
* **SIGTERM or SIGINT** to the supervisor: one SIGTERM to each worker (each
  stops gracefully: its handlers finish within ``--shutdown-grace``, and what
  it read and did not finish is handed back to the group at once); a second
  signal: SIGKILL to each.  The supervisor exits once every worker has.

Exit status: 0 when every worker ran until the stop and stopped cleanly; 1
when a worker died (and was restarted) or ended its stop with a non-zero
status; 2 bad input (as ``run``); 128 + signal after a second signal.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence

import anyio

__all__ = ["QUICK_DEATH", "RESTART_MAX", "RESTART_QUICK", "supervise", "worker_names"]

log = logging.getLogger("trio_redis_finalize.workers")

QUICK_DEATH = 2.0
"""Seconds: a worker that dies sooner after its start is started again after a backoff."""
RESTART_QUICK = 0.5
"""Seconds before the first restart of a worker that died quickly (doubled each time)."""
RESTART_MAX = 10.0
"""Seconds: the longest wait before a restart."""
BAD_INPUT = 2
"""A worker's exit status for bad input (``run``'s): not restarted."""
RESTART_OPTIONS: tuple[str, ...] = ("--takeover",)
"""Options a worker started again after it died gets on top of its own: the
supervisor reaped the previous process, so it knows that the heartbeat its
name still has in Redis (up to ``heartbeat`` s after a SIGKILL) is a dead
one's: the slot takes its name over (``run --takeover``) and mounts at once,
where the refusal of a live duplicate name would wait for the lapse (a holder
on this host that no longer runs is known gone without it; one in another pid
namespace is not)."""


def worker_names(base: str | None, n: int) -> list[str]:
    """The consumer names of slots 1 to ``n``: ``<base>-<k>`` (``base``: the host name by default)."""
    stem = base if base else socket.gethostname()
    return [f"{stem}-{k}" for k in range(1, n + 1)]


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclasses.dataclass
class _Slot:
    index: int
    name: str
    argv: list[str]
    proc: anyio.abc.Process | None = None
    signalled: bool = False
    restarts: int = 0
    quick: int = 0  # deaths in a row within QUICK_DEATH of the start


class _Supervisor:
    def __init__(self, slots: list[_Slot]) -> None:
        self.slots = slots
        self.stopping = False
        self.failed = False
        self.bad_input = False
        self.signal_code: int | None = None

    def _send(self, slot: _Slot, sig: signal.Signals) -> None:
        proc = slot.proc
        if proc is not None and proc.returncode is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:  # pragma: no cover - ended meanwhile
                pass

    def stop(self) -> None:
        """One SIGTERM to each worker (once)."""
        self.stopping = True
        for slot in self.slots:
            if not slot.signalled:
                slot.signalled = True
                self._send(slot, signal.SIGTERM)

    async def watch(self, signals: AsyncIterator[signal.Signals]) -> None:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                log.warning("%s: stopping %d workers gracefully (SIGTERM to each; send it again "
                            "to kill them)", name, len(self.slots))
                self.stop()
            else:
                log.warning("%s again: killing the workers", name)
                self.signal_code = 128 + int(signum)
                for slot in self.slots:
                    self._send(slot, signal.SIGKILL)

    async def run_slot(self, slot: _Slot) -> None:
        delay = RESTART_QUICK
        env = {**os.environ, "TRF_WORKER_SLOT": str(slot.index), "TRF_WORKERS": str(len(self.slots))}
        while not self.stopping:
            started = anyio.current_time()
            argv = [*slot.argv, *RESTART_OPTIONS] if slot.restarts else slot.argv
            proc = slot.proc = await anyio.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env,
                start_new_session=True)
            log.info("worker %d started: pid %d, consumer name %r", slot.index, proc.pid, slot.name)
            if self.stopping:  # a signal came while it was starting
                slot.signalled = True
                self._send(slot, signal.SIGTERM)
            code = await proc.wait()
            if self.stopping and slot.signalled:
                if code != 0:
                    self.failed = True
                    log.warning("worker %d (pid %d, %r) ended its stop with %s", slot.index,
                                proc.pid, slot.name, _status(code))
                else:
                    log.info("worker %d (pid %d, %r) stopped", slot.index, proc.pid, slot.name)
                return
            self.failed = True
            if code == BAD_INPUT:
                log.error("worker %d (pid %d, %r) exited with status 2 (bad input: see its "
                          "error above); stopping every worker", slot.index, proc.pid, slot.name)
                self.bad_input = True
                self.stop()
                return
            slot.restarts += 1
            quick = anyio.current_time() - started < QUICK_DEATH
            slot.quick = slot.quick + 1 if quick else 0
            wait = delay if slot.quick > 1 else 0.0  # the first restart at once
            delay = min(delay * 2, RESTART_MAX) if slot.quick > 1 else RESTART_QUICK
            log.warning("worker %d (pid %d, %r) died (%s); starting it again under its name%s: "
                        "it re-reads its own pending work at once", slot.index, proc.pid,
                        slot.name, _status(code), f" in {wait:g} s" if wait else "")
            if wait:
                with anyio.move_on_after(wait):
                    while not self.stopping:
                        await anyio.sleep(0.05)
        slot.proc = None

    def exit_code(self) -> int:
        if self.signal_code is not None:
            return self.signal_code
        if self.bad_input:
            return BAD_INPUT
        return 1 if self.failed else 0


async def supervise(argvs: Sequence[list[str]], names: Sequence[str]) -> int:
    """Run one worker per ``argvs`` (slot ``k`` named ``names[k - 1]``) until a
    signal stops them (see the module docstring); the exit status."""
    sup = _Supervisor([_Slot(k, name, list(argv))
                       for k, (argv, name) in enumerate(zip(argvs, names, strict=True), 1)])
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.watch, signals)
            async with anyio.create_task_group() as workers:
                for slot in sup.slots:
                    workers.start_soon(sup.run_slot, slot)
            tg.cancel_scope.cancel()
    code = sup.exit_code()
    log.info("every worker stopped; exit status %d", code)
    return code


def worker_argv(spec: str, name: str, options: Sequence[str]) -> list[str]:
    """One worker's command line: ``run`` of ``spec`` named ``name``, with ``options``."""
    return [sys.executable, "-m", "trio_redis_finalize", "run", spec, "--name", name, *options]
