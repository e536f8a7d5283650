"""One stream catch-up passes through at most six of the package's own
modules (issue #36): ``python -m benchmarks catch_up`` counts them on a real
server (own-PEL recovery, a RECLAIM claim, a dead consumer's take-over, the
hand-over; how it counts is its docstring).  Run in a child process from the
project's root (the ``benchmarks`` package is not installed)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from _paths import ROOT

pytestmark = pytest.mark.timeout(120)

# a bound, not an expectation: about a second on an idle machine
BOUND = 90

OWN = {"_forms/stream/reader", "_forms/stream/own_pel", "_forms/stream/liveness",
       "_core/stream/survey", "_core/stream/decode", "_hand_over"}
"""The six: the stream's five and the runtime's hand-over."""


def test_one_catch_up_enters_at_most_six_own_modules() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.catch_up"],
                          capture_output=True, text=True, timeout=BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    own: set[str] = set()
    group = ""
    for line in out.splitlines():
        if m := re.match(r"  (own|shared)\b.*\(\d+\):$", line):
            group = m.group(1)
        elif group == "own" and (m := re.match(r"    (\S+) +\d+ calls: ", line)):
            own.add(m.group(1))
    summary = re.search(r"modules: (\d+), own: (\d+) ", out)
    assert summary is not None, out
    assert int(summary.group(2)) == len(own) <= 6, out
    # each part of the catch-up ran: the walk is the one its docstring names
    assert own == OWN, out
    assert "took over 2 of its pending entries" in proc.stderr + out, out
