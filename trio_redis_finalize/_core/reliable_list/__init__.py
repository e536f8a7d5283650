"""trio_redis_finalize._core.reliable_list."""
