"""The package's own thin Redis transport (private).

anyio byte streams, ``hiredis`` for packing commands and parsing replies,
redis-py's exception classes.  One request in flight per connection; a
connection interrupted mid-request is closed, never reused; no automatic
retries.  See ``_client.Client`` for the interface the consumer uses.
"""

from ._client import Client, Script, open_client
from ._connection import (
    Arg,
    BusyGroupError,
    Command,
    Connection,
    NoGroupError,
    WrongTypeError,
    describe,
    open_connection,
    pack_command,
    with_context,
)
from ._pubsub import Message, PubSub
from ._url import ConnectionParams, parse_url

__all__ = [
    "Arg",
    "BusyGroupError",
    "Client",
    "Command",
    "Connection",
    "ConnectionParams",
    "Message",
    "NoGroupError",
    "PubSub",
    "Script",
    "WrongTypeError",
    "describe",
    "open_client",
    "open_connection",
    "pack_command",
    "parse_url",
    "with_context",
]
