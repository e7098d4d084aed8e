"""What a broker tells the others about the mesh: its LOAD and its list of brokers.

Peers get both whenever the mesh's membership or a broker's state changes (once per
loop turn, however many changes it saw) and with every heartbeat, whose LOAD is
stamped per peer for the round trip (meshbus.broker.core.endpoint.PeerInfo.timed). A new
peer gets both at once. Connectors get the list of brokers they may fail over or be
redirected to, only when that set changes; NATS clients (through ``nats_changed``) the
NATS addresses of the peers they may reconnect to (``nats_urls``), only when that list
changes.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable

from meshbus.broker.core.link import Link
from meshbus.broker.core.registry import LinkRegistry, Peers
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import Body, BrokerInfo, Brokers, Load
from meshbus.protocol.layout import ControlType
from meshbus.util import parse_hostport

log = logging.getLogger("meshbus.broker")

# What a NATS address may be: a DNS name or an IPv4 address, or an IPv6 address in
# brackets, and a port. Nothing a client would read as more than one address, or print
# as something else.
_ADDRESS = re.compile(r"([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):[0-9]+").fullmatch

# What a LOAD says for replicated streams: the sender's incarnation, the meta group's
# voters and leader as it knows them (meshbus.broker.replication.metagroup).
Replication = tuple[int, list[str], str]


class Gossip:
    def __init__(
        self,
        *,
        peers: Peers,
        links: LinkRegistry,
        brokers: Callable[[], list[BrokerInfo]],
        hosted_streams: Callable[[], list[str]],
        nats_changed: Callable[[list[str]], None] = lambda urls: None,
        replication: Callable[[], Replication] = lambda: (0, [], ""),
    ) -> None:
        """``brokers`` is this broker (first) and its peers as they last told it;
        ``hosted_streams`` are announced in LOAD; ``nats_changed`` hears the peers'
        NATS addresses whenever that list changes (the NATS listener's connect_urls);
        ``replication`` is what LOAD says for replicated streams: this broker's
        incarnation, the meta group's voters and leader as it knows them."""
        self._peers = peers
        self._links = links
        self._brokers = brokers
        self._hosted_streams = hosted_streams
        self._nats_changed = nats_changed
        self._replication = replication
        self._scheduled = False
        self._pushed: tuple[str, ...] = ()  # the connectors' list, as last sent
        self.nats_urls: list[str] = []  # as last told to ``nats_changed``

    def changed(self) -> None:
        """The mesh's membership or a broker's state changed: tell peers and connectors
        at the end of this loop turn (once, however many changes it saw)."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._push)

    def started(self) -> None:
        """The broker takes connectors: they get the list in WELCOME from now on, and
        only its changes are pushed."""
        self._pushed = self._connector_addresses()

    def connector_list(self) -> list[BrokerInfo]:
        """The brokers a connector may fail over or be redirected to: ready, not draining."""
        return [s for s in self._brokers() if s.ready and not s.draining]

    def greet(self, link: Link) -> None:
        """A new peer: the brokers and our LOAD, first thing."""
        link.send(encode_control(ControlType.BROKERS, Brokers(brokers=self._brokers())))
        link.send(encode_control(ControlType.LOAD, self._load()))

    def load_changed(self) -> None:
        """Tell the peers now (the streams this broker hosts changed)."""
        self.send_all(ControlType.LOAD, self._load())

    def heartbeat(self) -> None:
        """Every peer gets our LOAD, stamped for it, and the list of brokers: sent with
        every heartbeat, not only when it changes, so that a link between two brokers
        that both reach a third is repaired within an interval or two of the network
        working again."""
        load = self._load()
        for link in self._peers.links():
            assert link.peer is not None
            link.send(encode_control(ControlType.LOAD, link.peer.timed(load)))
        self.send_all(ControlType.BROKERS, Brokers(brokers=self._brokers()))

    def send_all(self, type_: ControlType, body: Body) -> None:
        if self._peers:
            self._peers.send_all(encode_control(type_, body))

    def _connector_addresses(self) -> tuple[str, ...]:
        return tuple(sorted(b.address for b in self.connector_list()))

    def _push(self) -> None:
        self._scheduled = False
        self.send_all(ControlType.LOAD, self._load())
        self.send_all(ControlType.BROKERS, Brokers(brokers=self._brokers()))
        # Connectors only need to hear when the set of brokers changes, not every load.
        addresses = self._connector_addresses()
        if addresses != self._pushed:
            self._pushed = addresses
            frame = encode_control(ControlType.BROKERS, Brokers(brokers=self.connector_list()))
            for connector in self._links.connectors:
                connector.send(frame)
        urls = nats_urls(self._brokers()[1:])
        if urls != self.nats_urls:
            self.nats_urls = urls
            self._nats_changed(urls)

    def _load(self) -> Load:
        s = self._brokers()[0]
        incarnation, meta_voters, meta_leader = self._replication()
        return Load(
            connectors=s.connectors,
            capacity=s.capacity,
            slot=s.slot,
            ready=s.ready,
            draining=s.draining,
            streams=self._hosted_streams(),
            zone=s.zone,
            incarnation=incarnation,
            meta_voters=meta_voters,
            meta_leader=meta_leader,
        )


def nats_urls(peers: Iterable[BrokerInfo]) -> list[str]:
    """Where this broker's NATS clients may reconnect besides it: the NATS addresses of
    the peers it is linked to that take clients -- ready, not draining -- sorted, each
    once. A peer without one (no listener, or a broker that predates the field) is left
    out; so is one heard of only through gossip, which may be gone already."""
    return sorted({p.nats for p in peers if p.nats and p.ready and not p.draining})


def checked_nats_address(peer: str, address: str) -> str:
    """``peer``'s NATS address as its handshake gave it, when it is one a client can dial:
    HOST:PORT (``[v6]:PORT``), a host of letters, digits and ``.-_``, a port other than 0.
    Otherwise "" (and a warning): NATS clients are not told of it."""
    if not address:
        return ""
    try:
        port = parse_hostport(address)[1]
    except ValueError as exc:
        why = str(exc)
    else:
        why = "" if _ADDRESS(address) and port else "not a host name or IP address and a port"
    if not why:
        return address
    log.warning(
        "peer %s's NATS address %r is not one a client can dial (%s); not told to NATS clients",
        peer, address[:100], why,
        extra={"peer": peer, "address": address[:100], "error": why},
    )  # fmt: skip
    return ""
