"""Exceptions of the finalization layer."""

from __future__ import annotations

__all__ = ["AckError", "AckUnsupported"]


class AckError(Exception):
    """A delivery could not be finalized as asked."""


class AckUnsupported(AckError):
    """The subscription's form cannot carry out this outcome.

    Simple lists and Pub/Sub have nothing to acknowledge: ACK, RETRY and DROP
    are refused there (``retry_after`` works through a runtime copy).  A
    pattern subscription without ``retry_channel`` refuses ``retry_after``.
    """
