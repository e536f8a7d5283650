"""Replies of reads turned into deliveries (sans-IO).

:func:`list_delivery` opens the envelope of a list element or a Pub/Sub
payload; a corrupt one, or one already past ``max_attempts``, comes with
the plan that finalizes it without a handler (its dead letter).
"""

from __future__ import annotations

import logging

from .._delivery import Delivery
from .._envelope import MAGIC, CorruptEnvelope, unwrap
from ._plan import Plan, Target, attempt_of, content_origin, plan_dead

__all__ = ["list_delivery", "open_envelope"]

log = logging.getLogger("trio_redis_finalize")

_MAGIC_HEAD = MAGIC[:1]


def open_envelope(raw: bytes) -> tuple[bytes, int, str, str | None]:
    """``(body, retries, origin id, corrupt reason)`` of a list element or payload.

    A foreign payload (no envelope) is ``(raw, 0, content_origin(raw), None)``;
    a corrupt envelope is ``(raw, 0, content_origin(raw), reason)``.
    """
    try:
        body, retries, origin = unwrap(raw)
    except CorruptEnvelope as e:
        return raw, 0, content_origin(raw), f"corrupt envelope: {e}"
    return body, retries, origin if origin is not None else content_origin(raw), None


def list_delivery(target: Target, source: str, raw: bytes) -> tuple[Delivery, Plan | None]:
    """The delivery of ``raw``, and the plan that finalizes it without a handler
    (corrupt envelope, or already past ``max_attempts``), if any."""
    if raw[:1] == _MAGIC_HEAD:
        body, retries, origin, corrupt = open_envelope(raw)
    else:  # cannot be an envelope: a foreign element
        body, retries, origin, corrupt = raw, 0, content_origin(raw), None
    attempt = attempt_of(retries)
    d = Delivery(
        source=source, id=None, fields={}, data=body, attempt=attempt, origin_id=origin,
        raw=raw, retries=retries, mount=target.name, corrupt=corrupt,
    )
    if corrupt is not None:
        what = "dead-lettered" if target.dead_letter is not None else "dropped"
        log.error("%s: %s in a %d-byte element from %r (origin %s); %s",
                  target.name, corrupt, len(raw), source, origin, what)
        return d, plan_dead(target, d, corrupt)
    limit = target.max_attempts
    if limit is not None and attempt > limit:
        return d, plan_dead(
            target, d, f"arrived at attempt {attempt}, past max_attempts={limit}"
        )
    return d, None
