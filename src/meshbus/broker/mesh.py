"""The mesh: this broker's links to its peers, and the life of the mesh over time.

Membership (ARCHITECTURE.md section 5; docs/mesh.md has the long form):

* **Join** (the seed patent's steps): link to a seed, learn the broker list, link
  to every broker, claim a dynamic-id slot, take every peer's table
  (meshbus.broker.sync), announce READY; then every broker moves its excess
  connectors to the newcomer (meshbus.broker.balance.excess).
* **Duplicate links** are resolved at the handshake by one rule applied on both
  ends (meshbus.broker.balance.incoming_link_wins), before any route is sent.
* **Gossip**: brokers send each other the list of brokers they know; a ready
  broker links to every ready broker it hears of, so the mesh stays full.
* **Heartbeats**: LOAD frames every ``heartbeat_interval``; a peer that sends
  nothing for ``heartbeat_misses`` intervals is dead. A peer that closes without
  BYE crashed: its routes go, and this broker raises its connector capacity by
  ``capacity_boost`` for ``boost_window`` seconds so the orphans can land.
* **Drain**: take no connector, tell the peers, move every connector to the
  broker with the most room, wait up to the grace period.

Moving connectors -- for a newcomer or a drain -- is meshbus.broker.moves.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshbus.broker.balance import incoming_link_wins
from meshbus.broker.guarantees import PEER_FRAMES
from meshbus.broker.link import CloseReason, Link, LinkState
from meshbus.broker.moves import Moves
from meshbus.broker.sync import RouteSync
from meshbus.protocol.codec import describe, encode_control
from meshbus.protocol.control import (
    ROLE_BROKER,
    Body,
    BrokerInfo,
    Brokers,
    Bye,
    Empty,
    Error,
    Hello,
    Load,
    Ready,
    Welcome,
)
from meshbus.protocol.layout import MIN_MAX_FRAME, ControlType, ErrorCode
from meshbus.util import parse_hostport

if TYPE_CHECKING:
    from meshbus.broker.server import Broker

log = logging.getLogger("meshbus.broker")

# Route operations per ROUTES frame: about 40 bytes each, well under the default frame limit.
ROUTES_CHUNK = 10_000
# A broker that could not be dialled is not dialled again from gossip for this long.
_DIAL_COOLDOWN = 2.0
_DIAL_TIMEOUT = 5.0
# After BYE, how long a stopping broker waits for its peers to close their side.
_BYE_TIMEOUT = 1.0
_GRACEFUL = frozenset(
    {CloseReason.PEER_BYE, CloseReason.DUPLICATE_LINK, CloseReason.BROKER_SHUTDOWN}
)


class JoinFailed(Exception):
    """The broker could not join the mesh through any of its seeds."""


@dataclass
class MeshStats:
    duplicate_links: int = 0
    peers_lost: int = 0
    peers_crashed: int = 0
    moves_sent: int = 0


class Mesh:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.config = broker.config
        self.peers: dict[str, Link] = {}  # open peer links, by broker name
        # Every other broker we know of: from its handshake, its LOAD frames and gossip.
        self.known: dict[str, BrokerInfo] = {}
        self.stats = MeshStats()
        self.ready = False
        self.draining = False
        self._dialling: dict[str, str] = {}  # address -> expected name ("" unknown)
        self._dial_waiters: dict[Link, asyncio.Future[bool]] = {}
        self._dial_failed: dict[str, float] = {}  # address -> when
        self._lists_scheduled = False
        self._pushed: tuple[str, ...] = ()
        self._snapshot_pending: set[Link] = set()
        self._snapshots_done = asyncio.Event()
        self._gossip = asyncio.Event()
        self._boost_until = 0.0
        self.moves = Moves(self)
        self._leaving: dict[Link, asyncio.Future[None]] = {}  # peers told BYE, not yet closed
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- identity and capacity ------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def capacity(self) -> int:
        """The current connector limit: raised for a while after a peer crashed."""
        limit = self.config.max_connectors
        if self.broker.clock() < self._boost_until:
            return math.ceil(limit * self.config.capacity_boost)
        return limit

    def self_state(self) -> BrokerInfo:
        return BrokerInfo(
            name=self.name,
            address=self.broker.advertised,
            slot=self.broker.routing.slot,
            connectors=len(self.broker.connectors),
            capacity=self.capacity,
            ready=self.ready,
            draining=self.draining,
        )

    def brokers(self) -> list[BrokerInfo]:
        """This broker and the brokers it is linked to, itself first: first-hand knowledge,
        and all it gossips, offers to connectors, redirects to or moves connectors to.

        ``known`` also holds brokers only heard of through gossip: candidates to dial,
        never targets. Gossip can be stale -- a peer that has not yet noticed a crash
        still lists the dead broker -- and a target that is gone would cost a connector
        its redirect or move."""
        return [self.self_state(), *(self.known[n] for n in self.peers if n in self.known)]

    # -- start: a new mesh, or a join through seeds ------------------------------------

    def start(self) -> None:
        self.broker.sync.claims.me = self.name
        self._spawn(self._heartbeats(), "mesh-heartbeats")

    def found(self) -> None:
        """Start a new mesh of one: slot 1, ready at once."""
        self.broker.routing.slot = self.config.slot
        self._became_ready()

    def _became_ready(self) -> None:
        self.ready = True
        self.broker.streams.restore()
        self.broker.telemetry.start()
        # Connectors get the list in WELCOME from now on; only changes are pushed.
        self._pushed = self._connector_addresses()

    async def join(self, seeds: list[str]) -> None:
        """The seed patent's join, steps in order: link to a seed, learn the broker list,
        link to every broker, claim a slot, take every peer's table, announce READY."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.join_timeout
        while not self.peers:
            for seed in seeds:
                if await self.dial(seed):
                    break
            else:
                if loop.time() >= deadline:
                    raise JoinFailed(
                        "could not join the mesh: no seed answered ("
                        + ", ".join(seeds)
                        + "); is a broker running there?"
                    )
                await asyncio.sleep(0.2)
        # The seed sends its broker list right after the handshake.
        try:
            await asyncio.wait_for(self._gossip.wait(), max(0.1, deadline - loop.time()))
        except TimeoutError:
            raise JoinFailed("the seed did not send the broker list") from None
        others = [
            s.address for s in self.known.values() if s.name not in self.peers and not s.draining
        ]
        await asyncio.gather(*(self.dial(address) for address in others))
        known_slots = {s.slot for s in self.known.values()}
        self.broker.routing.slot = await self.broker.sync.claim_slot(known_slots, self.name)
        try:
            await asyncio.wait_for(self._snapshots_done.wait(), max(0.1, deadline - loop.time()))
        except TimeoutError:
            raise JoinFailed("peers did not send their routing tables in time") from None
        self._became_ready()
        counts = {s.name: s.connectors for s in self.brokers() if not s.draining}
        self._send_all(ControlType.READY, Ready(counts=counts))
        self.lists_changed()
        log.info("joined the mesh", extra={"broker": self.name, "peers": sorted(self.peers)})

    # -- dialling and handshakes ---------------------------------------------------------

    async def dial(self, address: str, expected: str = "") -> bool:
        """Link to the broker at ``address``; True once the link is open (or was already)."""
        if address == self.broker.advertised or address in self._dialling:
            return False
        if any(link.listen == address for link in self.peers.values()):
            return True
        loop = asyncio.get_running_loop()
        self._dialling[address] = expected
        try:
            host, port = parse_hostport(address)
            async with asyncio.timeout(_DIAL_TIMEOUT):
                _, link = await loop.create_connection(
                    lambda: Link(self.broker, self.broker.next_link_id(), dialled=True), host, port
                )
                opened: asyncio.Future[bool] = loop.create_future()
                self._dial_waiters[link] = opened
                link.send(
                    encode_control(
                        ControlType.HELLO,
                        Hello(
                            role=ROLE_BROKER,
                            name=self.name,
                            max_frame=self.config.max_frame,
                            listen=self.broker.advertised,
                            slot=self.broker.routing.slot,
                            tag=link.tag_in,
                        ),
                    )
                )
                return await opened
        except (OSError, TimeoutError, ValueError) as exc:
            self._dial_failed[address] = loop.time()
            for name, info in list(self.known.items()):
                if info.address == address and name not in self.peers:
                    del self.known[name]  # heard of, but not there
            log.info("could not link to a broker", extra={"address": address, "error": str(exc)})
            return False
        finally:
            self._dialling.pop(address, None)

    def accept_peer(self, link: Link, hello: Hello, correlation: int) -> Error | None:
        """HELLO from a dialling broker: the duplicate-link rule, then WELCOME (sent here,
        before the route snapshot that follows it), or the Error to refuse it with."""
        name = hello.name
        if not name or name == self.name:
            return Error(
                code=ErrorCode.NAME_IN_USE,
                message=f"a broker named {name!r} is already in the mesh; "
                "give every broker a unique --name",
            )
        mine = self.peers.get(name)
        dialling = hello.listen in self._dialling or name in self._dialling.values()
        if (mine is not None and mine.dialled) or dialling:
            self.stats.duplicate_links += 1
            if not incoming_link_wins(self.name, name):
                return Error(
                    code=ErrorCode.DUPLICATE_LINK,
                    message=f"{self.name} and {name} dialled each other; the link "
                    f"{self.name} dialled stays",
                )
            if mine is not None:
                mine.fail(ErrorCode.DUPLICATE_LINK, "replaced", CloseReason.DUPLICATE_LINK)
        elif mine is not None:
            # It dialled again: it lost the old link, even if we have not noticed yet.
            mine.close(CloseReason.DUPLICATE_LINK)
        max_frame = max(MIN_MAX_FRAME, min(hello.max_frame, self.config.max_frame))
        welcome = Welcome(
            broker=self.name,
            slot=self.broker.routing.slot,
            max_frame=max_frame,
            listen=self.broker.advertised,
            tag=link.tag_in,
        )
        link.send(encode_control(ControlType.WELCOME, welcome, correlation))
        self._open_peer(link, hello.name, hello.listen, hello.slot, hello.tag, max_frame)
        return None

    def _welcomed(self, link: Link, welcome: Welcome) -> None:
        """WELCOME on a link this broker dialled."""
        name = welcome.broker
        existing = self.peers.get(name)
        if name == self.name:
            link.fail(ErrorCode.NAME_IN_USE, "that is this broker", CloseReason.REFUSED)
        elif existing is not None and incoming_link_wins(self.name, name):
            self.stats.duplicate_links += 1
            link.fail(
                ErrorCode.DUPLICATE_LINK, "the link you dialled stays", CloseReason.DUPLICATE_LINK
            )
        else:
            if existing is not None:
                self.stats.duplicate_links += 1
                existing.fail(ErrorCode.DUPLICATE_LINK, "replaced", CloseReason.DUPLICATE_LINK)
            self._open_peer(
                link, name, welcome.listen, welcome.slot, welcome.tag, welcome.max_frame
            )
        waiter = self._dial_waiters.pop(link, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(link.state is LinkState.OPEN)

    def _open_peer(
        self, link: Link, name: str, listen: str, slot: int, tag: int, max_frame: int
    ) -> None:
        link.state = LinkState.OPEN
        link.is_peer = True
        link.name = name
        link.listen = listen
        link.slot = slot
        link.tag_out = tag.to_bytes(4, "big")
        link.max_frame = max(MIN_MAX_FRAME, min(max_frame, self.config.max_frame))
        state = self.known.setdefault(name, BrokerInfo(name=name, address=listen))
        state.address = listen
        state.slot = slot
        self.broker.sync.send_snapshot(link)
        self.broker.guarantees.send_groups(link)
        self.peers[name] = link
        link.send(encode_control(ControlType.BROKERS, Brokers(brokers=self.brokers())))
        link.send(encode_control(ControlType.LOAD, self._load()))
        if not self.ready:
            self._snapshot_pending.add(link)
            self._snapshots_done.clear()
        self.lists_changed()
        log.info("peer linked", extra={"peer": name, "address": listen, "link": link.link_id})

    # -- frames from peers --------------------------------------------------------------------

    def on_peer_control(self, link: Link, ctype: int, correlation: int, body: Body | None) -> None:
        if link.state is LinkState.AWAIT_WELCOME:
            if isinstance(body, Welcome) and ctype == ControlType.WELCOME:
                self._welcomed(link, body)
            elif isinstance(body, Error):
                log.info(
                    "a broker refused our link", extra={"code": body.code, "error": body.message}
                )
                link.close(CloseReason.REFUSED)
            else:
                link.fail(ErrorCode.PROTOCOL_ERROR, "expected WELCOME", CloseReason.PROTOCOL_ERROR)
            return
        if body is not None:
            if ctype in PEER_FRAMES:
                self.broker.on_guarantee(link, ctype, correlation, body)
                return
            if (handler := _MESH_HANDLERS.get(ctype)) is not None:
                handler(self, link, correlation, body)
                return
            if (synced := _SYNC_HANDLERS.get(ctype)) is not None:
                synced(self.broker.sync, link, correlation, body)
                return
        log.warning("unexpected control frame from a peer", extra={"type": describe(ctype)})

    def snapshot_received(self, link: Link) -> None:
        """A peer's whole table has arrived (or the peer is gone): a joining broker waits
        for every peer's."""
        if link in self._snapshot_pending:
            self._snapshot_pending.discard(link)
            if not self._snapshot_pending:
                self._snapshots_done.set()

    def _on_load(self, link: Link, correlation: int, body: Body) -> None:
        assert isinstance(body, Load)
        state = self.known.get(link.name)
        if state is None:
            return
        changed = (state.ready, state.draining) != (body.ready, body.draining)
        state.connectors = body.connectors
        state.capacity = body.capacity
        state.ready = body.ready
        state.draining = body.draining
        state.slot = link.slot = body.slot
        self.broker.streams.peer_streams(link, body.streams)
        if changed:
            self.lists_changed()

    def _on_brokers(self, link: Link, correlation: int, body: Body) -> None:
        """Gossip: link to every broker we hear of and are not linked to."""
        assert isinstance(body, Brokers)
        now = self.broker.clock()
        for info in body.brokers:
            if info.name == self.name or info.name in self.peers:
                continue
            self.known[info.name] = info
            failed = self._dial_failed.get(info.address)
            # A joining broker dials us itself; we dial the ready ones we are missing.
            if (
                info.ready
                and self.ready
                and not self.draining
                and (failed is None or now - failed > _DIAL_COOLDOWN)
            ):
                self._spawn(self.dial(info.address, info.name), f"dial-{info.name}")
        self._gossip.set()

    def _on_ready(self, link: Link, correlation: int, body: Body) -> None:
        """A broker joined: hand it our share of connectors (the seed's join step)."""
        assert isinstance(body, Ready)
        state = self.known.get(link.name)
        if state is not None:
            state.ready = True
        self.lists_changed()
        if not self.draining:
            self.moves.share_with(link, body.counts)

    def _on_draining(self, link: Link, correlation: int, body: Body) -> None:
        state = self.known.get(link.name)
        if state is not None:
            state.draining = True
        self.lists_changed()

    def _on_bye(self, link: Link, correlation: int, body: Body) -> None:
        link.close(CloseReason.PEER_BYE)

    def _on_ping(self, link: Link, correlation: int, body: Body) -> None:
        self.broker.reply(link, ControlType.PONG, Empty(), correlation)

    def _ignore(self, link: Link, correlation: int, body: Body) -> None:
        pass

    # -- broker lists and load --------------------------------------------------------------------

    def lists_changed(self) -> None:
        """The mesh's membership or a broker's state changed: tell peers and connectors
        at the end of this loop turn (once, however many changes it saw)."""
        if not self._lists_scheduled:
            self._lists_scheduled = True
            asyncio.get_running_loop().call_soon(self._push_lists)

    def connector_list(self) -> list[BrokerInfo]:
        """The brokers a connector may fail over or be redirected to: ready, not draining."""
        return [s for s in self.brokers() if s.ready and not s.draining]

    def _connector_addresses(self) -> tuple[str, ...]:
        return tuple(sorted(b.address for b in self.connector_list()))

    def _push_lists(self) -> None:
        self._lists_scheduled = False
        self._send_all(ControlType.LOAD, self._load())
        self._send_all(ControlType.BROKERS, Brokers(brokers=self.brokers()))
        # Connectors only need to hear when the set of brokers changes, not every load.
        addresses = self._connector_addresses()
        if addresses != self._pushed:
            self._pushed = addresses
            frame = encode_control(ControlType.BROKERS, Brokers(brokers=self.connector_list()))
            for connector in self.broker.connectors:
                connector.send(frame)

    def _load(self) -> Load:
        s = self.self_state()
        return Load(
            connectors=s.connectors,
            capacity=s.capacity,
            slot=s.slot,
            ready=s.ready,
            draining=s.draining,
            streams=self.broker.streams.names(),
        )

    def load_changed(self) -> None:
        """Tell the peers now (the streams this broker hosts changed)."""
        self._send_all(ControlType.LOAD, self._load())

    def _send_all(self, type_: ControlType, body: Body) -> None:
        if self.peers:
            frame = encode_control(type_, body)
            for link in self.peers.values():
                link.send(frame)

    def connector_left(self) -> None:
        self.lists_changed()
        self.moves.connector_left()

    # -- losing a peer ----------------------------------------------------------------------------

    def peer_lost(self, link: Link, reason: CloseReason) -> None:
        leaving = self._leaving.pop(link, None)
        if leaving is not None and not leaving.done():
            leaving.set_result(None)
        waiter = self._dial_waiters.pop(link, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(False)
        self.snapshot_received(link)
        if not link.is_peer or self.peers.get(link.name) is not link:
            return  # never opened, or a duplicate that lost
        del self.peers[link.name]
        self.stats.peers_lost += 1
        self.broker.sync.peer_lost(link)
        reason_text = f"broker {link.name}, which had it, left the mesh while the request was out"
        for entry in self.broker.pending.drop_via(link):
            self.broker.tell_requester(entry, ControlType.NO_ROUTE, reason_text)
        state = self.known.pop(link.name, None)
        # A peer we said goodbye to, or that announced its drain, is leaving, whatever
        # way its link ends.
        graceful = (
            reason in _GRACEFUL or leaving is not None or (state is not None and state.draining)
        )
        if not graceful:
            self.stats.peers_crashed += 1
            self._boost_until = self.broker.clock() + self.config.boost_window
            log.warning(
                "peer broker lost; its services are withdrawn",
                extra={"peer": link.name, "reason": reason.value, "capacity": self.capacity},
            )
        self.lists_changed()

    # -- heartbeats -----------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        interval = self.config.heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            for link in list(self.peers.values()):
                if link.heard:
                    link.heard = False
                    link.misses = 0
                else:
                    link.misses += 1
                    if link.misses >= self.config.heartbeat_misses:
                        link.fail(
                            ErrorCode.PROTOCOL_ERROR,
                            f"no frame for {link.misses} heartbeat intervals",
                            CloseReason.HEARTBEAT_TIMEOUT,
                        )
            self._send_all(ControlType.LOAD, self._load())
            self.broker.guarantees.expire()
            self.broker.streams.expire()

    # -- drain and stop -------------------------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Stop taking connectors, tell the peers, move every connector to another broker,
        and wait until they have left or ``grace`` seconds passed."""
        if self.draining:
            return
        self.draining = True
        self._send_all(ControlType.DRAINING, Empty())
        self.lists_changed()
        await self.moves.move_all(grace)

    async def stop(self) -> None:
        """Say goodbye to every peer and stop the background work.

        After BYE this side only half-closes and waits (briefly) for each peer to close:
        closing at once, with the peer's heartbeats still unread here, makes the kernel
        reset the connection, and a reset can destroy the BYE before the peer reads it
        -- the peer would then take a clean stop for a crash."""
        self.broker.sync.flush_ops()
        frame = encode_control(ControlType.BYE, Bye(reason=f"broker {self.name} stopping"))
        links = list(self.peers.values())
        loop = asyncio.get_running_loop()
        for link in links:
            self._leaving[link] = loop.create_future()
            link.send(frame)
            link.half_close()
        if self._leaving:
            await asyncio.wait(self._leaving.values(), timeout=_BYE_TIMEOUT)
        for link in links:
            link.close(CloseReason.BROKER_SHUTDOWN)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


_MESH_HANDLERS = {
    int(ControlType.LOAD): Mesh._on_load,
    int(ControlType.BROKERS): Mesh._on_brokers,
    int(ControlType.READY): Mesh._on_ready,
    int(ControlType.DRAINING): Mesh._on_draining,
    int(ControlType.BYE): Mesh._on_bye,
    int(ControlType.PING): Mesh._on_ping,
    int(ControlType.PONG): Mesh._ignore,
}
_SYNC_HANDLERS = {
    int(ControlType.ROUTES): RouteSync.on_routes,
    int(ControlType.CLAIM): RouteSync.on_claim,
    int(ControlType.RELEASE): RouteSync.on_release,
    int(ControlType.OK): RouteSync.on_answer,
    int(ControlType.ERROR): RouteSync.on_answer,
    int(ControlType.NO_ROUTE): RouteSync.on_delivery_failure,
    int(ControlType.ROUTED): RouteSync.on_routed,
}
