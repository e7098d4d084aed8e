"""Keeping a connector linked to the mesh: which broker, and getting back to one.

Failover (docs/mesh.md). The connector knows every broker that takes connectors:
the addresses it was given, then the list the brokers push (in WELCOME and
BROKERS frames). When its broker dies, it drops that broker from the list and
reconnects -- to the others in random order, then to those it was given and the
one it lost (a broker that restarts comes back there), round after round with a
jittered, growing pause, until ``failover_timeout`` -- and registers every service
again *with the same address*, the same group memberships and subject subscriptions:
the broker sees the connector's session id and lets it take its own addresses back,
and a restarted
broker, which knows nothing of them, takes them as new. Meanwhile sends wait;
requests that were in flight through the dead broker fail with ``ConnectionLost``,
since their pending entries died with it. Only when ``failover_timeout`` passes is
the mesh lost. A broker that refuses a connector (full, joining, draining) names
one that has room, and the connector goes there.

Moves (rebalancing after a join, or a drain): the broker sends MOVE; the
connector opens a link to the new broker, registers everything there, switches
its sends over, and only then says BYE on the old link, reading it until the old
broker closes it -- make before break.

Keepalive: a link silent for ``keepalive`` seconds is pinged; three silent
intervals mean the broker is gone (one that hangs, or a host that vanished: a
killed process closes its sockets itself).

Every link is opened by the injected ``Dialer`` (meshbus.client.dial), and every
random choice -- the order of the brokers tried, the pauses between rounds -- is
drawn from the injected ``random.Random``: a test runs the real connector against
in-process brokers on a fake network, the same course every time. The services are
copied through the ``Gate`` (meshbus.client.changes), so no register, join, ...
slips in meanwhile and goes missing at the new broker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import ssl
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from meshbus.client.changes import Gate
from meshbus.client.dial import Dialer
from meshbus.client.inbound import Inbound
from meshbus.client.link import BrokerLink, Links
from meshbus.client.mailboxes import Services
from meshbus.client.memberships import Memberships
from meshbus.client.outbound import Outbound, TraceSampler
from meshbus.client.requester import Requester
from meshbus.client.waiters import Waiters
from meshbus.errors import (
    AddressInUse,
    AuthenticationFailed,
    ConnectionLost,
    MeshbusError,
    PermissionDenied,
    RemoteProtocolError,
    TLSError,
)
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    AddressBody,
    Body,
    BrokerInfo,
    Brokers,
    Bye,
    Empty,
    Hello,
    Move,
    Register,
    Revoked,
)
from meshbus.protocol.handshake import Credential, DiallingHandshake, HelloRefused
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.tls import handshake_error
from meshbus.util import BackgroundTasks, parse_hostport

log = logging.getLogger("meshbus.client")

# Brokers that refuse us in a row while naming another one before we give up on that chain.
_MAX_REDIRECTS = 8
# Pause between rounds over the broker list while failing over: the first, doubled
# after each round up to the last, each drawn at random from its upper half so that the
# connectors of a broker that died do not all dial together.
_RETRY_FIRST = 0.05
_RETRY_MOST = 1.0


def _authentication_failed(address: str, refused: HelloRefused) -> AuthenticationFailed:
    if refused.local:
        return AuthenticationFailed(
            f"broker {address} requires authentication, and no credentials were given: pass "
            "meshbus.connect(credentials=FILE or meshbus.Credentials), --creds FILE on the "
            "command line, or set MESHBUS_CREDS=FILE (meshbus keygen makes a key pair)"
        )
    return AuthenticationFailed(f"broker {address} refused the sign-in: {refused.message}")


class Redirected(ConnectionLost):
    """A broker refused the connector and named another (internal to connecting)."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


@dataclass(frozen=True)
class Identity:
    """What the connector tells every broker in its HELLO."""

    name: str
    role: str  # ROLE_CONNECTOR or ROLE_OPERATOR
    session: bytes  # the same across failover and moves
    # Signs in to a broker that asks (CHALLENGE), on every link: failover, redirects, moves.
    credential: Credential | None = None


class LinkKeeper:
    """Opens the connector's links, fails over, moves, and keeps the link alive.

    Besides the links it changes, it uses: the dialer and the random source, the
    inbound dispatcher (every link's frames; whether anyone watches for LEFT), the
    waiters (those a lost link fails), the requester, the registry of services and the
    memberships (to copy them to a new broker; to forget a service that cannot come
    back), the outbound (woken when a socket takes bytes again), the trace sampler
    (each WELCOME sets its rate), and two things of the whole connector: resending the
    unacknowledged messages after a failover, and ending the connector when the mesh
    is lost."""

    def __init__(
        self,
        *,
        identity: Identity,
        brokers: list[str],
        dialer: Dialer,
        rng: random.Random,
        failover_timeout: float,
        keepalive: float,
        request_timeout: float,
        links: Links,
        gate: Gate,
        inbound: Inbound,
        waiters: Waiters,
        requester: Requester,
        services: Services,
        memberships: Memberships,
        outbound: Outbound,
        sampler: TraceSampler,
        tasks: BackgroundTasks,
        resend_all: Callable[[], None],
        shutdown: Callable[[MeshbusError], None],
    ) -> None:
        self.brokers = list(brokers)
        self._given = list(brokers)  # what connect() was given: tried too when failing over
        self.failovers = 0
        self.moves = 0
        self._identity = identity
        self._dial = dialer  # every link, the first and each after a failover, redirect or move
        self._epoch = 0  # links opened so far: each HELLO says how many came before it
        self._failover_timeout = failover_timeout
        self._keepalive = keepalive
        self._request_timeout = request_timeout
        self._links = links
        self._gate = gate
        self._inbound = inbound
        self._waiters = waiters
        self._requester = requester
        self._services = services
        self._memberships = memberships
        self._outbound = outbound
        self._sampler = sampler
        self._tasks = tasks
        self._resend_all = resend_all
        self._shutdown = shutdown
        self._rng = rng

    # -- opening a link ------------------------------------------------------------------

    async def start(self) -> None:
        """Link to one of the brokers the connector was given, in their order."""
        self.activate(await self.open_any(self.brokers))

    async def open_any(self, addresses: list[str]) -> BrokerLink:
        """A handshaken link to one of ``addresses``, following redirects; if none takes
        us, ConnectionLost naming every reason -- TLSError when a TLS failure was among
        them, since that one needs fixing rather than waiting for; AuthenticationFailed
        at once if one refuses our credentials (or wants some), PermissionDenied if it
        refuses our user an operator link."""
        reasons: list[str] = []
        tls_failed = False
        for address in addresses:
            for _ in range(_MAX_REDIRECTS):
                try:
                    return await self._open(address)
                except Redirected as exc:
                    reasons.append(f"{address}: {exc}")
                    if not exc.address or exc.address == address:
                        break
                    address = exc.address
                except (ConnectionLost, TLSError) as exc:
                    reasons.append(str(exc))
                    tls_failed = tls_failed or isinstance(exc, TLSError)
                    break
        error = TLSError if tls_failed else ConnectionLost
        raise error("; ".join(reasons) or "no broker to connect to")

    async def _open(self, address: str) -> BrokerLink:
        """A link to ``address`` that the broker welcomed; Redirected when the broker
        refuses us naming another, TLSError when TLS fails, ConnectionLost for anything
        else that goes wrong."""
        try:
            host, port = parse_hostport(address)
        except ValueError as exc:  # from a broker list the mesh sent
            raise ConnectionLost(f"cannot connect to broker address {exc}") from exc
        links = self._links
        identity = self._identity
        handshake = DiallingHandshake(
            Hello(
                role=identity.role,
                name=identity.name,
                max_frame=links.max_frame,
                session=identity.session,
                synced=True,
                epoch=self._epoch,
                batched_no_route=True,
            ),
            credential=identity.credential,
        )
        self._epoch += 1
        try:
            link = await self._dial(
                host,
                port,
                lambda: BrokerLink(
                    address,
                    handshake,
                    max_frame=links.max_frame,
                    reader=self._inbound,
                    full_inboxes=self._services.full,
                    on_news=self._on_news,
                    on_lost=self._link_lost,
                    on_writable=self._outbound.resume_writing,
                ),
            )
        except ssl.SSLError as exc:
            raise handshake_error(exc, address) from None
        except socket.gaierror as exc:  # its errno is getaddrinfo's, which strerror misreads
            raise ConnectionLost(
                f"could not connect to broker {address}: the host {host!r} does not resolve "
                f"({exc.strerror or exc})"
            ) from exc
        except OSError as exc:
            # asyncio's own message ("Connect call failed ...") hides the reason; errno has it.
            # uvloop's reset during a TLS handshake is a bare ConnectionResetError().
            why = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            raise ConnectionLost(
                f"could not connect to broker {address}: {why} (is a broker running there?)"
            ) from exc
        link.write(handshake.hello())
        limit = self._request_timeout
        try:
            async with asyncio.timeout(limit or None):
                outcome = await link.welcomed
        except TimeoutError:
            link.abort()
            raise ConnectionLost(
                f"broker {address} did not answer HELLO within {limit} s "
                "(connect(request_timeout=...))"
            ) from None
        except BaseException:
            link.abort()
            raise
        if isinstance(outcome, HelloRefused):
            # A broker that refuses us (full, joining, draining) names one with room.
            link.abort()
            if outcome.code == ErrorCode.REDIRECT:
                raise Redirected(outcome.message, outcome.redirect)
            if outcome.code == ErrorCode.AUTH_FAILED:
                raise _authentication_failed(address, outcome)
            if outcome.code == ErrorCode.PERMISSION_DENIED:
                raise PermissionDenied(f"broker {address} refused the link: {outcome.message}")
            if outcome.code == ErrorCode.CERTIFICATE_REQUIRED:
                raise TLSError(
                    f"broker {address} requires a client certificate signed by its CA "
                    "(mutual TLS); give one: --tls-cert FILE --tls-key FILE, or "
                    "meshbus.connect(tls=context) after context.load_cert_chain(cert, key)"
                )
            raise ConnectionLost(f"lost the link to broker {address}: {outcome.message}")
        welcome = outcome.welcome
        links.agreed(welcome.max_frame)
        self._sampler.reset(welcome.trace_every)
        self._set_brokers(welcome.brokers)
        return link

    def activate(self, link: BrokerLink) -> None:
        self._links.take_over(link)
        if self._keepalive and "keepalive" not in self._tasks.names():
            self._tasks.spawn(self._keep_alive(), "keepalive")

    def _set_brokers(self, infos: list[BrokerInfo]) -> None:
        if infos:
            self.brokers = [info.address for info in infos]

    def _on_news(self, link: BrokerLink, frame: ControlFrame) -> None:
        """The broker list changed, a broker asks the connector to move, or a service's
        address was taken by another after a split."""
        body = frame.body
        if isinstance(body, Revoked):
            mailbox = self._services.get(body.address)
            if mailbox is not None:
                log.error(
                    "service %s lost its address: %s",
                    mailbox.address,
                    body.reason,
                    extra={"error": body.reason},
                )
                address = str(mailbox.address)
                self._memberships.forget(
                    mailbox, AddressInUse(f"{body.reason}; register again", address)
                )
        elif isinstance(body, Brokers):
            if link is self._links.current:
                self._set_brokers(body.brokers)
        # Also from a broker this connector is still restoring onto (a failover or a move):
        # the move waits for that to finish, and happens if the link took over.
        elif isinstance(body, Move) and link not in self._links.old:
            self._tasks.spawn(self._move(body.address, body.reason, link), "move")

    # -- losing it ---------------------------------------------------------------------------

    def _link_lost(self, link: BrokerLink, lost: ConnectionLost) -> None:
        self._waiters.fail(lost, link)
        if not self._links.closed and not self._fail_over_from(link, lost):
            self._shutdown(self._links.lost or lost)

    def _fail_over_from(self, link: BrokerLink, error: ConnectionLost) -> bool:
        """``link`` closed. True if the connector is failing over (or the link was one it
        was leaving anyway); False if the connector has lost the mesh for good."""
        links = self._links
        if links.left(link):
            return True  # a move finished
        if link is not links.current:
            return True
        if link.address in self.brokers:
            self.brokers.remove(link.address)
        if not self._failover_timeout:
            return False
        links.failing_over()
        log.warning(
            "lost broker %s (%s), failing over for up to %g s",
            link.broker_name or link.address,
            error,
            self._failover_timeout,
            extra={
                "broker": link.broker_name,
                "why": str(error),
                "failover_timeout": self._failover_timeout,
            },
        )
        self._tasks.spawn(self._fail_over(error, link.address), "failover")
        return True

    async def _fail_over(self, lost: ConnectionLost, address: str) -> None:
        """Reconnect -- to another broker, or to ``address`` (the one lost) once it is
        back -- and bring every service back, same addresses."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._failover_timeout
        reasons = ""
        pause = _RETRY_FIRST
        async with self._gate.copy():
            while (left := deadline - loop.time()) > 0:
                try:
                    async with asyncio.timeout(left):
                        link = await self._open_restored(self._reconnect_order(address))
                except (ConnectionLost, TLSError, TimeoutError) as exc:
                    reasons = str(exc) or reasons  # the deadline's TimeoutError says nothing
                    await asyncio.sleep(min(self._rng.uniform(pause / 2, pause), left))
                    pause = min(2 * pause, _RETRY_MOST)
                    continue
                except AuthenticationFailed as exc:
                    # The same credentials will not do better on the next round.
                    self._give_up(ConnectionLost(f"{lost}; failing over: {exc}"))
                    return
                self.failovers += 1
                self.activate(link)
                self._resend_all()
                log.info(
                    "failed over to broker %s", link.broker_name, extra={"broker": link.broker_name}
                )
                return
        self._give_up(
            ConnectionLost(
                f"{lost}; no broker took this connector within failover_timeout "
                f"{self._failover_timeout} s ({reasons or 'no answer'})"
            )
        )

    def _reconnect_order(self, lost: str) -> list[str]:
        """Every broker the connector knows: the mesh's others in random order, then those
        it was given, then ``lost`` -- most likely still down, so last."""
        order = list(self.brokers)
        self._rng.shuffle(order)
        order.extend(a for a in dict.fromkeys([*self._given, lost]) if a not in order)
        return order

    def _give_up(self, error: ConnectionLost) -> None:
        log.error("lost the mesh: %s", error, extra={"error": str(error)})
        self._shutdown(error)

    # -- moving ----------------------------------------------------------------------------

    async def _move(self, address: str, reason: str, via: BrokerLink) -> None:
        """MOVE (that came on ``via``): link to ``address``, bring the services there,
        switch, then leave."""
        links = self._links
        async with self._gate.copy():
            old = links.current
            if old is not via or links.closed or not links.connected.is_set():
                return  # from a link that did not take over, or no longer ours
            try:
                link = await self._open_restored([address])
            except (ConnectionLost, TLSError, RemoteProtocolError, AuthenticationFailed) as exc:
                log.warning(
                    "could not move to broker %s: %s",
                    address,
                    exc,
                    extra={"to": address, "error": str(exc)},
                )
                return
            if links.closed:
                link.abort()
                return
            self.moves += 1
            links.leaving(old)
            self.activate(link)
            old.write(encode_control(ControlType.BYE, Bye(reason=f"moved: {reason}")))
        log.info(
            "moved to broker %s: %s",
            link.broker_name,
            reason,
            extra={"to": link.broker_name, "reason": reason},
        )

    async def _open_restored(self, addresses: list[str]) -> BrokerLink:
        """A link to the first of ``addresses`` that takes the connector, with every
        service restored on it; a link that fails meanwhile (or a cancelled wait) is
        dropped, not left open beside the connector's own."""
        link = await self.open_any(addresses)
        try:
            await self._restore(link)
        except BaseException:
            link.abort()
            raise
        return link

    async def _restore(self, link: BrokerLink) -> None:
        """Register every service on ``link`` with its own address, then its groups and
        subject subscriptions, and wait until the whole mesh knows them (SYNCED).

        Requests go out together and are answered in order; a service whose address
        was taken meanwhile by another session is closed (it cannot come back). Waiting
        for SYNCED matters when the connector moves on soon after: the next broker takes
        the addresses over only once this one's ADDs have reached it, so none arrives
        late, reads as the connector moving back, and is undone by the REMOVE that
        follows."""
        mailboxes = self._services.all()
        loop = asyncio.get_running_loop()
        synced: list[asyncio.Future[ControlFrame]] = []
        ask = self._requester.ask

        def change(
            type_: ControlType, body: Body, answer: type[Body], subject: str = ""
        ) -> Coroutine[Any, Any, Body]:
            future: asyncio.Future[ControlFrame] = loop.create_future()
            synced.append(future)
            return ask(type_, body, answer, subject, link=link, synced=future)

        try:
            answers = await asyncio.gather(
                *(
                    change(
                        ControlType.REGISTER,
                        Register(server=e.address.server, instance=e.address.instance),
                        AddressBody,
                        str(e.address),
                    )
                    for e in mailboxes
                ),
                return_exceptions=True,
            )
            _raise_lost(answers)
            joins: list[Coroutine[Any, Any, Body]] = []
            for mailbox, answer in zip(mailboxes, answers, strict=True):
                if isinstance(answer, BaseException):
                    log.error(
                        "service %s could not be registered again after failover: %s",
                        mailbox.address,
                        answer,
                        extra={"address": str(mailbox.address), "error": str(answer)},
                    )
                    error = answer if isinstance(answer, MeshbusError) else None
                    self._memberships.forget(mailbox, error)
                    continue
                joins.extend(
                    change(ControlType.JOIN, join, Empty)
                    for join in self._memberships.rejoins(mailbox)
                )
                joins.extend(
                    change(ControlType.SUBSCRIBE, subscription, Empty)
                    for subscription in self._memberships.resubscribes(mailbox)
                )
            if self._inbound.left.handlers:
                joins.append(ask(ControlType.WATCH, Empty(), Empty, link=link))
            _raise_lost(await asyncio.gather(*joins, return_exceptions=True))
            # A refused change gets no SYNCED (its future is cancelled): nothing to wait for.
            _raise_lost(await asyncio.gather(*synced, return_exceptions=True))
        finally:
            # Once a change failed the rest are not awaited: cancel() also marks a loss one
            # got as seen, so the loop does not report it as an exception never retrieved.
            for future in synced:
                future.cancel()

    # -- keepalive ---------------------------------------------------------------------

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self._keepalive
        links = self._links
        ticked = loop.time()
        while not links.closed:
            await asyncio.sleep(interval)
            # A tick far later than asked: this process's loop was blocked (a long
            # synchronous call), so the link could not be read -- the silence is ours.
            now = loop.time()
            blocked = now - ticked > 2 * interval
            ticked = now
            link = links.current
            if link is None or link.closed or not links.connected.is_set() or self._services.full:
                continue
            silent = now - link.heard_at
            if silent > 3 * interval and not blocked:
                link.abort(f"no answer for {silent:.1f} s")
            elif silent > interval:
                link.write(encode_control(ControlType.PING, Empty()))


def _raise_lost(answers: Sequence[object]) -> None:
    """The first ConnectionLost among ``answers``: the link is gone, the rest is moot."""
    for answer in answers:
        if isinstance(answer, ConnectionLost):
            raise answer
