"""The deadlines every part of the runtime shares, each defined once, and
the few helpers every part uses: the library's logger :data:`log`, the
jittered :func:`backoff`, :func:`sole` (the one exception inside nested
groups).

Below everything but the core: readers, the mount, the finalizer and the
scheduler import it, it imports none of them.  What a reader is given and
what it gives (``Context``, ``Steps``, ``Pending``, ``Reader``) is the port,
``_forms/_port.py``.
"""

from __future__ import annotations

import logging
import random

__all__ = ["FINALIZE_TIMEOUT", "OWN_LOOK_EVERY", "READ_MARGIN", "SETUP_PATIENCE", "backoff", "log",
           "sole"]

log = logging.getLogger("trio_redis_finalize")

FINALIZE_TIMEOUT = 5.0
"""Seconds one finalization round trip (or any other non-blocking command of
the runtime) may take before it counts as failed."""
SETUP_PATIENCE = 15.0
"""Seconds ``mount()`` keeps trying a set-up the server refused for now (OOM, BUSY, LOADING ...)."""
READ_MARGIN = 1.0
"""Seconds a blocking read may exceed its ``block`` before it counts as lost."""
OWN_LOOK_EVERY = 60.0
"""Seconds between two looks of a consumer at what it holds in Redis, whatever
the traffic: a stream's own PEL, a reliable list's processing list.  What is
pending there and not held in memory (left without a timer, stranded by a
lost reply) is delivered again within this bound, not at the next restart."""


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0) -> float:
    """Capped exponential backoff with full jitter."""
    return float(random.uniform(0, min(cap, base * 2 ** min(attempt, 16))))


def sole(exc: BaseException) -> BaseException:
    """The one exception inside nested one-member groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
