"""Every test is bounded by pytest-timeout (see pyproject); fixtures come from
the package's own pytest plugin (``trio_redis_finalize.pytest_plugin``)."""
