"""Benchmarks for trio_redis_finalize (``python3 dev.py bench`` or ``python -m benchmarks``).

Every module here other than the private ones (``_common`` and friends) has a
``main()`` that starts its own redis-server and prints a table.

``TRF_BENCH_LIB=/path/to/checkout`` measures another checkout of the library
with this harness: that path goes first on ``sys.path`` before anything
imports ``trio_redis_finalize`` (the raw floors use that checkout's transport
and scripts too).  Every table's header says which one was imported and its
git HEAD.
"""

from __future__ import annotations

import os
import sys

_LIB = os.environ.get("TRF_BENCH_LIB")
if _LIB:
    _path = os.path.abspath(os.path.expanduser(_LIB))
    if not os.path.isfile(os.path.join(_path, "trio_redis_finalize", "__init__.py")):
        raise SystemExit(f"TRF_BENCH_LIB={_LIB}: no trio_redis_finalize/__init__.py there")
    if "trio_redis_finalize" in sys.modules:
        raise SystemExit("TRF_BENCH_LIB: trio_redis_finalize was imported before benchmarks")
    sys.path.insert(0, _path)
    import trio_redis_finalize as _imported

    if not os.path.abspath(_imported.__file__ or "").startswith(_path + os.sep):
        raise SystemExit(f"TRF_BENCH_LIB={_LIB}, but {_imported.__file__} was imported")
