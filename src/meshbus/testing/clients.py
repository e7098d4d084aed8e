"""Real connectors -- the client of ``meshbus.connect`` -- linked to in-process brokers over
the fake network."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from meshbus.client.connector import Connector, ConnectorParts
from meshbus.client.dial import Dialer
from meshbus.client.link import BrokerLink
from meshbus.client.reliable import ReliableConfig
from meshbus.protocol.layout import DEFAULT_MAX_FRAME
from meshbus.testing.network import FakeNetwork


def client_dialer(network: FakeNetwork, origin: str) -> Dialer:
    """A client ``Dialer`` (meshbus.client.dial) whose wires ``network`` labels
    ``origin`` (``wire_between(origin, broker)``). A refused connection is the
    ``ConnectionRefusedError`` a socket would raise."""

    async def dial(host: str, port: int, new_link: Callable[[], BrokerLink]) -> BrokerLink:
        link = new_link()
        network.connect(origin, f"{host}:{port}", link)
        return link

    return dial


async def connect_over(
    network: FakeNetwork,
    brokers: str | Sequence[str],
    name: str,
    *,
    failover_timeout: float = 10.0,
    keepalive: float = 1.0,
    reliable: ReliableConfig | None = None,
    request_timeout: float = 30.0,
    max_inbox: int = 65536,
    timeout: float = 5.0,
    rng: random.Random | None = None,
) -> Connector:
    """A connector named ``name`` linked to the first of ``brokers`` (addresses such as
    ``address_of("a")``) that takes it, as ``meshbus.connect`` would link it.

    ``name`` is also its server name (so its addresses read ``name:ID``, at most 11
    bytes) and the label of its wires on ``network``. The options are
    ``meshbus.connect``'s; its random choices come from ``rng``, by default one seeded
    with ``name``, so a test takes the same course every run."""
    parts = ConnectorParts(
        server=name,
        name=name,
        brokers=[brokers] if isinstance(brokers, str) else list(brokers),
        max_frame=DEFAULT_MAX_FRAME,
        max_inbox=max_inbox,
        failover_timeout=failover_timeout,
        keepalive=keepalive,
        operator=False,
        reliable=reliable or ReliableConfig(),
        request_timeout=request_timeout,
        credentials=None,
        dialer=client_dialer(network, name),
        rng=rng or random.Random(name),
    )
    await parts.start(timeout)
    return Connector(parts)
