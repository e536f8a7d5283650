"""trio_redis_finalize: consume Redis from structured concurrency, and finalize
every delivery with the commands proper to its form and outcome.

Streams (consumer groups: plain, reclaim, claiming), reliable lists, simple
lists and Pub/Sub channels and patterns; handlers return ``ACK``, ``RETRY``,
``DROP``, ``retry_after(delay)`` or ``reject(reason)``; a handler that raises backs off
(:class:`Backoff`: the delivery stays pending and comes back later).  Copies
are written before originals are removed: a crash leaves a duplicate, never
a loss.
"""

from ._consumer import Consumer as Consumer
from ._consumer import Mounted as Mounted
from ._consumer import open_consumer as open_consumer
from ._delivery import Delivery as Delivery
from ._envelope import GROUP_FIELD as GROUP_FIELD
from ._envelope import ORIGIN_FIELD as ORIGIN_FIELD
from ._envelope import RETRIES_FIELD as RETRIES_FIELD
from ._errors import AckError as AckError
from ._errors import AckUnsupported as AckUnsupported
from ._errors import ConsumerNameInUse as ConsumerNameInUse
from ._forms.pubsub import ChannelSubscription as ChannelSubscription
from ._forms.pubsub import PatternSubscription as PatternSubscription
from ._forms.reliable_list import ReliableListSubscription as ReliableListSubscription
from ._forms.simple_list import ListSubscription as ListSubscription
from ._forms.stream import StreamSubscription as StreamSubscription
from ._outcome import ACK as ACK
from ._outcome import DROP as DROP
from ._outcome import REJECT as REJECT
from ._outcome import RETRY as RETRY
from ._outcome import Backoff as Backoff
from ._outcome import Outcome as Outcome
from ._outcome import Rejected as Rejected
from ._outcome import reject as reject
from ._outcome import retry_after as retry_after
from ._publisher import Publisher as Publisher
from ._publisher import open_publisher as open_publisher
from ._subscription import DelayedRetry as DelayedRetry
from ._subscription import Mode as Mode
from ._subscription import Retention as Retention
from ._transport import Client as Client
from ._transport import ConnectionParams as ConnectionParams
from ._transport import open_client as open_client
from ._transport import sentinel_params as sentinel_params
from ._version import __version__ as __version__

__all__ = [
    "ACK",
    "DROP",
    "GROUP_FIELD",
    "ORIGIN_FIELD",
    "REJECT",
    "RETRIES_FIELD",
    "RETRY",
    "AckError",
    "AckUnsupported",
    "Backoff",
    "ChannelSubscription",
    "Client",
    "ConnectionParams",
    "Consumer",
    "ConsumerNameInUse",
    "DelayedRetry",
    "Delivery",
    "ListSubscription",
    "Mode",
    "Mounted",
    "Outcome",
    "PatternSubscription",
    "Publisher",
    "Rejected",
    "ReliableListSubscription",
    "Retention",
    "StreamSubscription",
    "open_client",
    "open_consumer",
    "open_publisher",
    "reject",
    "retry_after",
    "sentinel_params",
]


def _fixup_module_metadata() -> None:
    """Public objects show ``trio_redis_finalize`` as their module (tracebacks,
    reprs, pickling and the docs name ``trio_redis_finalize.X``, not the
    private module that defines it), as trio does."""
    namespace = globals()
    for name in __all__:
        obj = namespace[name]
        if (isinstance(obj, type) or callable(obj)) and getattr(obj, "__module__", "").startswith(
                f"{__name__}."):
            obj.__module__ = __name__


_fixup_module_metadata()
