"""Opening the connection of a connector's link to a broker: plain TCP, or TLS checked for
the host dialled.

The ``Dialer`` is injected (``ConnectorParts(dialer=...)``), as the broker's is
(meshbus.broker.mesh.dialer): ``meshbus.connect`` dials with ``dial_tcp``, and tests
link a real connector to in-process brokers over a fake network
(``meshbus.testing.connect_over``). A dialer raises ``OSError`` when it cannot connect
(``ssl.SSLError`` when the TLS handshake fails, ``socket.gaierror`` when the host
does not resolve). The caller (meshbus.client.failover) puts each in words, whatever
the dialer, and bounds the time: a dial by ``connect``'s ``timeout`` or what is left
of ``failover_timeout``, the broker's answer to HELLO by ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

from meshbus.client.link import BrokerLink

# Opens a connection to HOST:PORT for the link the factory makes: (host, port, factory).
Dialer = Callable[[str, int, Callable[[], BrokerLink]], Awaitable[BrokerLink]]


async def dial_tcp(
    host: str, port: int, new_link: Callable[[], BrokerLink], *, tls: ssl.SSLContext | None = None
) -> BrokerLink:
    """With ``tls`` (meshbus.tls.client_context) the link is TLS, and the broker's
    certificate must be good for ``host``, the host dialled."""
    _, link = await asyncio.get_running_loop().create_connection(
        new_link, host, port, ssl=tls, server_hostname=host if tls is not None else None
    )
    return link
