"""The NATS listener (``--nats-listen``): NATS clients of any language on the broker's
own loop, speaking the NATS client protocol (meshbus.protocol.nats; docs/nats.md).

It accepts, greets each client with its INFO, bounds how many clients it holds
(``--max-connectors`` of them: past it, ``-ERR 'maximum connections exceeded'`` and
close, as nats-server does past its max_connections), and pings them every
``--nats-ping-interval``: a client silent through ``--nats-max-pings-out`` pings in a row
is closed with ``-ERR 'Stale Connection'``. The connections (meshbus.broker.nats.connection)
do the rest; the subject table is the broker's (meshbus.broker.core.subjects).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random

from meshbus.broker.config import BrokerConfig
from meshbus.broker.nats.connection import NatsCloseReason, NatsConnection
from meshbus.broker.nats.interest import NatsInterest
from meshbus.broker.nats.router import NatsRouter
from meshbus.errors import InvalidArgument
from meshbus.protocol.nats import NatsParser, ServerInfo, encode_info
from meshbus.util import BackgroundTasks, hostport_text, parse_hostport

__all__ = ["NATS_VERSION", "NatsListener"]

log = logging.getLogger("meshbus.broker.nats")

# The nats-server version whose client protocol this listener speaks: clients read
# INFO's version to know what the server does (headers since 2.2, no responders).
NATS_VERSION = "2.10.0"
_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


class NatsListener:
    """The listening socket for NATS clients, its connections and their ping timer."""

    def __init__(
        self,
        config: BrokerConfig,
        table: NatsInterest,
        router: NatsRouter,
        rng: random.Random,
    ) -> None:
        self._config = config
        self._table = table
        self._router = router
        self._flushes = router.flushes
        self.connections: dict[int, NatsConnection] = {}
        self._next_id = 0
        self._server: asyncio.Server | None = None
        self._tasks = BackgroundTasks()
        # Like nats-server's, an id of 56 characters of base32, new with each start.
        self.server_id = "N" + "".join(rng.choice(_ID_ALPHABET) for _ in range(55))
        self.address = ""
        self._bound = ("", 0)
        self._connect_urls: list[str] = []
        self.refused = 0

    async def start(self) -> None:
        """Listen on ``--nats-listen``; InvalidArgument when that address cannot be had."""
        config = self._config
        host, port = parse_hostport(config.nats_listen)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._new_connection, host, port, reuse_address=True, backlog=1024
            )
        except OSError as exc:
            raise InvalidArgument(
                f"cannot listen for NATS clients on {config.nats_listen}: "
                f"{exc.strerror or exc}; choose another --nats-listen HOST:PORT"
            ) from None
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self._bound = (bound_host, bound_port)
        self.address = hostport_text(bound_host, bound_port)
        # Where clients may reconnect: this broker, unless it listens on every address
        # (which one a client can reach is not known here). Other brokers' come with the
        # mesh (docs/nats.md, "Not yet").
        if not ipaddress.ip_address(bound_host).is_unspecified:
            self._connect_urls = [self.address]
        self._tasks.spawn(self._ping_timer(), "nats-pings")
        log.info("NATS listener ready", extra={"broker": config.name, "address": self.address})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._tasks.cancel()
        for conn in list(self.connections.values()):
            conn.close(NatsCloseReason.SERVER_SHUTDOWN, "broker shutting down")
        if self._server is not None:
            await self._server.wait_closed()

    def _new_connection(self) -> NatsConnection:
        config = self._config
        self._next_id += 1
        return NatsConnection(
            self._next_id,
            parser=NatsParser(
                max_control_line=config.nats_max_control_line,
                max_payload=config.nats_max_payload,
            ),
            table=self._table,
            router=self._router,
            flushes=self._flushes,
            info=self._info,
            max_pending=config.max_pending_bytes,
            max_subscriptions=config.max_services,
            on_open=self._opened,
            on_close=self._closed,
        )

    def _info(self, conn: NatsConnection) -> bytes:
        config = self._config
        host, port = self._bound
        info = ServerInfo(
            server_id=self.server_id,
            server_name=config.name,
            version=NATS_VERSION,
            host=host,
            port=port,
            max_payload=config.nats_max_payload,
            client_id=conn.client_id,
            client_ip=conn.host,
        )
        if self._connect_urls:
            info.connect_urls = self._connect_urls
        return encode_info(info)

    def _opened(self, conn: NatsConnection) -> None:
        limit = self._config.max_connectors
        if len(self.connections) >= limit:
            self.refused += 1
            conn.close(
                NatsCloseReason.MAX_CONNECTIONS,
                f"{limit} NATS clients are connected already (--max-connectors)",
                "maximum connections exceeded",
            )
            return
        self.connections[conn.client_id] = conn

    def _closed(self, conn: NatsConnection, reason: NatsCloseReason) -> None:
        self.connections.pop(conn.client_id, None)

    async def _ping_timer(self) -> None:
        interval = self._config.nats_ping_interval
        while True:
            await asyncio.sleep(interval)
            self.ping()

    def ping(self) -> None:
        """One tick of the ping timer: each client pinged, or found stale."""
        max_out = self._config.nats_max_pings_out
        for conn in list(self.connections.values()):
            conn.ping(max_out)
        self._flushes.flush()
