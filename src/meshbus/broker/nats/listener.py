"""The NATS listener (``--nats-listen``): NATS clients of any language on the broker's
own loop, speaking the NATS client protocol (meshbus.protocol.nats; docs/nats.md).

It accepts, greets each client with its INFO, bounds how many clients it holds
(``--max-connectors`` of them: past it, ``-ERR 'maximum connections exceeded'`` and
close, as nats-server does past its max_connections), and pings them every
``--nats-ping-interval``: a client silent through ``--nats-max-pings-out`` pings in a row
is closed with ``-ERR 'Stale Connection'``. The connections (meshbus.broker.nats.connection)
do the rest; the subject table is the broker's (meshbus.broker.core.subjects).

Its INFO says what the client must do first: ``tls_required`` (start TLS now, the
broker's --tls-cert), ``auth_required`` and a ``nonce`` (sign in; meshbus.broker.nats.auth).
``connect_urls`` lists where a client may reconnect: this listener's advertised address
(``url``: ``--nats-advertise``, or the address bound unless that is every address) and
the peers' (``set_peer_urls``, which the mesh calls as peers that take NATS clients come
and go: meshbus.broker.mesh.gossip); a change goes out to the clients as an async INFO,
as does lame duck
mode (``lame_duck``: ``ldm: true``, the listener stops taking clients, and those that stay
are closed once the drain's grace is over).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import platform
import random
from collections import Counter

from meshbus.broker.config import BrokerConfig
from meshbus.broker.nats.auth import NatsSignIn
from meshbus.broker.nats.connection import NatsCloseReason, NatsConnection, NatsError
from meshbus.broker.nats.interest import NatsInterest
from meshbus.broker.nats.router import NatsRouter
from meshbus.errors import InvalidArgument
from meshbus.protocol.nats import NatsParser, ServerInfo, encode_info
from meshbus.util import BackgroundTasks, hostport_text, parse_hostport

__all__ = ["NATS_VERSION", "NatsListener", "NatsTraffic"]

log = logging.getLogger("meshbus.broker.nats")

# The nats-server version whose client protocol this listener speaks: clients read
# INFO's version to know what the server does (headers since 2.2, no responders).
NATS_VERSION = "2.10.0"
# INFO's "go" (nats-server's Go version): the runtime that serves the clients.
_RUNTIME = f"python{platform.python_version()}"
_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


@dataclasses.dataclass
class NatsTraffic:
    """What NATS clients did: messages in (published) and out (delivered), their bytes
    (headers and payload, as nats-server counts them), the -ERRs that left a connection
    open, by kind."""

    msgs_in: int = 0
    bytes_in: int = 0
    msgs_out: int = 0
    bytes_out: int = 0
    errors: Counter[NatsError] = dataclasses.field(default_factory=Counter)

    def add(self, conn: NatsConnection) -> None:
        self.msgs_in += conn.msgs_in
        self.bytes_in += conn.bytes_in
        self.msgs_out += conn.msgs_out
        self.bytes_out += conn.bytes_out
        self.errors.update(conn.errors)


class NatsListener:
    """The listening socket for NATS clients, its connections and their ping timer."""

    def __init__(
        self,
        config: BrokerConfig,
        table: NatsInterest,
        router: NatsRouter,
        sign_in: NatsSignIn,
        rng: random.Random,
    ) -> None:
        self._config = config
        self._table = table
        self._router = router
        self._sign_in = sign_in
        self._flushes = router.flushes
        self.connections: dict[int, NatsConnection] = {}
        self._next_id = 0
        self._server: asyncio.Server | None = None
        self._tasks = BackgroundTasks()
        # Like nats-server's, an id of 56 characters of base32, new with each start.
        self.server_id = "N" + "".join(rng.choice(_ID_ALPHABET) for _ in range(55))
        self.address = ""
        # Where clients may reconnect to this broker ("": not known here).
        self.url = ""
        self._bound = ("", 0)
        self._peer_urls: list[str] = []
        self.lame_duck_mode = False
        self._left = asyncio.Event()
        # The connections closed, by why; and what they did (``traffic`` adds the open's).
        self.closed: Counter[NatsCloseReason] = Counter()
        self._gone = NatsTraffic()

    async def bind(self) -> None:
        """Bind ``--nats-listen``, taking no client yet (``start``); InvalidArgument when
        that address cannot be had. Bound before the broker links to a peer, so that each
        peer is told ``url`` in the handshake."""
        config = self._config
        host, port = parse_hostport(config.nats_listen)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._new_connection,
                host,
                port,
                reuse_address=True,
                backlog=1024,
                start_serving=False,
            )
        except OSError as exc:
            raise InvalidArgument(
                f"cannot listen for NATS clients on {config.nats_listen}: "
                f"{exc.strerror or exc}; choose another --nats-listen HOST:PORT"
            ) from None
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self._bound = (bound_host, bound_port)
        self.address = hostport_text(bound_host, bound_port)
        # Where clients may reconnect: this broker as advertised, or as bound unless it
        # listens on every address (which one a client can reach is not known here).
        if config.nats_advertise:
            self.url = config.nats_advertise
        elif not ipaddress.ip_address(bound_host).is_unspecified:
            self.url = self.address

    async def start(self) -> None:
        """Take clients (once the broker is ready), on the socket ``bind`` bound."""
        assert self._server is not None, "bind first"
        await self._server.start_serving()
        self._tasks.spawn(self._ping_timer(), "nats-pings")
        log.info(
            "NATS listener ready", extra={"broker": self._config.name, "address": self.address}
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._tasks.cancel()
        for conn in list(self.connections.values()):
            conn.close(NatsCloseReason.SERVER_SHUTDOWN, "broker shutting down")
        self._sign_in.stop()
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def connect_urls(self) -> list[str]:
        """Where a client may reconnect: this broker first, then its peers."""
        own = [self.url] if self.url else []
        return own + [url for url in self._peer_urls if url != self.url]

    def set_peer_urls(self, urls: list[str]) -> None:
        """The other brokers' NATS listeners (the mesh's): a change is told to every
        client as an async INFO, as nats-server tells its clients of its cluster."""
        if urls != self._peer_urls:
            self._peer_urls = list(urls)
            self._tell_clients()

    async def lame_duck(self, grace: float) -> None:
        """Lame duck mode, on drain: stop taking clients, tell those connected
        (``ldm: true``) to reconnect elsewhere, and wait up to ``grace`` seconds for them
        to go; ``stop`` closes those still here."""
        if self.lame_duck_mode:
            return
        self.lame_duck_mode = True
        if self._server is not None:
            self._server.close()  # new clients find no listener: they try the next URL
        self._tell_clients()
        log.info(
            "NATS listener in lame duck mode",
            extra={"broker": self._config.name, "clients": len(self.connections)},
        )
        if self.connections:
            self._left.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._left.wait(), grace)

    def traffic(self) -> NatsTraffic:
        """What every client did since the broker started, those gone and those here."""
        total = dataclasses.replace(self._gone, errors=Counter(self._gone.errors))
        for conn in self.connections.values():
            total.add(conn)
        return total

    def reauthorize(self) -> None:
        """After a SIGHUP reloaded the users: each signed-in client gets its user's new
        permissions, or is closed when its user is gone or its credential changed."""
        for conn in list(self.connections.values()):
            if conn.user is not None:
                conn.reauthorize(self._sign_in.recheck(conn.user))

    def _tell_clients(self) -> None:
        """An async INFO to every client that can take one (CONNECT protocol 1)."""
        for conn in self.connections.values():
            if conn.options.protocol >= 1 and conn.connected:
                conn.queue(self._info(conn))
        self._flushes.flush()

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
            sign_in=self._sign_in,
            spawn=self._tasks.spawn,
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
            go=_RUNTIME,
            host=host,
            port=port,
            max_payload=config.nats_max_payload,
            client_id=conn.client_id,
            client_ip=conn.host,
        )
        connect_urls = self.connect_urls
        if connect_urls:
            info.connect_urls = connect_urls
        if self._sign_in.required:
            info.auth_required = True
            info.nonce = conn.nonce
        if self._sign_in.tls is not None:
            info.tls_required = True
            if self._sign_in.tls_verify:
                info.tls_verify = True
        if self.lame_duck_mode:
            info.ldm = True
        return encode_info(info)

    def _opened(self, conn: NatsConnection) -> None:
        limit = self._config.max_connectors
        if len(self.connections) >= limit:
            conn.close(
                NatsCloseReason.MAX_CONNECTIONS,
                f"{limit} NATS clients are connected already (--max-connectors)",
                "maximum connections exceeded",
            )
            return
        self.connections[conn.client_id] = conn

    def _closed(self, conn: NatsConnection, reason: NatsCloseReason) -> None:
        self.closed[reason] += 1
        if self.connections.pop(conn.client_id, None) is not None:
            self._gone.add(conn)
        if not self.connections:
            self._left.set()

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
