"""The mesh: this broker's links to its peers, and the life of the mesh over time.

Membership is docs/mesh.md's: the join (the seed patent's steps: link to a seed,
learn the broker list, link to every broker, claim a dynamic-id slot, take every
peer's table, announce READY), duplicate links resolved at the handshake by one
rule on both ends (meshbus.broker.mesh.balance) after both brokers proved themselves
when the mesh trusts only its brokers (meshbus.broker.security.trust), heartbeats and the
capacity boost after a crash, and the drain. What it tells peers and connectors of
the mesh (LOAD, the broker lists) is meshbus.broker.mesh.gossip; moving connectors is
meshbus.broker.mesh.moves; what goes when a peer's link
closes is the broker's ordered cleanup (meshbus.broker.server): the mesh only
forgets the peer and counts a crash. Joins, drains, leaves and crashes are told to
``on_event`` as they happen (the telemetry records them: docs/report.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from meshbus.broker.config import BrokerConfig, PartitionHandling
from meshbus.broker.core.endpoint import CloseReason, Endpoint, PeerInfo
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import LinkRegistry, Peers
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.mesh.balance import incoming_link_wins, redirect_target
from meshbus.broker.mesh.dialer import Dialer, dial_tcp
from meshbus.broker.mesh.fence import Fence, MinorityRule, OutOfReach
from meshbus.broker.mesh.gossip import Gossip, Replication, checked_nats_address
from meshbus.broker.mesh.moves import Moves
from meshbus.broker.mesh.redial import RedialTable
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.security.trust import MeshTrust
from meshbus.errors import MeshbusError
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import (
    ROLE_BROKER,
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
from meshbus.protocol.handshake import HelloRefused, Welcomed, negotiated_max_frame
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.tls import failure_reason
from meshbus.util import BackgroundTasks, parse_hostport

log = logging.getLogger("meshbus.broker")

_DIAL_TIMEOUT = 5.0
# After BYE, how long a stopping broker waits for its peers to close their side.
_BYE_TIMEOUT = 1.0
_GRACEFUL = frozenset(
    {CloseReason.PEER_BYE, CloseReason.DUPLICATE_LINK, CloseReason.BROKER_SHUTDOWN}
)


class MeshJoinError(MeshbusError):
    """The broker could not join the mesh through any of its seeds."""


@dataclass(frozen=True)
class MeshEvent:
    """A change of the mesh as this broker saw it: ``kind`` is "join", "drain", "leave"
    (a goodbye) or "crash" (lost without one); ``broker`` is the broker it happened to,
    this one or a peer. A peer's closed link also has its close ``reason`` and how long
    the peer had been silent (``silent_for``, seconds): when it was last heard from."""

    kind: str
    broker: str
    reason: str | None = None
    silent_for: float | None = None


@dataclass
class MeshStats:
    duplicate_links: int = 0
    peers_lost: int = 0
    peers_crashed: int = 0
    moves_sent: int = 0


class Mesh:
    def __init__(
        self,
        *,
        config: BrokerConfig,
        clock: Callable[[], float],
        peers: Peers,
        links: LinkRegistry,
        routing: RoutingTable[Endpoint],
        sync: RouteSync,
        outbox: Outbox,
        trust: MeshTrust,
        new_peer_link: Callable[[], Link],
        greet_peer: Callable[[Link], None],
        on_ready: Callable[[], None],
        on_event: Callable[[MeshEvent], None],
        hosted_streams: Callable[[], list[str]],
        nats_changed: Callable[[list[str]], None] = lambda urls: None,
        replication: Callable[[], Replication] = lambda: (0, [], ""),
        dialer: Dialer = dial_tcp,
        rng: random.Random | None = None,
    ) -> None:
        """``trust`` makes the handshake of each link this broker dials (its proofs, when
        the mesh trusts only its brokers); ``new_peer_link`` makes the link for a broker
        this one dials; ``greet_peer``
        sends a newly linked peer what it must know first (routes, group bindings);
        ``on_ready`` runs once the broker takes connectors; ``on_event`` hears of every
        ``MeshEvent``; ``hosted_streams`` are announced in LOAD; ``nats_changed`` hears
        the NATS addresses of the peers that take NATS clients, whenever they change
        (meshbus.broker.mesh.gossip.nats_urls); ``replication`` is what LOAD says for
        replicated streams (meshbus.broker.mesh.gossip.Gossip)."""
        self.config = config
        self._clock = clock
        self.peers = peers
        self._links = links
        self._routing = routing
        self._sync = sync
        self._outbox = outbox
        self._trust = trust
        self._new_peer_link = new_peer_link
        self._greet_peer = greet_peer
        self._on_ready = on_ready
        self._on_event = on_event
        self._dialer = dialer
        # Every other broker we know of: from its handshake, its LOAD frames and gossip.
        self.known: dict[str, BrokerInfo] = {}
        self.stats = MeshStats()
        self.ready = False
        self.draining = False
        self._dialling: dict[str, str] = {}  # address -> expected name ("" unknown)
        # The last link refused for a reason dialling again cannot mend -- a proof either
        # way (AUTH_FAILED), or our name taken (NAME_IN_USE): a join stops on it.
        self._join_refusal = ""
        self._dial_waiters: dict[Link, asyncio.Future[bool]] = {}
        # Brokers to link to and not linked to (meshbus.broker.mesh.redial): lost peers, brokers
        # heard of in gossip, and the seeds while this broker is alone.
        interval = config.heartbeat_interval
        self.redials = RedialTable(
            base=interval / 2, cap=2 * interval, forget_after=config.peer_forget, rng=rng
        )
        self.redials.add_seeds(config.seeds, clock())
        self.fence = Fence(clock, config.heartbeat_budget, self.redials)
        # A peer's list is at most a budget behind (it has not noticed a crash yet), and
        # comes once an interval.
        self.out_of_reach = OutOfReach(clock, ttl=config.heartbeat_budget + interval)
        self.minority = MinorityRule(
            name=lambda: self.name,
            enabled=config.partition_handling is PartitionHandling.PAUSE_MINORITY,
            redials=self.redials,
            peers=peers,
            links=links,
        )
        self.gossip = Gossip(
            peers=peers,
            links=links,
            brokers=self.brokers,
            hosted_streams=hosted_streams,
            nats_changed=nats_changed,
            replication=replication,
        )
        self._gossip = asyncio.Event()
        self._boost_until = 0.0
        self.moves = Moves(clock, links, self.stats)
        self._leaving: dict[Link, asyncio.Future[None]] = {}  # peers told BYE, not yet closed
        self._tasks = BackgroundTasks()

    # -- identity and capacity ------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def capacity(self) -> int:
        """The current connector limit: raised for a while after a peer crashed."""
        limit = self.config.max_connectors
        if self._clock() < self._boost_until:
            return math.ceil(limit * self.config.capacity_boost)
        return limit

    def self_state(self) -> BrokerInfo:
        return BrokerInfo(
            name=self.name,
            address=self.config.advertise,
            slot=self._routing.slot,
            connectors=len(self._links.connectors),
            capacity=self.capacity,
            ready=self.ready,
            draining=self.draining,
            nats=self.config.nats_advertise,
            zone=self.config.zone,
        )

    def brokers(self) -> list[BrokerInfo]:
        """This broker and the brokers it is linked to, itself first: first-hand knowledge,
        and all it gossips, offers to connectors, redirects to or moves connectors to.

        ``known`` also holds brokers only heard of through gossip: candidates to dial,
        never targets. Gossip can be stale -- a peer that has not yet noticed a crash
        still lists the dead broker -- and a target that is gone would cost a connector
        its redirect or move."""
        return [self.self_state(), *self.peer_states()]

    def peer_states(self) -> list[BrokerInfo]:
        """The brokers this one is linked to, as they last told it (their LOAD)."""
        return [self.known[n] for n in self.peers if n in self.known]

    # -- start: a new mesh, or a join through seeds ------------------------------------

    def found(self) -> None:
        """Start a new mesh of one: slot 1, ready at once."""
        self._routing.slot = self.config.slot
        self._became_ready()

    def _became_ready(self) -> None:
        self.ready = True
        # Before on_ready, which starts the telemetry: its first record has the join.
        self._on_event(MeshEvent("join", self.name))
        self._on_ready()
        self.gossip.started()

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
                if self._join_refusal:
                    raise MeshJoinError(f"could not join the mesh: {self._join_refusal}")
                if loop.time() >= deadline:
                    raise MeshJoinError(
                        "could not join the mesh: no seed answered ("
                        + ", ".join(seeds)
                        + "); is a broker running there?"
                    )
                await asyncio.sleep(0.2)
        # The seed sends its broker list right after the handshake.
        try:
            await asyncio.wait_for(self._gossip.wait(), max(0.1, deadline - loop.time()))
        except TimeoutError:
            raise MeshJoinError("the seed did not send the broker list") from None
        others = [
            s.address for s in self.known.values() if s.name not in self.peers and not s.draining
        ]
        await asyncio.gather(*(self.dial(address) for address in others))
        known_slots = {s.slot for s in self.known.values()}
        self._routing.slot = await self._sync.claim_slot(known_slots, self.name)
        try:
            await asyncio.wait_for(self._sync.wait_snapshots(), max(0.1, deadline - loop.time()))
        except TimeoutError:
            raise MeshJoinError("peers did not send their routing tables in time") from None
        self._became_ready()
        counts = {s.name: s.connectors for s in self.brokers() if not s.draining}
        self.gossip.send_all(ControlType.READY, Ready(counts=counts))
        self.gossip.changed()
        log.info("joined the mesh", extra={"broker": self.name, "peers": sorted(self.peers)})

    # -- dialling and handshakes ---------------------------------------------------------

    async def dial(self, address: str, expected: str = "") -> bool:
        """Link to the broker at ``address``; True once the link is open (or was already)."""
        if address == self.config.advertise or address in self._dialling:
            return False
        if any(
            link.peer is not None and link.peer.listen == address for link in self.peers.links()
        ):
            return True
        loop = asyncio.get_running_loop()
        self._dialling[address] = expected
        try:
            host, port = parse_hostport(address)
            async with asyncio.timeout(_DIAL_TIMEOUT):
                link = await self._dialer(host, port, self._new_peer_link)
                opened: asyncio.Future[bool] = loop.create_future()
                self._dial_waiters[link] = opened
                hello = Hello(
                    role=ROLE_BROKER,
                    name=self.name,
                    max_frame=self.config.max_frame,
                    listen=self.config.advertise,
                    slot=self._routing.slot,
                    tag=link.link_id,
                    nats=self.config.nats_advertise,
                )
                link.dial(self._trust.dialling(hello))
                return await opened
        except (OSError, TimeoutError, ValueError) as exc:
            self.redials.failed(expected, address, self._clock())
            for name, info in list(self.known.items()):
                if info.address == address and name not in self.peers:
                    del self.known[name]  # heard of, but not there
            # A TLS failure is a setup to fix (a CA, a name, a date), not a broker that is down.
            level, error = (
                (logging.WARNING, failure_reason(exc))
                if isinstance(exc, ssl.SSLError)
                else (logging.INFO, str(exc))
            )
            log.log(level, "could not link to a broker", extra={"address": address, "error": error})
            return False
        finally:
            self._dialling.pop(address, None)

    def accept_peer(self, link: Link, hello: Hello) -> Error | None:
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
        max_frame = negotiated_max_frame(hello.max_frame, self.config.max_frame)
        welcome = Welcome(
            broker=self.name,
            slot=self._routing.slot,
            max_frame=max_frame,
            listen=self.config.advertise,
            tag=link.link_id,
            nats=self.config.nats_advertise,
        )
        assert link.accepting is not None
        link.send(link.accepting.welcome(welcome))
        self._open_peer(
            link, hello.name, hello.listen, hello.slot, hello.tag, max_frame, hello.nats
        )
        return None

    def on_answer(self, link: Link, answer: Welcomed | HelloRefused) -> None:
        """The answer to the HELLO of a link this broker dialled."""
        if isinstance(answer, Welcomed):
            self._welcomed(link, answer.welcome)
            return
        if answer.code == ErrorCode.NAME_IN_USE:
            # Our --name is taken: dialling again, or another seed, cannot help.
            self._join_refusal = answer.message
            log.warning("a broker refused our name", extra={"error": answer.message})
        elif answer.code != ErrorCode.AUTH_FAILED:
            log.info(
                "a broker refused our link", extra={"code": answer.code, "error": answer.message}
            )
        elif answer.local:
            # It did not prove itself: nothing more was sent to it, nor will be.
            self._join_refusal = f"the broker at {link.remote}: {answer.message}"
            log.warning("did not link to an unproven broker", extra={"error": self._join_refusal})
        else:
            self._join_refusal = f"the broker at {link.remote} refused this one: {answer.message}"
            log.warning("a broker refused our proof", extra={"error": self._join_refusal})
        link.close(CloseReason.REFUSED)

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
                link,
                name,
                welcome.listen,
                welcome.slot,
                welcome.tag,
                welcome.max_frame,
                welcome.nats,
            )
        waiter = self._dial_waiters.pop(link, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(link.is_peer)

    def _open_peer(
        self, link: Link, name: str, listen: str, slot: int, tag: int, max_frame: int, nats: str
    ) -> None:
        info = PeerInfo(
            listen=listen,
            slot=slot,
            tag_in=link.link_id,
            tag_out=tag.to_bytes(4, "big"),
            clock=self._clock,
            budget=self.config.heartbeat_budget,
        )
        link.open_as_peer(name, info, negotiated_max_frame(max_frame, self.config.max_frame))
        state = self.known.setdefault(name, BrokerInfo(name=name, address=listen))
        state.address = listen
        state.slot = slot
        state.nats = checked_nats_address(name, nats)
        self.redials.linked(name, listen)
        self.out_of_reach.forget(name)
        self._greet_peer(link)
        self.peers.add(link)
        self.gossip.greet(link)
        if not self.ready:
            self._sync.expect_snapshot(link)
        self.gossip.changed()
        log.info("peer linked", extra={"peer": name, "address": listen, "link": link.link_id})

    # -- frames from peers --------------------------------------------------------------------

    def on_load(self, link: Link, body: Load) -> None:
        state = self.known.get(link.name)
        if state is None or link.peer is None:
            return
        changed = (state.ready, state.draining) != (body.ready, body.draining)
        state.connectors = body.connectors
        state.capacity = body.capacity
        state.ready = body.ready
        state.draining = body.draining
        state.zone = body.zone
        state.slot = link.peer.slot = body.slot
        link.peer.loaded(body)
        if changed:
            self.gossip.changed()

    def on_brokers(self, link: Link, correlation: int, body: Brokers) -> None:
        """Gossip (with every heartbeat): every ready broker we hear of and are not linked
        to becomes a candidate to dial (a joining broker dials us itself), and is out of
        reach rather than gone while a peer names it; one that announces its drain is
        leaving."""
        now = self._clock()
        for info in body.brokers:
            if info.name == self.name or info.name in self.peers:
                continue
            self.known[info.name] = info
            if info.draining:
                self.redials.left(info.name)
                self.out_of_reach.forget(info.name)
            elif info.ready:
                self.redials.want(info.name, info.address, now)
                self.out_of_reach.seen(info.name)
        self._gossip.set()
        self._dial_due()

    def _dial_due(self) -> None:
        """Dial the candidates whose time has come (meshbus.broker.mesh.redial)."""
        if not self.ready or self.draining:
            return
        for candidate in self.redials.due(self._clock(), isolated=not self.peers):
            name = candidate.name or candidate.address
            self._tasks.spawn(self.dial(candidate.address, candidate.name), f"dial-{name}")

    def on_ready(self, link: Link, correlation: int, body: Ready) -> None:
        """A broker joined: hand it our share of connectors (the seed's join step)."""
        state = self.known.get(link.name)
        if state is not None:
            state.ready = True
        self._on_event(MeshEvent("join", link.name))
        self.gossip.changed()
        if not self.draining:
            self.moves.share_with(link, body.counts, self.name)

    def on_draining(self, link: Link, correlation: int, body: Empty) -> None:
        state = self.known.get(link.name)
        if state is not None:
            state.draining = True
        self._on_event(MeshEvent("drain", link.name))
        self.gossip.changed()

    def on_bye(self, link: Link, correlation: int, body: Bye) -> None:
        link.close(CloseReason.PEER_BYE)

    def on_ping(self, link: Link, correlation: int, body: Empty) -> None:
        self._outbox.reply(link, ControlType.PONG, Empty(), correlation)

    def on_pong(self, link: Link, correlation: int, body: Empty) -> None:
        pass  # a peer's answer to our PING: hearing it is all it is for

    # -- taking connectors ---------------------------------------------------------

    def refusal(self, connectors: int) -> str:
        """Why a new connector is refused now (with ``connectors`` linked), or "" if it is
        welcome."""
        if self.draining:
            return f"broker {self.name} is draining"
        if not self.ready:
            return f"broker {self.name} is still joining the mesh"
        if connectors >= self.capacity:
            return f"broker {self.name} is full ({self.capacity} connectors)"
        return self.minority.refusal()

    def redirect(self) -> str:
        """A broker with room for a connector this one refuses."""
        return redirect_target(self.brokers(), exclude=self.name)

    def connector_left(self) -> None:
        self.gossip.changed()
        self.moves.connector_left()

    # -- losing a peer ----------------------------------------------------------------------------

    def link_closed(self, link: Link, reason: CloseReason) -> bool:
        """A link closed: True if it was the open link to a peer broker, which is then
        forgotten (a crash, unless it said goodbye or was draining, raises capacity)."""
        leaving = self._leaving.pop(link, None)
        if leaving is not None and not leaving.done():
            leaving.set_result(None)
        waiter = self._dial_waiters.pop(link, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(False)
        if not link.is_peer or not self.peers.remove(link):
            return False  # never opened, or a duplicate that lost
        peer = link.peer
        assert peer is not None
        self.stats.peers_lost += 1
        if reason is CloseReason.STALLED:
            self.fence.stalled()
        state = self.known.pop(link.name, None)
        # A peer we said goodbye to, or that announced its drain, is leaving, whatever
        # way its link ends.
        graceful = (
            reason in _GRACEFUL or leaving is not None or (state is not None and state.draining)
        )
        if reason is CloseReason.DUPLICATE_LINK or not graceful:
            # Replaced by another link, or lost without a goodbye: it may be back (or
            # be reachable again) at any moment, and one of us must dial.
            self.redials.want(link.name, peer.listen, self._clock())
        else:
            self.redials.left(link.name)
            self.out_of_reach.forget(link.name)
        # Not a link replaced (the peer is still linked) nor one this broker said
        # goodbye to (this broker is the one leaving).
        if reason is not CloseReason.DUPLICATE_LINK and leaving is None:
            kind = "leave" if graceful else "crash"
            self._on_event(MeshEvent(kind, link.name, reason.value, peer.silence()))
        if not graceful:
            self.stats.peers_crashed += 1
            if self.peers:
                # Until the other peers' lists say whether they still reach it, it is out
                # of reach, not gone: no group homed at it is bound afresh here. (With no
                # other peer, nobody could reach it: it is gone.)
                self.out_of_reach.seen(link.name)
            self.minority.peer_lost()
            self._boost_until = self._clock() + self.config.boost_window
            # Every broker linked to it logs this: the line says which one does.
            log.warning(
                "peer broker lost; its services are withdrawn",
                extra={
                    "broker": self.name,
                    "peer": link.name,
                    "reason": reason.value,
                    "capacity": self.capacity,
                },
            )
        self.gossip.changed()
        return True

    # -- heartbeats -----------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Once per ``heartbeat_interval``: the candidates due are dialled; a peer silent
        for ``heartbeat_misses`` intervals is dead (and a candidate from the next
        interval on); every peer gets our LOAD (which is our heartbeat) and our list of
        brokers."""
        self._dial_due()
        for link in self.peers.links():
            peer = link.peer
            assert peer is not None
            silence = peer.silence()
            if silence > peer.budget:
                link.fail(
                    ErrorCode.PROTOCOL_ERROR,
                    f"no frame for {silence:.1f} s (the budget is {peer.budget:g} s)",
                    CloseReason.HEARTBEAT_TIMEOUT,
                )
        self.gossip.heartbeat()

    # -- drain and stop -------------------------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Stop taking connectors, tell the peers, move every connector to another broker,
        and wait until they have left or ``grace`` seconds passed."""
        if self.draining:
            return
        self.draining = True
        self._on_event(MeshEvent("drain", self.name))
        self.gossip.send_all(ControlType.DRAINING, Empty())
        self.gossip.changed()
        await self.moves.move_all(self.name, self.brokers(), grace)

    async def stop(self) -> None:
        """Say goodbye to every peer and stop the background work.

        After BYE this side only half-closes and waits (briefly) for each peer to close:
        closing at once, with the peer's heartbeats still unread here, makes the kernel
        reset the connection, and a reset can destroy the BYE before the peer reads it
        -- the peer would then take a clean stop for a crash."""
        self._sync.flush_ops()
        frame = encode_control(ControlType.BYE, Bye(reason=f"broker {self.name} stopping"))
        links = self.peers.links()
        loop = asyncio.get_running_loop()
        for link in links:
            self._leaving[link] = loop.create_future()
            link.send(frame)
            link.half_close()
        if self._leaving:
            await asyncio.wait(self._leaving.values(), timeout=_BYE_TIMEOUT)
        for link in links:
            link.close(CloseReason.BROKER_SHUTDOWN)
        await self._tasks.cancel()
