"""Run every benchmark module's ``main()`` in turn.

    python -m benchmarks                # all of them
    python -m benchmarks transport ...  # only these

Modules are found by listing this directory: every ``*.py`` whose name does
not start with ``_`` (so ``__init__``, ``__main__`` and ``_common`` are skipped).
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path


def discover() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("*.py") if not p.stem.startswith("_"))


def main(argv: list[str]) -> int:
    names = discover()
    wanted = argv or names
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
