"""Opening a link to another broker: plain TCP, or TLS checked for the host dialled.

The ``Dialer`` is injected (``Broker(dialer=...)``): tests run brokers on a fake
network that dials without sockets.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

from meshbus.broker.core.link import Link

# Opens a TCP link to HOST:PORT for the link the factory makes: (host, port, factory).
Dialer = Callable[[str, int, Callable[[], Link]], Awaitable[Link]]


async def dial_tcp(
    host: str, port: int, new_link: Callable[[], Link], *, tls: ssl.SSLContext | None = None
) -> Link:
    """With ``tls`` (meshbus.tls.dial_context) the link is TLS, and the peer's certificate
    must be good for ``host``, the host dialled."""
    _, link = await asyncio.get_running_loop().create_connection(
        new_link, host, port, ssl=tls, server_hostname=host if tls is not None else None
    )
    return link
