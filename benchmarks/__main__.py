"""Run every benchmark module's ``main()`` in turn.

    python -m benchmarks                # all of them but the optional ones
    python -m benchmarks transport ...  # only these
    python -m benchmarks --peers        # all of them and ``peers``
    python -m benchmarks workloads 20000 --rounds 7   # options for the named module(s)

Arguments from the first one that starts with ``-`` or a digit on (other
than ``--peers``) are passed on to the ``main(argv)`` of every named module.

Modules are found by listing this directory: every ``*.py`` whose name does
not start with ``_`` (so ``__init__``, ``__main__`` and ``_common`` are skipped).
Optional modules run only when named: ``peers`` (it installs a third-party
package into a virtualenv of its own; also with ``--peers``),
``instructions`` (it counts instructions under valgrind, a few minutes) and
``catch_up`` (not a timing: the modules one stream catch-up passes through).
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

OPTIONAL = ("catch_up", "instructions", "peers")


def discover() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("*.py") if not p.stem.startswith("_"))


def main(argv: list[str]) -> int:
    names = discover()
    peers = "--peers" in argv
    argv = [a for a in argv if a != "--peers"]
    cut = next((i for i, a in enumerate(argv) if a[:1] == "-" or a[:1].isdigit()), len(argv))
    argv, options = argv[:cut], argv[cut:]
    wanted = argv or [n for n in names if n not in OPTIONAL]
    if peers and "peers" not in wanted:
        wanted.append("peers")
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"benchmarks: unknown module(s) {', '.join(unknown)}; have {', '.join(names)}", file=sys.stderr)
        return 2
    failed: list[str] = []
    for name in wanted:
        print(f"\n=== benchmarks.{name} ===", flush=True)
        start = time.perf_counter()
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            run = getattr(module, "main", None)
            if run is None:
                print(f"benchmarks.{name}: no main(), skipped")
                continue
            if options:
                run(options)
            else:
                run()
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"--- benchmarks.{name}: {time.perf_counter() - start:.1f} s", flush=True)
    if failed:
        print(f"\nbenchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
