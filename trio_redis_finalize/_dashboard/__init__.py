"""The web dashboard (private; the public entry is :mod:`trio_redis_finalize.dashboard`)."""
