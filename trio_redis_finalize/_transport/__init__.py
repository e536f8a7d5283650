"""The package's own thin Redis transport (private).

anyio byte streams, ``hiredis`` for packing commands and parsing replies,
redis-py's exception classes.  One request in flight per connection; a
connection interrupted mid-request is closed, never reused; no automatic
retries.  See ``_client.Client`` for the interface the consumer uses, and
``_cluster.ClusterClient`` for the same interface on Redis Cluster,
``_sentinel.SentinelClient`` for a master found through Redis Sentinel.
"""

from .._core._commands import Arg, Command, command_keys, describe
from .._core._replies import (
    FINAL,
    NOT_RUN,
    NOT_RUN_CODES,
    NOT_RUN_ERRORS,
    UNKNOWN,
    BusyGroupError,
    ErrorKind,
    NoGroupError,
    NotRunError,
    WrongTypeError,
    classify,
    error_code,
    with_context,
)
from ._client import Client, Script
from ._cluster import ClusterClient, RoutedConnection
from ._connection import DEFAULT_TIMEOUT, Connection, open_connection, pack_command
from ._open import open_client
from ._pubsub import Message, PubSub
from ._sentinel import SentinelClient
from ._slots import slot_of
from ._url import ConnectionParams, parse_url, sentinel_params

__all__ = [
    "DEFAULT_TIMEOUT",
    "FINAL",
    "NOT_RUN",
    "NOT_RUN_CODES",
    "NOT_RUN_ERRORS",
    "UNKNOWN",
    "Arg",
    "BusyGroupError",
    "Client",
    "ClusterClient",
    "Command",
    "Connection",
    "ConnectionParams",
    "ErrorKind",
    "Message",
    "NoGroupError",
    "NotRunError",
    "PubSub",
    "RoutedConnection",
    "Script",
    "SentinelClient",
    "WrongTypeError",
    "classify",
    "command_keys",
    "describe",
    "error_code",
    "open_client",
    "open_connection",
    "pack_command",
    "parse_url",
    "sentinel_params",
    "slot_of",
    "with_context",
]
