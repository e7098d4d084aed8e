"""Keeping a connector linked to the mesh: which broker, and getting back to one.

Failover (ARCHITECTURE.md section 5). The connector knows every broker that
takes connectors: the addresses it was given, then the list the brokers push
(in WELCOME and BROKERS frames). When its broker dies, it drops that broker
from the list, picks another at random, reconnects, and registers every service
again *with the same address* and the same group memberships -- the broker sees
the connector's session id and lets it take its own addresses back. Meanwhile
sends wait (up to ``failover_timeout``); requests that were in flight through
the dead broker fail with ``ConnectionLost``, since their pending entries died
with it. With no other broker to go to, the link is simply lost. A broker that
refuses a connector (full, joining, draining) names one that has room, and the
connector goes there.

Moves (rebalancing after a join, or a drain): the broker sends MOVE; the
connector opens a link to the new broker, registers everything there, switches
its sends over, and only then says BYE on the old link, reading it until the old
broker closes it -- make before break.

Keepalive: a link silent for ``keepalive`` seconds is pinged; three silent
intervals mean the broker is gone (one that hangs, or a host that vanished: a
killed process closes its sockets itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any

from meshbus.address import Unicast
from meshbus.client.link import BrokerLink
from meshbus.errors import ConnectionLost, RemoteProtocolError
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    Body,
    BrokerInfo,
    Bye,
    Empty,
    Hello,
    Membership,
    Register,
)
from meshbus.protocol.handshake import DiallingHandshake, Refused
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.util import parse_hostport

if TYPE_CHECKING:
    from meshbus.client.connector import Connector

log = logging.getLogger("meshbus.client")

# Brokers that refuse us in a row while naming another one before we give up on that chain.
_MAX_REDIRECTS = 8
# Pause between rounds over the broker list while failing over.
_RETRY_PAUSE = 0.05


class Redirected(ConnectionLost):
    """A broker refused the connector and named another (internal to connecting)."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


class Gate:
    """Many service changes (register, join, ...) at once, or one copy of all services to
    a new broker (failover, move) alone -- so no change can slip in while the services
    are copied and be missing at the new broker. A waiting copy goes before new changes."""

    def __init__(self) -> None:
        self._changes = 0
        self._copying = False
        self._copy_waiting = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def change(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._copying and not self._copy_waiting)
            self._changes += 1
        try:
            yield
        finally:
            async with self._cond:
                self._changes -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def copy(self) -> AsyncIterator[None]:
        async with self._cond:
            self._copy_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._copying and not self._changes)
            finally:
                self._copy_waiting -= 1
            self._copying = True
        try:
            yield
        finally:
            async with self._cond:
                self._copying = False
                self._cond.notify_all()


class LinkKeeper:
    def __init__(
        self, connector: Connector, brokers: list[str], failover_timeout: float, keepalive: float
    ) -> None:
        self.connector = connector
        self.brokers = list(brokers)
        self.failover_timeout = failover_timeout
        self.keepalive = keepalive
        self.link: BrokerLink | None = None
        self.old: set[BrokerLink] = set()  # links being left after a move
        self.connected = asyncio.Event()
        self.failovers = 0
        self.moves = 0
        self.gate = Gate()
        self._rng = random.Random()
        self._tasks: set[asyncio.Task[Any]] = set()

    def links(self) -> list[BrokerLink]:
        return [link for link in (self.link, *self.old) if link is not None]

    # -- opening a link ------------------------------------------------------------------

    async def open_any(self, addresses: list[str], *, random_order: bool) -> BrokerLink:
        """A handshaken link to one of ``addresses``, following redirects; ConnectionLost
        (naming every reason) if none takes us."""
        order = list(addresses)
        if random_order:
            self._rng.shuffle(order)
        reasons: list[str] = []
        for address in order:
            for _ in range(_MAX_REDIRECTS):
                try:
                    return await self._open(address)
                except Redirected as exc:
                    reasons.append(f"{address}: {exc}")
                    if not exc.address or exc.address == address:
                        break
                    address = exc.address
                except ConnectionLost as exc:
                    reasons.append(str(exc))
                    break
        raise ConnectionLost("; ".join(reasons) or "no broker to connect to")

    async def _open(self, address: str) -> BrokerLink:
        """A link to ``address`` that the broker welcomed; Redirected when the broker
        refuses us naming another, ConnectionLost for anything else that goes wrong."""
        conn = self.connector
        try:
            host, port = parse_hostport(address)
        except ValueError as exc:  # from a broker list the mesh sent
            raise ConnectionLost(f"cannot connect to broker address {exc}") from exc
        handshake = DiallingHandshake(
            Hello(
                role=ROLE_OPERATOR if conn.operator else ROLE_CONNECTOR,
                name=conn.name,
                max_frame=conn.max_frame,
                session=conn.session,
                synced=True,
            )
        )
        loop = asyncio.get_running_loop()
        try:
            _, link = await loop.create_connection(
                lambda: BrokerLink(conn, address, conn.max_frame, handshake), host, port
            )
        except OSError as exc:
            # asyncio's own message ("Connect call failed ...") hides the reason; errno has it.
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConnectionLost(
                f"could not connect to broker {address}: {why} (is a broker running there?)"
            ) from exc
        link.write(handshake.hello())
        limit = conn._request_timeout
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
        if isinstance(outcome, Refused):
            # A broker that refuses us (full, joining, draining) names one with room.
            link.abort()
            if outcome.code == ErrorCode.REDIRECT:
                raise Redirected(outcome.message, outcome.redirect)
            raise ConnectionLost(f"lost the link to broker {address}: {outcome.message}")
        welcome = outcome.welcome
        conn.max_frame = min(conn.max_frame, welcome.max_frame)
        conn._trace_every = conn._trace_left = welcome.trace_every
        self.set_brokers(welcome.brokers)
        return link

    def activate(self, link: BrokerLink) -> None:
        self.link = link
        self.connected.set()
        if self.keepalive and not any(t.get_name() == "keepalive" for t in self._tasks):
            self._spawn(self._keep_alive(), "keepalive")

    def set_brokers(self, infos: list[BrokerInfo]) -> None:
        if infos:
            self.brokers = [info.address for info in infos]

    async def usable(self) -> BrokerLink:
        """The link to send on; waits while the connector fails over."""
        self.connector._check_usable()
        if not self.connected.is_set():
            await self.connected.wait()
            self.connector._check_usable()
        assert self.link is not None
        return self.link

    # -- losing it ---------------------------------------------------------------------------

    def lost(self, link: BrokerLink, error: ConnectionLost) -> bool:
        """``link`` closed. True if the connector is failing over (or the link was one it
        was leaving anyway); False if the connector has lost the mesh for good."""
        if link in self.old:
            self.old.discard(link)  # a move finished
            return True
        if link is not self.link:
            return True
        if link.address in self.brokers:
            self.brokers.remove(link.address)
        if not self.failover_timeout or not self.brokers:
            return False  # no failover, or no other broker to go to (the seed's rule)
        self.connected.clear()
        log.info("broker lost, failing over", extra={"broker": link.broker_name, "why": str(error)})
        self._spawn(self._fail_over(error), "failover")
        return True

    async def _fail_over(self, lost: ConnectionLost) -> None:
        """Reconnect to another broker and bring every service back, same addresses."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.failover_timeout
        reasons = ""
        async with self.gate.copy():
            while loop.time() < deadline:
                try:
                    async with asyncio.timeout(max(0.05, deadline - loop.time())):
                        link = await self.open_any(self.brokers, random_order=True)
                        await self._restore(link)
                except (ConnectionLost, TimeoutError) as exc:
                    reasons = str(exc)
                    await asyncio.sleep(_RETRY_PAUSE)
                    continue
                self.failovers += 1
                self.activate(link)
                self.connector._reliable.resend_all()
                log.info("failed over", extra={"broker": link.broker_name})
                return
        self.connector._shutdown(
            ConnectionLost(
                f"{lost}; no other broker took this connector within "
                f"{self.failover_timeout} s ({reasons})"
            )
        )

    # -- moving ----------------------------------------------------------------------------

    def move(self, address: str, reason: str, via: BrokerLink) -> None:
        self._spawn(self._move(address, reason, via), "move")

    async def _move(self, address: str, reason: str, via: BrokerLink) -> None:
        """MOVE (that came on ``via``): link to ``address``, bring the services there,
        switch, then leave."""
        async with self.gate.copy():
            old = self.link
            if old is not via or self.connector._closed or not self.connected.is_set():
                return  # from a link that did not take over, or no longer ours
            try:
                link = await self.open_any([address], random_order=False)
                await self._restore(link)
            except (ConnectionLost, RemoteProtocolError) as exc:
                log.warning("could not move", extra={"to": address, "error": str(exc)})
                return
            if self.connector._closed:
                link.abort()
                return
            self.moves += 1
            self.old.add(old)
            self.activate(link)
            old.write(encode_control(ControlType.BYE, Bye(reason=f"moved: {reason}")))
        log.info("moved", extra={"to": link.broker_name, "reason": reason})

    async def _restore(self, link: BrokerLink) -> None:
        """Register every service on ``link`` with its own address, then its groups, and
        wait until the whole mesh knows them (SYNCED).

        Requests go out together and are answered in order; a service whose address
        was taken meanwhile by another session is closed (it cannot come back). Waiting
        for SYNCED matters when the connector moves on soon after: the next broker takes
        the addresses over only once this one's ADDs have reached it, so none arrives
        late, reads as the connector moving back, and is undone by the REMOVE that
        follows."""
        conn = self.connector
        services = conn.services
        loop = asyncio.get_running_loop()
        synced: list[asyncio.Future[ControlFrame]] = []

        def request(
            type_: ControlType, body: Body, subject: str = ""
        ) -> Coroutine[Any, Any, ControlFrame]:
            future: asyncio.Future[ControlFrame] = loop.create_future()
            synced.append(future)
            return conn._control(type_, body, subject, link=link, synced=future)

        answers = await asyncio.gather(
            *(
                request(
                    ControlType.REGISTER,
                    Register(server=s.address.server, instance=s.address.instance),
                    str(s.address),
                )
                for s in services
                if isinstance(s.address, Unicast)
            ),
            return_exceptions=True,
        )
        joins: list[Coroutine[Any, Any, ControlFrame]] = []
        for service, answer in zip(services, answers, strict=True):
            if isinstance(answer, ConnectionLost):
                raise answer
            if isinstance(answer, BaseException):
                log.error(
                    "a service could not be registered again after failover",
                    extra={"address": str(service.address), "error": str(answer)},
                )
                conn._forget(service)
                continue
            joins.extend(
                request(ControlType.JOIN, Membership(member=service._raw, group=group.to_bytes()))
                for group in service.groups
            )
        if conn._left_handlers:
            joins.append(conn._control(ControlType.WATCH, Empty(), link=link))
        for answer in await asyncio.gather(*joins, return_exceptions=True):
            if isinstance(answer, ConnectionLost):
                raise answer
        # A refused change gets no SYNCED (its future is cancelled): nothing to wait for.
        for done in await asyncio.gather(*synced, return_exceptions=True):
            if isinstance(done, ConnectionLost):
                raise done

    # -- keepalive ---------------------------------------------------------------------

    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.keepalive
        ticked = loop.time()
        while not self.connector._closed:
            await asyncio.sleep(interval)
            # A tick far later than asked: this process's loop was blocked (a long
            # synchronous call), so the link could not be read -- the silence is ours.
            now = loop.time()
            blocked = now - ticked > 2 * interval
            ticked = now
            link = self.link
            if (
                link is None
                or link.closed
                or not self.connected.is_set()
                or self.connector._full_inboxes
            ):
                continue
            silent = now - link.heard_at
            if silent > 3 * interval and not blocked:
                link.error = f"no answer for {silent:.1f} s"
                link.abort()
            elif silent > interval:
                link.write(encode_control(ControlType.PING, Empty()))

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
