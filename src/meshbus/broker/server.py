"""The broker daemon: owns the links, the routing and pending tables, the mesh and the timers.

Everything here runs on one event loop thread and never awaits inside frame
handling, so a routing change made by a control frame is visible to the very
next frame of the same read -- that is what keeps a REGISTER followed by a send
from the new address in order (a REGISTER that must wait for the mesh blocks
its link instead; see meshbus.broker.control).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meshbus.address import describe_address
from meshbus.broker.balance import redirect_target
from meshbus.broker.control import ControlHandler
from meshbus.broker.forward import stamp_run
from meshbus.broker.guarantees import Guarantees
from meshbus.broker.link import CloseReason, Link
from meshbus.broker.mesh import Mesh
from meshbus.broker.pending import PendingEntry, PendingTable
from meshbus.broker.process import ready_line
from meshbus.broker.routing import RoutingTable
from meshbus.broker.streams import Streams
from meshbus.broker.sync import RouteSync
from meshbus.broker.telemetry import Telemetry
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import OP_REMOVE, Bye, DeliveryFailure
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, ControlType

log = logging.getLogger("meshbus.broker")


@dataclass
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 7400
    name: str = ""  # empty: broker-PORT, with the port actually bound
    slot: int = 1
    max_frame: int = DEFAULT_MAX_FRAME
    # A link whose unsent output passes this is a slow consumer and is closed (as NATS does):
    # the alternative, buffering without bound, lets one stuck client take the broker down.
    max_pending_bytes: int = 64 * 1024 * 1024
    # Used when a request carries no timeout of its own.
    default_request_timeout: float = 30.0
    # How often pending requests are checked for expiry: a TIMEOUT is at most this late.
    sweep_interval: float = 0.01
    # The mesh (ARCHITECTURE.md section 5).
    seeds: list[str] = field(default_factory=list)  # empty: start a new mesh
    advertise: str = ""  # the address peers and connectors dial; empty: the bound address
    max_connectors: int = 50  # the seed patent's capacity
    capacity_boost: float = 1.2  # after a peer crashed: 50 -> 60, as in the seed
    boost_window: float = 30.0
    heartbeat_interval: float = 0.5
    heartbeat_misses: int = 3  # a silent peer is dead after 1.5 s
    drain_grace: float = 10.0
    join_timeout: float = 30.0
    data_dir: str = ""
    # Message groups: idle seconds before a binding goes (the seed's 5 minutes), and how
    # long a member may be missing (failing over) before its groups move.
    group_expiry: float = 300.0
    group_grace: float = 2.0
    # Streams under data_dir: "normal" survives the broker being killed (kill -9),
    # "always" also an OS crash or power loss, at a cost (BENCHMARKS.md).
    fsync: str = "normal"
    # Telemetry (broker/telemetry.py): seconds between records, 0 for none; and the
    # share of sends connectors trace while it is on.
    telemetry_interval: float = 0.0
    trace_sample: float = 0.001


@dataclass
class BrokerStats:
    requests: int = 0
    timeouts: int = 0
    late_responses: int = 0
    dropped_no_route: int = 0
    dropped_too_large: int = 0
    dropped_bad_hop: int = 0  # frames from a peer with a wrong hop count or link tag
    links_accepted: int = 0
    # Traffic of links that have closed; open links keep their own counts.
    closed_msgs_in: int = 0
    closed_msgs_out: int = 0
    links_closed: Counter[str] = field(default_factory=Counter)


def _is_peer(link: Link) -> bool:
    return link.is_peer


class Broker:
    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        # No slot until the mesh grants one (Mesh.found or Mesh.join): no dynamic ids before.
        self.routing: RoutingTable[Link] = RoutingTable(slot=0, is_remote=_is_peer)
        self.pending: PendingTable[Link] = PendingTable()
        self.stats = BrokerStats()
        self.control = ControlHandler(self)
        self.mesh = Mesh(self)
        self.sync = RouteSync(self)
        self.guarantees = Guarantees(self)
        self.links: dict[int, Link] = {}
        self.connectors: set[Link] = set()  # open connector links
        # Frames routed during one read, per destination link; written at the end of the read.
        self.outbox: dict[Link, list[memoryview | bytes | bytearray]] = {}
        self.started_at = time.time()
        self._next_link_id = 1
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.clock = time.monotonic
        self.address = ""
        self.advertised = ""
        self.drain_requested = asyncio.Event()
        self._drain_grace: float | None = None
        self._drain_requester: Link | None = None
        self.streams = Streams(self)
        self.telemetry = Telemetry(self)
        g = self.guarantees
        self._guarantee_handlers: dict[int, Callable[[Link, int, Any], None]] = {
            ControlType.MEMBERS: g.on_members,
            ControlType.GROUP_BIND: g.on_bind,
            ControlType.GROUP_END: g.on_end,
            ControlType.GROUPS: g.on_groups,
            ControlType.RELAYED: g.on_relayed,
            ControlType.WATCH: g.on_watch,
            ControlType.STREAM: self.streams.on_request,
            ControlType.TRACE: self._on_trace,
        }

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Listen, then found a new mesh or join one through the seeds (JoinFailed if it
        cannot). Peers can link while it joins; connectors are taken once it is ready."""
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        self._server = await loop.create_server(
            self._new_link, self.config.host, self.config.port, reuse_address=True, backlog=1024
        )
        sock = self._server.sockets[0]
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.advertised = self.config.advertise or self.address
        if not self.config.name:
            self.config.name = f"broker-{port}"
        self._sweeper = asyncio.create_task(self._sweep_pending(), name="pending-sweeper")
        self.mesh.start()
        if self.config.seeds:
            await self.mesh.join(self.config.seeds)
        else:
            self.mesh.found()

    async def drain(self) -> None:
        """Move every connector to another broker (up to the grace period), then stop."""
        grace = self._drain_grace if self._drain_grace is not None else self.config.drain_grace
        await self.mesh.drain(grace)

    def request_drain(self, grace: float | None, requested_by: Link | None = None) -> None:
        self._drain_grace = grace
        self._drain_requester = requested_by
        self.drain_requested.set()

    async def stop(self) -> None:
        """Close every link with a BYE and stop listening."""
        if self._server is not None:
            self._server.close()
        await self.telemetry.stop()
        await self.mesh.stop()
        for link in list(self.links.values()):
            link.send(encode_control(ControlType.BYE, Bye(reason="broker shutting down")))
            link.close(CloseReason.BROKER_SHUTDOWN)
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self._server is not None:
            await self._server.wait_closed()
        self.streams.close()

    def _on_trace(self, link: Link, correlation: int, body: Any) -> None:
        self.telemetry.hop(
            "received", body.src, body.msg_id, body.dst, body.sent_at, at=body.received_at
        )

    def on_guarantee(self, link: Link, ctype: int, correlation: int, body: Any) -> None:
        """A request for meshbus.broker.guarantees or .streams, from a connector or relayed
        by a peer, or their broker-to-broker frames."""
        self._guarantee_handlers[ctype](link, correlation, body)

    def next_link_id(self) -> int:
        link_id = self._next_link_id
        self._next_link_id += 1
        return link_id

    def _new_link(self) -> Link:
        return Link(self, self.next_link_id())

    def link_opened(self, link: Link) -> None:
        self.links[link.link_id] = link
        if not link.dialled:
            self.stats.links_accepted += 1

    def connector_opened(self, link: Link) -> None:
        self.connectors.add(link)
        self.mesh.lists_changed()

    def link_closed(self, link: Link, reason: CloseReason) -> None:
        self.links.pop(link.link_id, None)
        self.stats.links_closed[reason.value] += 1
        self.stats.closed_msgs_in += link.msgs_in
        self.stats.closed_msgs_out += link.msgs_out
        gone = self.routing.remove_link(link)
        self.guarantees.services_left(gone)
        self.guarantees.watchers.discard(link)
        self.pending.drop_link(link)
        self.outbox.pop(link, None)
        if link in self.connectors:
            self.connectors.discard(link)
            for address in gone:
                self.sync.announce(OP_REMOVE, address)
            self.mesh.connector_left()
        self.mesh.peer_lost(link, reason)
        # Relayed requests waiting on a peer get their answer; its streams are gone.
        self.guarantees.peer_lost(link)
        self.streams.peer_lost(link)
        log.debug(
            "link closed",
            extra={"link": link.link_id, "reason": reason.value, "services": len(gone)},
        )

    # -- taking connectors ---------------------------------------------------------

    def refusal(self) -> str:
        """Why a new connector is refused now, or "" if it is welcome."""
        mesh = self.mesh
        if mesh.draining:
            return f"broker {self.config.name} is draining"
        if not mesh.ready:
            return f"broker {self.config.name} is still joining the mesh"
        if len(self.connectors) >= mesh.capacity:
            return f"broker {self.config.name} is full ({mesh.capacity} connectors)"
        return ""

    def redirect(self) -> str:
        return redirect_target(self.mesh.brokers(), exclude=self.config.name)

    # -- output ----------------------------------------------------------------

    def deliver(self, link: Link, frame: memoryview | bytes | bytearray) -> bool:
        """Queue a frame for ``link``; written when the current read is done.

        False (and counted) when the frame is larger than the link accepts: forwarding
        it would break the receiver's framing and cost it its link."""
        if len(frame) > link.max_frame:
            self.stats.dropped_too_large += 1
            return False
        if link.is_peer:
            frame = stamp_run(frame, 1, len(frame), link.tag_out)
        self.queue(link, frame, 1)
        return True

    def queue(self, link: Link, frames: memoryview | bytes | bytearray, count: int) -> None:
        """Queue ``count`` frames (one contiguous slice) for ``link`` without checks."""
        link.msgs_out += count
        parts = self.outbox.get(link)
        if parts is None:
            self.outbox[link] = [frames]
        else:
            parts.append(frames)

    def reply(self, link: Link, type_: ControlType, body: Any, correlation: int = 0) -> None:
        parts = self.outbox.setdefault(link, [])
        parts.append(encode_control(type_, body, correlation))

    def flush_outbox(self) -> None:
        """Write each link's frames of this read in one call, in the order they were routed."""
        if not self.outbox:
            return
        batches = list(self.outbox.items())
        self.outbox.clear()
        for link, parts in batches:
            link.send(b"".join(parts))

    def no_route(self, link: Link, msg_id: int, src: bytes, dst: bytes, reason: str = "") -> None:
        self.reply(
            link,
            ControlType.NO_ROUTE,
            DeliveryFailure(msg_id=msg_id, src=src, dst=dst, reason=reason),
        )

    # -- requests -------------------------------------------------------------

    def deadline(self, timeout_ms: int) -> float:
        timeout = timeout_ms / 1000 if timeout_ms else self.config.default_request_timeout
        return self.clock() + timeout

    async def _sweep_pending(self) -> None:
        """Expire pending requests. A fixed tick rather than a timer per request: one wake-up
        every ``sweep_interval`` costs nothing per request, and bounds how late a TIMEOUT
        can be to one interval."""
        interval = self.config.sweep_interval
        while True:
            await asyncio.sleep(interval)
            for entry in self.pending.expire(self.clock()):
                self.stats.timeouts += 1
                self.tell_requester(entry, ControlType.TIMEOUT)

    def tell_requester(
        self, entry: PendingEntry[Link], outcome: ControlType, reason: str = ""
    ) -> None:
        """TIMEOUT or NO_ROUTE for a pending request, to the link it came in on."""
        entry.link.send(
            encode_control(
                outcome,
                DeliveryFailure(
                    msg_id=entry.msg_id, src=entry.requester, dst=entry.dst, reason=reason
                ),
            )
        )

    # -- introspection ----------------------------------------------------------

    def traffic_counters(self) -> dict[str, int]:
        """The cumulative message counters since the broker started (``meshbus stat``
        and the telemetry records)."""
        s = self.stats
        links = self.links.values()
        return {
            "msgs_in": s.closed_msgs_in + sum(link.msgs_in for link in links),
            "msgs_out": s.closed_msgs_out + sum(link.msgs_out for link in links),
            "requests": s.requests,
            "timeouts": s.timeouts,
            "late_responses": s.late_responses,
            "dropped_no_route": s.dropped_no_route,
            "dropped_too_large": s.dropped_too_large,
            "dropped_bad_hop": s.dropped_bad_hop,
        }

    def snapshot(self, detail: bool = True) -> dict[str, Any]:
        """What ``meshbus stat`` shows: this broker, its links, the mesh and counters.

        ``detail`` False leaves out the lists that grow with the routing table."""
        routing = self.routing
        links = [
            {
                "id": link.link_id,
                "peer": link.peer,
                "name": link.name,
                "role": "operator" if link.operator else "connector",
                "state": link.state.value,
                "services": sorted(describe_address(a) for a in routing.owned_by(link))
                if detail
                else routing.owned_count(link),
                "msgs_in": link.msgs_in,
                "msgs_out": link.msgs_out,
                "bytes_in": link.bytes_in,
                "bytes_out": link.bytes_out,
            }
            for link in self.links.values()
            if not link.is_peer
        ]
        s = self.stats
        mesh = self.mesh
        data: dict[str, Any] = {
            "name": self.config.name,
            "address": self.advertised,
            "uptime_s": round(time.time() - self.started_at, 3),
            "ready": mesh.ready,
            "draining": mesh.draining,
            "slot": routing.slot,
            "connectors": len(self.connectors),
            "services": sum(routing.owned_count(link) for link in self.connectors),
            "routes": routing.route_count,
            "route_services": routing.service_count,
            "route_groups": routing.group_count,
            "peers": sorted(mesh.peers),
            "capacity": mesh.capacity,
            "max_connectors": self.config.max_connectors,
            "links": links,
            "peer_links": [
                {
                    "name": link.name,
                    "address": link.listen,
                    "link_id": link.link_id,
                    "tag_in": link.tag_in,
                    "tag_out": int.from_bytes(link.tag_out, "big"),
                    "dialled": link.dialled,
                    "msgs_in": link.msgs_in,
                    "msgs_out": link.msgs_out,
                    "bytes_in": link.bytes_in,
                    "bytes_out": link.bytes_out,
                }
                for link in mesh.peers.values()
            ],
            "mesh": [msgspec.structs.asdict(state) for state in mesh.brokers()],
            "mesh_counters": dataclasses.asdict(mesh.stats) | dataclasses.asdict(self.sync.stats),
            "streams": self.streams.snapshot(),
            "groups_bound": len(self.guarantees.groups),
            "counters": self.traffic_counters()
            | {
                "pending": len(self.pending),
                "links_accepted": s.links_accepted,
                "links_closed": dict(s.links_closed),
            },
        }
        if detail:
            data["service_addresses"] = sorted(describe_address(a) for a, _ in routing.services())
            data["groups"] = {
                describe_address(group): sorted(describe_address(m) for m in members)
                for group, members in routing.groups()
            }
        return data


async def serve(config: BrokerConfig) -> None:
    """Run a broker until SIGINT, SIGTERM or a DRAIN request; print the ready line once it
    takes connectors. SIGTERM and DRAIN drain first (connectors move to other brokers);
    a second signal stops at once."""
    import signal
    import sys

    broker = Broker(config)
    loop = asyncio.get_running_loop()
    # Handlers first: a script may signal the broker the moment it reads the ready line.
    stop_now = asyncio.Event()

    def on_signal() -> None:
        if broker.drain_requested.is_set():
            stop_now.set()
        broker.request_drain(None)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await broker.start()
    except BaseException:
        await broker.stop()
        raise
    # The one line scripts and tests wait for; it carries the real port when --listen used 0.
    sys.stdout.write(ready_line(config.name, broker.address) + "\n")
    sys.stdout.flush()
    await broker.drain_requested.wait()
    log.info("draining", extra={"broker": config.name})
    drain = asyncio.create_task(broker.drain())
    interrupted = asyncio.create_task(stop_now.wait())
    await asyncio.wait({drain, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    drain.cancel()
    interrupted.cancel()
    log.info("stopping", extra={"broker": config.name})
    await broker.stop()
