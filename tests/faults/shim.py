"""The crash-point enumeration's fault-injecting client: the package's own
(:mod:`trio_redis_finalize._fault_client`, which ``testing.check_exactly_once``
uses too), re-exported for the tests."""

from trio_redis_finalize._fault_client import (
    Crash,
    FaultClient,
    FaultMode,
    is_finalization,
    open_fault_client,
)

__all__ = ["Crash", "FaultClient", "FaultMode", "is_finalization", "open_fault_client"]
