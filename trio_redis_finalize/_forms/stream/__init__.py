"""trio_redis_finalize._forms.stream."""
