"""trio_redis_finalize._core.stream."""
