"""Benchmarks for trio_redis_finalize (``python3 dev.py bench`` or ``python -m benchmarks``).

Every module here other than the private ones (``_common`` and friends) has a
``main()`` that starts its own redis-server and prints a table.
"""
