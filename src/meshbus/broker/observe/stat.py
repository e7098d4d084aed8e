"""What ``meshbus stat`` shows: this broker, its links, the mesh, its counters and, in
detail, every service and group -- read from the parts, never changed here."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import msgspec

from meshbus.address import describe_address
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.endpoint import Endpoint, LinkRole
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.registry import LinkRegistry, Peers
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.slices import Slices
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.mesh.groups import GroupTable
from meshbus.broker.mesh.membership import Mesh
from meshbus.broker.mesh.sync import SyncStats
from meshbus.broker.observe.lag import LoopLag
from meshbus.broker.observe.nats import NatsView
from meshbus.broker.security.signin import Reloads
from meshbus.broker.streams.host import StreamHost


class StatView:
    def __init__(
        self,
        *,
        config: BrokerConfig,
        routing: RoutingTable[Endpoint],
        links: LinkRegistry,
        peers: Peers,
        mesh: Mesh,
        sync_stats: SyncStats,
        streams: StreamHost,
        groups: GroupTable,
        lag: LoopLag,
        pending: PendingTable[Endpoint],
        counters: Callable[[], dict[str, int]],
        reloads: Reloads,
        usage: UsageTable,
        nats: NatsView,
    ) -> None:
        """``counters``: the broker's cumulative traffic counters (also telemetry's);
        ``reloads``: the config file's reloads (SIGHUP); ``usage``: what each user holds,
        against its quotas; ``nats``: its NATS clients and the mesh's NATS traffic."""
        self._config = config
        self._routing = routing
        self._links = links
        self._peers = peers
        self._mesh = mesh
        self._sync_stats = sync_stats
        self._streams = streams
        self._groups = groups
        self._lag = lag
        self._pending = pending
        self._counters = counters
        self._reloads = reloads
        self._usage = usage
        self._nats = nats
        self._started_at = time.time()

    async def detailed(self) -> dict[str, Any]:
        """``brief`` with the lists that grow with the routing table: every link's
        services, every service, every group's members. Built in slices (one per loop
        turn), as describing 200,000 addresses takes most of a second; unsorted, as
        sorting that many would stall the loop too -- the client sorts them."""
        data = self.brief()
        routing = self._routing
        slices = Slices()
        for entry in data["links"]:
            link = self._links.links.get(entry["id"])
            owned = list(routing.owned_by(link)) if link is not None else []
            entry["services"] = await slices.described(owned)
        services = [address for address, _ in routing.services()]
        data["service_addresses"] = await slices.described(services)
        groups = {}
        for group, members in list(routing.groups()):
            groups[describe_address(group)] = await slices.described(list(members))
        data["groups"] = groups
        return data

    def brief(self) -> dict[str, Any]:
        """What ``meshbus stat`` shows: this broker, its links, the mesh and counters --
        without the lists that grow with the routing table (``detailed``)."""
        routing = self._routing
        links = [
            {
                "id": link.link_id,
                "peer": link.remote,
                "name": link.name,
                "role": "operator" if link.role is LinkRole.OPERATOR else "connector",
                "user": link.user,  # who signed in; None when the broker has no users
                "state": link.state.value,
                "services": routing.owned_count(link),
                "msgs_in": link.msgs_in,
                "msgs_out": link.msgs_out,
                "bytes_in": link.bytes_in,
                "bytes_out": link.bytes_out,
            }
            for link in self._links.links.values()
            if not link.is_peer
        ]
        mesh = self._mesh
        peer_links = []
        for link in self._peers.links():
            assert link.peer is not None
            peer_links.append(
                {
                    "name": link.name,
                    "address": link.peer.listen,
                    "link_id": link.link_id,
                    "tag_in": link.peer.tag_in,
                    "tag_out": int.from_bytes(link.peer.tag_out, "big"),
                    "dialled": link.dialled,
                    # The round trip the heartbeat LOADs timed; None until the peer echoed one.
                    "rtt_ms": None if link.peer.rtt is None else round(link.peer.rtt * 1000, 3),
                    "msgs_in": link.msgs_in,
                    "msgs_out": link.msgs_out,
                    "bytes_in": link.bytes_in,
                    "bytes_out": link.bytes_out,
                }
            )
        data: dict[str, Any] = {
            "name": self._config.name,
            "address": self._config.advertise,
            "uptime_s": round(time.time() - self._started_at, 3),
            "ready": mesh.ready,
            "draining": mesh.draining,
            "slot": routing.slot,
            "connectors": len(self._links.connectors),
            "services": sum(routing.owned_count(link) for link in self._links.connectors),
            "routes": routing.route_count,
            "route_services": routing.service_count,
            "route_groups": routing.group_count,
            "peers": self._peers.names(),
            # Whether peers must prove themselves with a key [[brokers]] lists.
            "mesh_trust": self._config.mesh_trust,
            "capacity": mesh.capacity,
            "max_connectors": self._config.max_connectors,
            # Connections in their handshake (TLS, HELLO, the sign-in) and the addresses
            # they come from (docs/security.md, "One source cannot lock others out").
            "handshaking": len(self._links.by_source),
            "handshaking_sources": self._links.by_source.sources(),
            "links": links,
            "peer_links": peer_links,
            "mesh": [msgspec.structs.asdict(state) for state in mesh.brokers()],
            "mesh_counters": dataclasses.asdict(mesh.stats)
            | dataclasses.asdict(self._sync_stats)
            | {"stalls": mesh.fence.stalls, "minority_pauses": mesh.minority.pauses},
            "streams": self._streams.snapshot(),
            "groups_bound": len(self._groups),
            "loop_lag_ms": self._lag.snapshot(),
            "redialling": self._mesh.redials.names(),
            # Brokers a peer is linked to and this one is not (a cut link): alive, and
            # counted for message groups' homes (docs/mesh.md, "One group, one member").
            "out_of_reach": self._mesh.out_of_reach.names(),
            "counters": self._counters()
            | {
                "pending": len(self._pending),
                "links_accepted": self._links.accepted,
                "links_closed": dict(self._links.closed),
                "config_reloads": self._reloads.applied,
                "config_reloads_failed": self._reloads.failed,
            },
            # When a SIGHUP last applied the config file (Unix time); None: never.
            "config_reloaded_at": self._reloads.applied_at or None,
            # Each user of the config file: what it holds here, and its quotas.
            "users": self._usage.snapshot(),
            "nats": self._nats.snapshot(),
        }
        return data
