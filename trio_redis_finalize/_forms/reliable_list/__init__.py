"""trio_redis_finalize._forms.reliable_list."""
