"""Connecting to the mesh: ``meshbus.connect`` (the broker lists it takes are
meshbus.client.brokers).

``connect`` turns addresses and options into a handshaken ``Connector``; what the
connector does from then on is in meshbus.client.connector, and how it stays
linked (failover, redirects, moves) in meshbus.client.failover.
"""

from __future__ import annotations

import functools
import os
import random
import socket
from collections.abc import Callable, Coroutine, Generator, Sequence
from types import TracebackType
from typing import Any, ParamSpec

from meshbus.address import Unicast
from meshbus.auth import Credentials, resolve_credentials
from meshbus.client.brokers import BROKER_ENV, DEFAULT_BROKER, TLS_CA_ENV, broker_list
from meshbus.client.connector import Connector, ConnectorParts
from meshbus.client.dial import dial_tcp
from meshbus.client.reliable import ReliableConfig
from meshbus.errors import InvalidArgument
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, MIN_MAX_FRAME
from meshbus.tls import TLSOption, client_context

P = ParamSpec("P")


def _check_options(
    max_frame: int,
    max_inbox: int,
    timeout: float,
    failover_timeout: float,
    keepalive: float,
    request_timeout: float,
) -> None:
    # `not x >= 0` rather than `x < 0`, so that NaN is refused too.
    if not max_frame >= MIN_MAX_FRAME:
        raise InvalidArgument(f"max_frame must be at least {MIN_MAX_FRAME} bytes, got {max_frame}")
    if not max_inbox >= 1:
        raise InvalidArgument(f"max_inbox must be at least 1, got {max_inbox}")
    if not timeout > 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout}")
    for name, value in (
        ("failover_timeout", failover_timeout),
        ("keepalive", keepalive),
        ("request_timeout", request_timeout),
    ):
        if not value >= 0:
            raise InvalidArgument(f"{name} must be 0 or more seconds, got {value}")


class Connecting(Coroutine[Any, Any, Connector]):
    """What ``connect`` returns: ``await`` it for the ``Connector``, or enter it --
    ``async with meshbus.connect(...) as conn:`` -- for a connector closed when the block
    ends. It is a coroutine too (``asyncio.create_task``, ``asyncio.run`` take it), as
    aiohttp's ``session.get()`` is. (``async with await meshbus.connect(...)`` works as
    before: a ``Connector`` is an async context manager itself.)"""

    __slots__ = ("_connecting", "_connector")

    def __init__(self, connecting: Coroutine[Any, Any, Connector]) -> None:
        self._connecting = connecting
        self._connector: Connector | None = None

    def __await__(self) -> Generator[Any, None, Connector]:
        return self._connecting.__await__()

    def send(self, value: Any) -> Any:
        return self._connecting.send(value)

    def throw(self, *args: Any) -> Any:
        return self._connecting.throw(*args)

    def close(self) -> None:
        self._connecting.close()

    async def __aenter__(self) -> Connector:
        self._connector = await self._connecting
        return self._connector

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._connector is not None:
            await self._connector.close()


def _entered_or_awaited(
    connecting: Callable[P, Coroutine[Any, Any, Connector]],
) -> Callable[P, Connecting]:
    """``connecting``, returning its coroutine as a ``Connecting``."""

    @functools.wraps(connecting)
    def connect(*args: P.args, **kwargs: P.kwargs) -> Connecting:
        return Connecting(connecting(*args, **kwargs))

    return connect


@_entered_or_awaited
async def connect(
    broker: str | Sequence[str] | None = None,
    *,
    server: str | None = None,
    name: str = "",
    max_frame: int = DEFAULT_MAX_FRAME,
    max_inbox: int = 65536,
    timeout: float = 5.0,
    failover: bool = True,
    failover_timeout: float = 10.0,
    keepalive: float = 1.0,
    operator: bool = False,
    reliable: ReliableConfig | None = None,
    request_timeout: float = 30.0,
    credentials: Credentials | str | os.PathLike[str] | None = None,
    tls: TLSOption = None,
    randomize_brokers: bool = True,
) -> Connector:
    """Connect to the mesh through one of ``broker`` (``HOST:PORT``, several separated
    by commas, or a list; a bare ``HOST`` means port 7400) and complete the handshake.
    Without ``broker``, the brokers ``MESHBUS_BROKER`` names, else 127.0.0.1:7400.

    ``server`` is the server name of this process's unicast addresses (at most
    11 bytes); it defaults to the host name when that fits. ``timeout`` bounds
    connecting (over every address given). With ``failover``, when its broker dies
    the connector reconnects -- to another broker, or to that one once it is back --
    trying for up to ``failover_timeout`` seconds while sends wait; then
    ``ConnectionLost``. ``keepalive`` is how long a silent link may stay silent before the
    connector pings it (three intervals without an answer count as a dead broker).
    ``request_timeout`` bounds each request the broker answers (register, join, stream
    calls, stat, ...): one not answered in time raises ``meshbus.Timeout`` (0: wait as
    long as the link lives).

    ``operator=True`` opens an operator's link to exactly that broker (what
    ``meshbus stat`` and ``meshbus drain`` use): it is not a connector -- never
    refused or redirected when the broker is full, joining or draining, not counted,
    never moved -- it cannot register services, and it does not fail over.

    ``reliable`` tunes reliable sends and message groups (``meshbus.ReliableConfig``).

    ``credentials`` signs in to brokers that have users (docs/security.md): a
    ``meshbus.Credentials`` or the path of a credentials file (``meshbus keygen``
    writes one); without it, the file ``MESHBUS_CREDS`` names, if set. Every link
    signs in with them -- failover, redirects and moves too. A broker that refuses
    them, or wants credentials and got none, raises ``meshbus.AuthenticationFailed``;
    a broker without users takes the connector as it is.
    ``tls`` makes every link TLS: True checks the broker's certificate against the
    system's CAs, a CA file path (str or os.PathLike) against that CA, and an
    ``ssl.SSLContext`` is used as given (a client certificate for a broker with
    --tls-verify-clients: ``context.load_cert_chain(cert, key)``). The certificate
    must be good for the host dialled. Failover, redirects
    and moves dial with the same settings. A TLS failure raises ``meshbus.TLSError``
    naming its cause. Without ``tls`` (None), the CA file ``MESHBUS_TLS_CA`` names turns
    TLS on, if set; ``tls=False`` is plain TCP whatever the environment says.

    ``randomize_brokers``: the brokers given are tried in a random order, so that the
    processes started with one list spread over its brokers (as NATS clients do);
    False tries them in the order given (nats.py's ``dont_randomize``).

    Returns a ``Connecting``: ``conn = await meshbus.connect(...)``, or
    ``async with meshbus.connect(...) as conn:`` to close it at the end of the block.
    """
    if server is None:
        server = socket.gethostname().split(".")[0]
    Unicast(server, 1)  # a bad server name fails here, before any I/O
    addresses = broker_list(
        broker if broker is not None else os.environ.get(BROKER_ENV) or DEFAULT_BROKER
    )
    _check_options(max_frame, max_inbox, timeout, failover_timeout, keepalive, request_timeout)
    signing_in = resolve_credentials(credentials)
    tls_context = client_context(os.environ.get(TLS_CA_ENV) if tls is None else tls)
    rng = random.Random()
    if randomize_brokers:
        rng.shuffle(addresses)
    parts = ConnectorParts(
        server=server,
        name=name or server,
        brokers=addresses,
        max_frame=max_frame,
        max_inbox=max_inbox,
        failover_timeout=failover_timeout if failover and not operator else 0.0,
        keepalive=keepalive,
        operator=operator,
        reliable=reliable or ReliableConfig(),
        request_timeout=request_timeout,
        credentials=signing_in,
        dialer=functools.partial(dial_tcp, tls=tls_context),
        rng=rng,
    )
    await parts.start(timeout)
    return Connector(parts)
