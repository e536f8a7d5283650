"""Simple lists: ``ListSubscription`` (BRPOP; nothing to acknowledge)."""

from __future__ import annotations

import dataclasses

from ._plan import Target
from ._subscription import Form, Subscription, check_key, check_limits, check_positive

__all__ = ["ListSubscription"]


@dataclasses.dataclass(frozen=True, slots=True)
class ListSubscription(Subscription):
    """Pop elements with BRPOP.  At-most-once: a crash during a handler loses
    the element.  ACK/RETRY/DROP are refused (:class:`AckUnsupported`);
    ``retry_after`` LPUSHes a copy back after the delay.
    """

    key: str
    block: float = 1.0
    max_attempts: int | None = None

    form = Form.LIST

    def __post_init__(self) -> None:
        check_key("key", self.key)
        check_positive("block", self.block)
        check_limits(self.max_attempts, None)

    @property
    def name(self) -> str:
        return f"list {self.key!r}"

    def target(self, consumer: str, *, cluster: bool = False) -> Target:
        return Target(form=Form.LIST, name=self.name, source=self.key,
                      max_attempts=self.max_attempts, cluster=cluster)
