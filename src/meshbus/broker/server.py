"""The broker: where its parts are built and wired, and where start, stop, drain and the
ordered cleanup of a closed link live.

Every part takes in its constructor the parts it uses, and nothing else; the
broker is the only place that sees them all (docs/architecture.md draws them).
Everything runs on one event loop thread and never awaits inside frame
handling, so a routing change made by a control frame is visible to the very
next frame of the same read -- that is what keeps a REGISTER followed by a send
from the new address in order (a REGISTER that must wait for the mesh blocks
its link instead; see meshbus.broker.handlers.services).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import gc
import logging
import random
import ssl
import time
from collections.abc import Callable

from meshbus.address import SUBJECTS
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.captures import STREAM_SERVERS, LostCaptures
from meshbus.broker.core.dispatch import ControlDispatch
from meshbus.broker.core.endpoint import CloseReason, Endpoint, LinkRole, is_peer
from meshbus.broker.core.forward import Forwarder
from meshbus.broker.core.interest import LocalInterest, PeerInterest, PeerSubscription
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox, TrafficStats
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.registry import LinkRegistry, Peers
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.slices import Slices
from meshbus.broker.core.subjects import SubjectTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.core.watch import ServiceWatch
from meshbus.broker.handlers.admission import Admission
from meshbus.broker.handlers.guarantees import Guarantees
from meshbus.broker.handlers.operator import OperatorCommands
from meshbus.broker.handlers.services import ServiceCommands
from meshbus.broker.mesh.dialer import Dialer, dial_tcp
from meshbus.broker.mesh.groups import GroupTable
from meshbus.broker.mesh.membership import Mesh
from meshbus.broker.mesh.relay import Relay
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.nats.auth import NatsSignIn
from meshbus.broker.nats.bridge import MeshbusBridge
from meshbus.broker.nats.connection import Subscription
from meshbus.broker.nats.interest import NatsInterest
from meshbus.broker.nats.listener import NatsListener
from meshbus.broker.nats.peers import PeerMessages
from meshbus.broker.nats.router import NatsRouter
from meshbus.broker.nats.services import ServiceSubjects
from meshbus.broker.observe.lag import LoopLag
from meshbus.broker.observe.nats import NatsView
from meshbus.broker.observe.stat import StatView
from meshbus.broker.observe.telemetry import Telemetry
from meshbus.broker.security.acceptor import TLSAcceptor
from meshbus.broker.security.handshakes import evicted_why, source_of
from meshbus.broker.security.signin import SignIn
from meshbus.broker.security.trust import MeshTrust
from meshbus.broker.security.users import UserTable
from meshbus.broker.streams.host import StreamHost
from meshbus.broker.streams.requests import StreamRequests
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import (
    OP_REMOVE,
    AddressBody,
    Brokers,
    Bye,
    Claim,
    DeliveryFailure,
    Drain,
    Empty,
    Error,
    GroupBind,
    GroupEnd,
    Groups,
    Hello,
    Load,
    Membership,
    MembersRequest,
    NatsMessages,
    RaftFrame,
    Ready,
    Register,
    Relayed,
    Routed,
    Routes,
    StatRequest,
    StreamRequest,
    SubjectInterest,
    TraceReport,
)
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.tls import dial_context, server_context
from meshbus.util import BackgroundTasks

__all__ = ["Broker", "BrokerConfig"]

log = logging.getLogger("meshbus.broker")

_C = ControlType
_CONNECTOR, _OPERATOR, _PEER = (
    LinkRole.CONNECTOR,
    LinkRole.OPERATOR,
    LinkRole.PEER,
)


# A link that held this many routes (services and memberships) gives their memory back
# to the system when it closes (docs/architecture.md, the limits).
_RELEASE_AFTER = 4096
# Services of a closed link withdrawn at once; a link with more withdraws the rest in
# slices (``_withdraw_rest``).
_WITHDRAW_STEP = 1_000


def _release_memory() -> None:
    """Hand the heap's free pages back to the system: the routing table's freed dicts and
    keys otherwise stay in the process's RSS.

    First a full collection, for what it does besides collecting: it empties the
    interpreter's free lists (tuples, dicts, ...). Thousands of freed blocks held there,
    scattered over pymalloc's arenas, kept 40 of them (40 MB) alive after a connector with
    200,000 services left; emptied, the arenas go back to the system. It is cheap here:
    the tables keep the collector's work small (routing.py, "What the collector sees").
    Then glibc's ``malloc_trim`` (elsewhere nothing) for the large blocks."""
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(0)
    except (AttributeError, OSError):
        pass


# How often the loop's lag is sampled: 50 wake-ups a second cost nothing measurable, and
# a stall anywhere between two of them shows in full.
_LAG_INTERVAL = 0.02


class Broker:
    def __init__(
        self,
        config: BrokerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        dialer: Dialer | None = None,
        rng: random.Random | None = None,
        reread_users: Callable[[], UserTable] | None = None,
    ) -> None:
        """``clock`` is the broker's time (deadlines, heartbeats, expiries); ``dialer``
        opens its links to other brokers (by default TCP, with TLS when the config has a
        certificate); ``rng`` makes every random choice (anycast picks, group members,
        redial jitter, claim backoff). Tests give fakes of the first two and a seeded
        ``rng``, so a simulation runs the same every time. ``reread_users`` reads the
        users from the config file again, for a reload (``SignIn.reload``); None without
        a config file.

        With ``config.tls_cert`` the certificate, key and CA files are loaded here: a
        file that is missing or does not load raises ``meshbus.TLSError`` naming it. A
        mesh that trusts only its brokers without a key pair of this broker's is
        ``meshbus.InvalidArgument`` (meshbus.broker.security.trust)."""
        config = self.config = config or BrokerConfig()
        self.trust = MeshTrust(config)
        rng = rng or random.Random()
        self.clock = clock
        self.stats = TrafficStats()
        self.lag = LoopLag()
        self.links = LinkRegistry(config.max_handshaking_per_source)
        self.tls: TLSAcceptor | None = None
        tls_context: ssl.SSLContext | None = None
        if config.tls_cert:
            cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
            tls_context = server_context(cert, key, ca)
            self.tls = TLSAcceptor(
                tls_context,
                timeout=config.handshake_timeout,
                max_handshaking=config.max_handshaking,
                require_cert=config.tls_verify_clients,
                links=self.links,
                new_link=self.new_link,
                evict=self._evict,
            )
            dialer = dialer or functools.partial(dial_tcp, tls=dial_context(cert, key, ca))
        self.peers = Peers()
        # No slot until the mesh grants one (Mesh.found or Mesh.join): no dynamic ids before.
        self.routing: RoutingTable[Endpoint] = RoutingTable(slot=0, is_remote=is_peer, rng=rng)
        self.pending: PendingTable[Endpoint] = PendingTable(config.max_requests)
        self.usage = UsageTable(lambda: self.sign_in.users, self.routing)
        self.outbox = Outbox(self.stats)
        self.relay = Relay(self.outbox)
        self.watch = ServiceWatch(self.outbox)
        # NATS clients (docs/nats.md): their subject-interest table -- this broker's
        # clients' subscriptions and its peers' interest -- and their delivery, on every
        # broker (a meshbus multicast reaches the mesh's NATS clients from wherever it is
        # sent); the listener only with --nats-listen.
        self.subjects: SubjectTable[Subscription | PeerSubscription[Link]] = SubjectTable()
        nats_entries = config.max_connectors * config.max_services
        self.local_interest = LocalInterest()
        self.peer_interest: PeerInterest[Link] = PeerInterest(
            self.subjects,
            max_per_peer=nats_entries,
            max_weight=nats_entries,
            changed=lambda pattern: self.nats_bridge.interest_changed(pattern),
        )
        self.lost_captures = LostCaptures()
        self.sync = RouteSync(
            config, self.peers, self.routing, self.outbox, self.watch, rng,
            self.local_interest, self.peer_interest, self.lost_captures,
        )  # fmt: skip
        self.nats_peers = PeerMessages(self.sync.flush_ops)
        self.nats_router = NatsRouter(
            self.subjects, self.nats_peers, rng,
            to_meshbus=lambda message: self.nats_bridge.from_nats(message),
            reaches_meshbus=lambda subject: self.nats_bridge.reaches(subject),
        )  # fmt: skip
        self.nats_bridge = MeshbusBridge(
            routing=self.routing, pending=self.pending, outbox=self.outbox,
            match=self.subjects.match, deliver=self.nats_router.route,
            flush=self.nats_router.flushes.flush, deadline=self._deadline,
            announce=self.sync.announce,
        )  # fmt: skip
        self.guarantees = Guarantees(
            name=lambda: config.name,
            groups=GroupTable(config.group_expiry, config.group_grace, rng),
            routing=self.routing,
            peers=self.peers,
            relay=self.relay,
            outbox=self.outbox,
            clock=clock,
            fenced=lambda: self.mesh.fence.fenced(),
            out_of_reach=lambda: self.mesh.out_of_reach.names(),
            lost_captures=self.lost_captures,
        )

        def ready_brokers() -> dict[str, str]:
            return {b.name: b.zone for b in self.mesh.brokers() if b.ready and not b.draining}

        self.streams = StreamHost(
            config=config,
            routing=self.routing,
            sync=self.sync,
            outbox=self.outbox,
            usage=self.usage,
            hosted_changed=lambda: self.mesh.gossip.load_changed(),
            may_capture=lambda owner, group: self.sign_in.may_capture(owner, group),
            peers=self.peers,
            ready_brokers=ready_brokers,
            randomness=rng,
        )
        self.stream_requests = StreamRequests(
            streams=self.streams,
            config=config,
            sync=self.sync,
            relay=self.relay,
            outbox=self.outbox,
            usage=self.usage,
            peers=self.peers,
            ready_brokers=ready_brokers,
        )
        self.telemetry = Telemetry(
            config=config,
            streams=self.streams,
            links=self.links,
            routing=self.routing,
            pending=self.pending,
            counters=self.traffic_counters,
            peers=lambda: self.mesh.peer_states(),
        )
        self.forwarder = Forwarder(
            self.routing,
            self.pending,
            self.outbox,
            self.stats,
            self._deadline,
            self.telemetry.hop,
            self.usage,
            multicast_tap=self._multicast_tap,
        )
        self.dispatch = ControlDispatch(self.outbox)
        self.mesh = Mesh(
            config=config,
            clock=clock,
            peers=self.peers,
            links=self.links,
            routing=self.routing,
            sync=self.sync,
            outbox=self.outbox,
            trust=self.trust,
            new_peer_link=functools.partial(self.new_link, dialled=True),
            greet_peer=self._greet_peer,
            on_ready=self._became_ready,
            on_event=self.telemetry.mesh_event,
            hosted_streams=self.streams.names,
            nats_changed=self._nats_peers_changed,
            replication=self.streams.advertised,
            dialer=dialer or dial_tcp,
            rng=rng,
        )
        self.sign_in = SignIn(
            config.users,
            self.links,
            reread=reread_users,
            reloaded=self._reloaded,
        )
        # The subscriptions of NATS clients and of meshbus services, into the subject
        # table and to the peers.
        self.nats_interest = NatsInterest(
            self.subjects, self.local_interest, self.sync.announce,
            self.sync.after_confirmed, self.nats_bridge.interest_changed,
        )  # fmt: skip
        # Meshbus services on subjects, beside the NATS clients (docs/nats.md).
        self.service_subjects = ServiceSubjects(
            max_subjects=config.max_subjects,
            routing=self.routing,
            interest=self.nats_interest,
            outbox=self.outbox,
            answer=lambda link, type_, body, correlation, changed: self.services.answer(
                link, type_, body, correlation, changed
            ),
            publish=self.nats_router.publish_from_service,
            flush_nats=self.nats_router.flushes.flush,
            source=self.nats_bridge.source,
        )
        self.nats: NatsListener | None = None
        if config.nats_listen:
            nats_sign_in = NatsSignIn(
                self.sign_in,
                tls=tls_context,
                tls_verify=config.tls_verify_clients,
                timeout=config.handshake_timeout,
            )
            self.nats = NatsListener(
                config, self.nats_interest, self.nats_router, nats_sign_in, rng
            )
        self.stat = StatView(
            config=config,
            routing=self.routing,
            links=self.links,
            peers=self.peers,
            mesh=self.mesh,
            sync_stats=self.sync.stats,
            streams=self.streams,
            groups=self.guarantees.groups,
            lag=self.lag,
            pending=self.pending,
            counters=self.traffic_counters,
            reloads=self.sign_in.reloads,
            usage=self.usage,
            nats=NatsView(
                listener=self.nats,
                router=self.nats_router,
                peer_stats=self.nats_peers.stats,
                bridge_stats=self.nats_bridge.stats,
                services=self.service_subjects,
            ),
        )
        self.admission = Admission(
            config=config,
            routing=self.routing,
            mesh=self.mesh,
            links=self.links,
            sign_in=self.sign_in,
            usage=self.usage,
            trust=self.trust,
            trace_every=self.telemetry.trace_every,
        )
        self.services = ServiceCommands(
            config=config,
            routing=self.routing,
            sync=self.sync,
            peers=self.peers,
            watch=self.watch,
            outbox=self.outbox,
            usage=self.usage,
            rng=rng,
            service_left=self.service_subjects.service_left,
        )
        self.operator = OperatorCommands(
            outbox=self.outbox,
            snapshot=self.stat.brief,
            detailed_snapshot=self.stat.detailed,
            request_drain=self.request_drain,
        )
        self.dispatch.handshake_to(self.admission.on_handshake)
        self._install_handlers()
        self.address = ""
        self.drain_requested = asyncio.Event()
        self._drain_grace: float | None = None
        self._server: asyncio.Server | None = None
        self._tasks = BackgroundTasks()

    def _install_handlers(self) -> None:
        """Who may send which control frame on an open link, with its body class, and who
        handles it (meshbus.broker.core.dispatch). A (role, type) missing here is refused;
        a permission check goes in front of a row. A link still handshaking has no role:
        its frames go to ``Admission.on_handshake``."""
        on = self.dispatch.on
        admission, services, operator = self.admission, self.services, self.operator
        guarantees, streams, mesh, sync = self.guarantees, self.streams, self.mesh, self.sync
        # What connectors and operators both may ask.
        for role in (_CONNECTOR, _OPERATOR):
            on(role, _C.HELLO, Hello, admission.on_second_hello)
            on(role, _C.STAT, StatRequest, operator.on_stat)
            on(role, _C.PING, Empty, operator.on_ping)
            on(role, _C.BYE, Bye, operator.on_bye)
            on(role, _C.DRAIN, Drain, operator.on_drain)
            on(role, _C.MEMBERS, MembersRequest, guarantees.on_members)
            on(role, _C.WATCH, Empty, self.watch.on_watch)
            on(role, _C.STREAM, StreamRequest, self.stream_requests.on_request)
        # Connectors only.
        on(_CONNECTOR, _C.REGISTER, Register, services.on_register)
        on(_CONNECTOR, _C.UNREGISTER, AddressBody, services.on_unregister)
        on(_CONNECTOR, _C.JOIN, Membership, services.on_join)
        on(_CONNECTOR, _C.LEAVE, Membership, services.on_leave)
        on(_CONNECTOR, _C.GROUP_BIND, GroupBind, guarantees.on_bind)
        on(_CONNECTOR, _C.GROUP_END, GroupEnd, guarantees.on_end)
        on(_CONNECTOR, _C.TRACE, TraceReport, self.telemetry.on_trace)
        on(_CONNECTOR, _C.SUBSCRIBE, SubjectInterest, self.service_subjects.on_subscribe)
        on(_CONNECTOR, _C.UNSUBSCRIBE, SubjectInterest, self.service_subjects.on_unsubscribe)
        # Peer brokers.
        on(_PEER, _C.HELLO, Hello, admission.on_second_hello)
        on(_PEER, _C.LOAD, Load, self._on_load)
        on(_PEER, _C.BROKERS, Brokers, mesh.on_brokers)
        on(_PEER, _C.READY, Ready, mesh.on_ready)
        on(_PEER, _C.DRAINING, Empty, mesh.on_draining)
        on(_PEER, _C.BYE, Bye, mesh.on_bye)
        on(_PEER, _C.PING, Empty, mesh.on_ping)
        on(_PEER, _C.PONG, Empty, mesh.on_pong)
        on(_PEER, _C.ROUTES, Routes, sync.on_routes)
        on(_PEER, _C.ROUTED, Routed, sync.on_routed)
        on(_PEER, _C.CLAIM, Claim, sync.on_claim)
        on(_PEER, _C.RELEASE, Claim, sync.on_release)
        on(_PEER, _C.OK, Empty, sync.on_answer)
        on(_PEER, _C.ERROR, Error, sync.on_answer)
        on(_PEER, _C.NO_ROUTE, DeliveryFailure, self.forwarder.on_peer_no_route)
        on(_PEER, _C.GROUP_BIND, GroupBind, guarantees.on_bind)
        on(_PEER, _C.GROUP_END, GroupEnd, guarantees.on_end)
        on(_PEER, _C.GROUPS, Groups, guarantees.on_groups)
        on(_PEER, _C.RELAYED, Relayed, self.relay.on_relayed)
        on(_PEER, _C.STREAM, StreamRequest, self.stream_requests.on_request)
        on(_PEER, _C.RAFT, RaftFrame, streams.on_raft)
        on(_PEER, _C.NATS_MSGS, NatsMessages, self.nats_router.from_peer)

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Listen, then found a new mesh or join one through the seeds (MeshJoinError if
        it cannot). Peers can link while it joins; connectors are taken once it is ready,
        and NATS clients (--nats-listen) from then on. AnonymousExposure, before listening,
        beyond loopback without users (for --nats-listen too)."""
        loop = asyncio.get_running_loop()
        config = self.config
        config.check_exposure()
        config.check_nats()
        if self.nats is not None:
            # Before any peer links: each is told where this broker takes NATS clients
            # (its HELLO or WELCOME), and tells its own clients (INFO connect_urls).
            await self.nats.bind()
            config.nats_advertise = self.nats.url
        if self.tls is not None:
            host, port = self.tls.listen(config.host, config.port)
        else:
            self._server = await loop.create_server(
                self.new_link, config.host, config.port, reuse_address=True, backlog=1024
            )
            host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        self.named(config.name or f"broker-{port}", config.advertise or self.address)
        await self.run_mesh()
        if self.nats is not None:
            await self.nats.start()

    def named(self, name: str, advertise: str) -> None:
        """The broker's name and the address it advertises, once it listens: every part
        reads them from the config from here on. InvalidArgument when the broker's key is
        not for ``name`` (meshbus.broker.security.trust)."""
        self.trust.check_name(name)
        self.config.name = name
        self.config.advertise = advertise
        self.sync.start()

    async def run_mesh(self, *, timers: bool = True) -> None:
        """Start the background work, then found or join the mesh. With ``timers`` False
        nothing calls ``expire_requests`` and ``housekeeping``: the caller does (tests
        drive them on a fake clock)."""
        if timers:
            self._tasks.spawn(self._sweep_pending(), "pending-sweeper")
            self._tasks.spawn(self._housekeeping(), "housekeeping")
            self._tasks.spawn(self._measure_lag(), "loop-lag")
            if self.streams.replicated is not None:
                self._tasks.spawn(self._raft_ticks(), "raft-ticks")
        if self.streams.replicated is not None:
            self._tasks.spawn(self.streams.replicated.driver.run(), "raft-driver")
        if self.config.seeds:
            await self.mesh.join(self.config.seeds)
        else:
            self.mesh.found()

    def _became_ready(self) -> None:
        self.streams.restore()
        self.telemetry.start()

    def _greet_peer(self, link: Link) -> None:
        """What a newly linked peer hears first: our services and our group bindings."""
        self.sync.send_snapshot(link)
        self.guarantees.send_groups(link)

    async def drain(self) -> None:
        """Hand the leadership of the replicated streams it leads over to their other
        replicas; then move every connector to another broker, and tell NATS clients to
        reconnect elsewhere (lame duck mode), up to the grace period; then stop."""
        grace = self._drain_grace if self._drain_grace is not None else self.config.drain_grace
        await self.streams.hand_over_leaderships(grace)
        if self.nats is None:
            await self.mesh.drain(grace)
            return
        await asyncio.gather(self.mesh.drain(grace), self.nats.lame_duck(grace))

    def _nats_peers_changed(self, urls: list[str]) -> None:
        """The peers that take NATS clients changed: this broker's clients hear of them."""
        if self.nats is not None:
            self.nats.set_peer_urls(urls)

    def _reloaded(self) -> None:
        """A SIGHUP applied new users: what holds rights beyond a link follows them."""
        self.streams.recheck_captures()
        if self.nats is not None:
            self.nats.reauthorize()

    def request_drain(self, grace: float | None) -> None:
        self._drain_grace = grace
        self.drain_requested.set()

    async def stop(self) -> None:
        """Close every link with a BYE and stop listening."""
        if self._server is not None:
            self._server.close()
        if self.tls is not None:
            await self.tls.stop()
        if self.nats is not None:
            await self.nats.stop()
        await self.telemetry.stop()
        await self.operator.stop()
        await self.mesh.stop()
        for link in list(self.links.links.values()):
            link.send(encode_control(ControlType.BYE, Bye(reason="broker shutting down")))
            link.close(CloseReason.BROKER_SHUTDOWN)
        await self._tasks.cancel()
        if self._server is not None:
            await self._server.wait_closed()
        self.stream_requests.close()
        self.streams.close()

    # -- links -------------------------------------------------------------------

    def new_link(self, dialled: bool = False) -> Link:
        """A link for a TCP connection this broker accepted, or (``dialled``) opened."""
        config = self.config
        return Link(
            self.links.next_id(),
            routing=self.routing,
            forwarder=self.forwarder,
            dispatch=self.dispatch,
            outbox=self.outbox,
            on_open=self._link_opened,
            on_close=self._link_closed,
            max_frame=config.max_frame,
            max_pending_bytes=config.max_pending_bytes,
            dialled=dialled,
        )

    def _link_opened(self, link: Link) -> None:
        """A connection is up (with TLS, its TLS handshake done). One this broker accepted
        must finish its handshake -- HELLO, and the sign-in when the broker has users --
        within ``handshake_timeout`` (``expire_handshakes``), and at most
        ``max_handshaking`` may be at it: past that a new one is closed at once. Of those,
        at most ``max_handshaking_per_source`` from one address: past that the one of
        them that waited longest is closed (meshbus.broker.security.handshakes)."""
        links = self.links
        links.opened(link)
        if link.dialled:
            return  # the mesh's own dial, with its own timeout
        if self.tls is not None and not self.tls.admit(link):
            return
        config = self.config
        if len(links.handshaking) >= config.max_handshaking:
            link.fail(
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: {config.max_handshaking} connections are already in their "
                "handshake (the broker's --max-handshaking); try again later",
                CloseReason.REFUSED,
            )
            return
        if self.tls is None:  # with TLS, counted from its accept (TLSAcceptor)
            evicted = links.by_source.add(source_of(link.host), link)
            if evicted is not None:
                self._evict(evicted)
        links.handshaking[link] = self.clock() + config.handshake_timeout

    def _evict(self, link: Link) -> None:
        """Close ``link``, still in its handshake: the one from its address that waited
        longest when another came from there past ``max_handshaking_per_source``."""
        per_source = self.config.max_handshaking_per_source
        link.fail(ErrorCode.LIMIT_EXCEEDED, evicted_why(per_source, link.host), CloseReason.REFUSED)

    def expire_handshakes(self) -> None:
        """Close the connections that did not finish their handshake in time (from
        ``housekeeping``)."""
        timeout = self.config.handshake_timeout
        for link in self.links.late_handshakes(self.clock()):
            link.fail(
                ErrorCode.NOT_HANDSHAKEN,
                f"the handshake (HELLO, and AUTH when the broker has users) was not done "
                f"within {timeout:g} s of connecting (the broker's --handshake-timeout)",
                CloseReason.REFUSED,
            )

    def _link_closed(self, link: Link, reason: CloseReason) -> None:
        """The ordered cleanup of a closed link (docs/architecture.md explains the order):
        its services leave the table, and the watchers and peers hear of it; then what
        waited on it -- requests, relayed answers, streams -- is answered or forgotten."""
        was_connector = self.links.close(link, reason)
        held = self.routing.memberships_of(link) + self.routing.owned_count(link)
        if link.is_peer:
            captured = self.routing.groups_of_servers(link, STREAM_SERVERS)
            self.lost_captures.lost(link.name, captured)
        self._withdraw(link, was_connector)
        self.watch.link_closed(link)
        self.pending.drop_link(link)
        self.usage.link_closed(link)
        self.outbox.forget(link)
        if was_connector:
            self.service_subjects.link_closed(link)
            self.mesh.connector_left()
        if self.mesh.link_closed(link, reason):
            self.sync.peer_lost(link)
            why = f"broker {link.name}, which had it, left the mesh while the request was out"
            for entry in self.pending.drop_via(link):
                self.outbox.tell_requester(entry, ControlType.NO_ROUTE, why)
        if link.is_peer:
            # Requests relayed to the peer get their answer; its streams are gone. (Only a
            # peer's link: both scan their tables, which a connector's close need not pay.)
            self.relay.peer_lost(link)
            self.streams.peer_lost(link)
            self.peer_interest.drop(link, _WITHDRAW_STEP)
            if self.peer_interest.count(link):
                self._tasks.spawn(self._drop_interest_rest(link), "drop-interest")
        if self.routing.owned_count(link):
            self._tasks.spawn(self._withdraw_rest(link, was_connector, held), "withdraw")
        elif held >= _RELEASE_AFTER:
            _release_memory()
        log.debug("link closed", extra={"link": link.link_id, "reason": reason.value})

    def _withdraw(self, link: Link, was_connector: bool) -> None:
        """One step of taking a closed link's services out of the table: the watchers
        hear of them, and the peers too if they were a connector's (a peer's own are
        its to announce)."""
        gone = self.routing.remove_link(link, _WITHDRAW_STEP)
        self.watch.services_left(gone)
        if was_connector:
            for address in gone:
                self.sync.announce(OP_REMOVE, address)

    async def _withdraw_rest(self, link: Link, was_connector: bool, held: int) -> None:
        """A link that held more than one step's worth: the rest leaves in slices, one
        per loop turn (200,000 services took 0.5 s at once). Meanwhile a frame to one of
        them goes to the closed link and is dropped, as one in flight a moment earlier
        would have been; a registration of one by its own session takes it over."""
        slices = Slices()
        while self.routing.owned_count(link):
            self._withdraw(link, was_connector)
            await slices.turn()
        if held >= _RELEASE_AFTER:
            _release_memory()

    async def _drop_interest_rest(self, link: Link) -> None:
        """A peer that held more NATS interest than one step: the rest leaves in slices,
        as a closed link's services do. Meanwhile a message for it goes to the closed
        link and is dropped, as one in flight a moment earlier would have been."""
        slices = Slices()
        while self.peer_interest.drop(link, _WITHDRAW_STEP):
            await slices.turn()

    def _multicast_tap(self, group: bytes) -> Endpoint | None:
        """Where a connector's multicast to ``group`` also goes: a message to subjects to
        the subject layer; one to a group the mesh's NATS subscriptions want to the
        bridge (meshbus.broker.core.forward)."""
        if group == SUBJECTS:
            return self.service_subjects.endpoint
        return self.nats_bridge.tap_for(group)

    def _on_load(self, link: Link, correlation: int, body: Load) -> None:
        self.mesh.on_load(link, body)
        self.streams.peer_streams(link, body.streams)
        self.streams.peer_meta(link, body)

    # -- timers --------------------------------------------------------------------

    def _deadline(self, timeout_ms: int) -> float:
        config = self.config
        timeout = timeout_ms / 1000 if timeout_ms else config.default_request_timeout
        if timeout > config.max_request_timeout:
            # Cut to the limit (docs/protocol.md): no entry sits in the pending table for
            # weeks.
            timeout = config.max_request_timeout
        return self.clock() + timeout

    async def _sweep_pending(self) -> None:
        """Expire pending requests. A fixed tick rather than a timer per request: one wake-up
        every ``sweep_interval`` costs nothing per request, and bounds how late a TIMEOUT
        can be to one interval."""
        interval = self.config.sweep_interval
        while True:
            await asyncio.sleep(interval)
            self.expire_requests()

    def expire_requests(self) -> None:
        for entry in self.pending.expire(self.clock()):
            if entry.link.is_peer:
                continue  # a member picked here for a peer's requester: its broker tells it
            self.stats.timeouts += 1
            self.outbox.tell_requester(entry, ControlType.TIMEOUT)

    async def _measure_lag(self) -> None:
        """Wake every ``_LAG_INTERVAL`` and record how late (meshbus.broker.observe.lag). The loop's
        own clock, not ``self.clock``: the lag is the real loop's, whatever the broker's
        time is."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + _LAG_INTERVAL
            cpu = time.thread_time()
            await asyncio.sleep(_LAG_INTERVAL)
            late = loop.time() - asked
            self.lag.record(late, time.thread_time() - cpu)
            if late > self.mesh.fence.budget and self.peers:
                self.mesh.fence.stalled()

    async def _raft_ticks(self) -> None:
        assert self.streams.replicated is not None
        driver = self.streams.replicated.driver
        tick = self.config.raft_tick
        while True:
            await asyncio.sleep(tick)
            driver.tick()

    async def _housekeeping(self) -> None:
        interval = self.config.heartbeat_interval
        while True:
            await asyncio.sleep(interval)
            self.housekeeping()

    def housekeeping(self) -> None:
        """Once per heartbeat interval: heartbeats, the handshake timeout, then the group
        and stream expiries."""
        self.mesh.heartbeat()
        self.expire_handshakes()
        self.guarantees.expire()
        self.streams.expire()

    # -- introspection ----------------------------------------------------------

    def traffic_counters(self) -> dict[str, int]:
        """The cumulative message counters since the broker started (``meshbus stat``
        and the telemetry records)."""
        return {
            "msgs_in": self.links.msgs_in(),
            "msgs_out": self.links.msgs_out(),
            "refused_control": self.dispatch.refused_frames,
        } | dataclasses.asdict(self.stats)
