"""The web dashboard: subscriptions' health, dead-letter triage, the last hour.

Needs the ``dashboard`` extra (``pip install 'trio_redis_finalize[dashboard]'``:
Starlette and Hypercorn).  Three ways to run it:

* ``trio-redis-finalize dashboard --url URL`` (the command line);
* :func:`serve` in a consumer's nursery (beside ``prometheus.serve``)::

      async with open_consumer(url) as consumer, trio.open_nursery() as nursery:
          await consumer.mount(...)
          port = await nursery.start(dashboard.serve, url)

* :func:`app`, an ASGI application to mount in your own (Starlette, FastAPI ...)::

      Mount("/queues", app=dashboard.app(url, basic_auth=("ops", secret)))

It is read-only unless a ``token`` or ``basic_auth`` is given (and
``read_only`` is not set); every action is a POST checked against
cross-site requests (a CSRF token, ``Sec-Fetch-Site`` and ``Origin``),
shown first as a dry run to confirm, and logged (logger
``trio_redis_finalize.dashboard``: who, what, how many).  See the docs'
dashboard page for the pages and the commands each refresh sends.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import anyio
import sniffio
from anyio.abc import TaskStatus

try:
    import hypercorn  # noqa: F401
    import starlette  # noqa: F401
except ImportError as _e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "trio_redis_finalize.dashboard needs the dashboard extra: "
        "pip install '.[dashboard]' in a checkout of trio_redis_finalize (its [dashboard] extra)"
    ) from _e

from hypercorn.config import Config

from ._dashboard._app import Settings, build

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from ._transport import Client

__all__ = ["app", "serve"]

STOP_TIMEOUT = 5.0
"""Seconds :func:`serve` gives open requests to finish once cancelled."""


def app(url_or_client: str | Client, *, token: str | None = None,
        basic_auth: tuple[str, str] | None = None, read_only: bool = False,
        keys: tuple[str, ...] | list[str] = (), refresh: float = 5.0,
        rediscover: float = 30.0, root_path: str = "") -> Starlette:
    """The dashboard as an ASGI application.

    Args:
        url_or_client: a Redis URL as ``open_consumer`` takes (``redis://``,
            ``rediss://``, ``unix://``, ``redis+sentinel://``,
            ``redis+cluster://``), or an open client (``open_client``) the
            dashboard then shares and does not close.
        token: enables actions for requests that send
            ``Authorization: Bearer <token>`` or logged in at ``/login``.
        basic_auth: ``(user, password)``: enables actions for requests with
            these HTTP basic credentials.  With either, every page needs them.
        read_only: refuse actions even with credentials.
        keys: show these streams and lists only (no ``SCAN``); default: the
            subscriptions ``SCAN`` finds.
        refresh: seconds between two refreshes of a page by its own script.
        rediscover: seconds between two ``SCAN`` s for subscriptions.
        root_path: the path it is mounted at (links are made under it).
    """
    settings = Settings(url_or_client, token=token, basic_auth=basic_auth, read_only=read_only,
                        keys=tuple(keys), refresh=refresh, rediscover=rediscover)
    return build(settings, root_path)


async def serve(url_or_client: str | Client, port: int = 8000, *, host: str = "127.0.0.1",
                task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED, **options: Any) -> None:
    """Serve :func:`app` with Hypercorn until cancelled, on trio or asyncio.

    Args:
        url_or_client: as :func:`app` takes it.
        port: the port to listen on (0: any free one).
        host: the address to listen on (default 127.0.0.1: this host only).
        task_status: ``started(port)`` once listening (the port bound).
        options: :func:`app`'s keyword arguments (``token``, ``basic_auth``,
            ``read_only``, ``keys``, ``refresh`` ...).

    Cancelled, it stops accepting, gives open requests ``STOP_TIMEOUT`` (5)
    seconds and returns.
    """
    application = app(url_or_client, **options)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
        config = Config()
        config.bind = [f"fd://{os.dup(sock.fileno())}"]  # Hypercorn closes the one it is given
        config.accesslog = None
        config.errorlog = None
        config.graceful_timeout = 1.0
        bound = int(sock.getsockname()[1])
        if sniffio.current_async_library() == "trio":
            from hypercorn.trio import serve as hserve
        else:
            from hypercorn.asyncio import serve as hserve  # type: ignore[assignment]
        stop = anyio.Event()
        shield = anyio.CancelScope(shield=True)

        async def server() -> None:
            # shielded: a cancellation stops it through its trigger (a clean lifespan
            # shutdown), within STOP_TIMEOUT
            with shield:
                await hserve(application, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]

        async with anyio.create_task_group() as tg:
            tg.start_soon(server)
            task_status.started(bound)
            try:
                await anyio.sleep_forever()
            finally:
                stop.set()
                shield.deadline = anyio.current_time() + STOP_TIMEOUT
    finally:
        sock.close()
