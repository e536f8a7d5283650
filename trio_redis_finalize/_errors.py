"""Exceptions of the finalization layer."""

from __future__ import annotations

__all__ = ["AckError", "AckUnsupported", "ConsumerNameInUse"]


class AckError(Exception):
    """A delivery could not be finalized as asked."""


class AckUnsupported(AckError):
    """The subscription's form cannot carry out this outcome.

    Simple lists and Pub/Sub have nothing to acknowledge: ACK, RETRY and DROP
    are refused there (``retry_after`` works through a runtime copy).  A
    pattern subscription without ``retry_channel`` refuses ``retry_after``.
    """


class ConsumerNameInUse(RuntimeError):
    """Another live process holds the heartbeat of this consumer name.

    Two processes with one consumer name re-read one pending-entries list
    (or processing list) and handle each other's deliveries twice: the
    second is refused at mount.  Pass ``takeover=True`` (``open_consumer``
    or ``Consumer.mount``; ``run --takeover``) to take the name over
    deliberately.
    """
