"""What the routing table, the outbox and the forwarder know of a destination.

An ``Endpoint`` is anything frames can be routed to: a ``Link`` (a connector's,
an operator's or a peer broker's TCP link, meshbus.broker.core.link) or a stream's
``StreamSink`` (meshbus.broker.streams.host), which stores what is routed to it.

Roles and states of a link, and the only transitions between them (each is a
method of ``Link``, the one place a link's role and state change):

    role         state          transition                       to
    HANDSHAKING  AWAIT_HELLO    open_as_connector                CONNECTOR, OPEN
    HANDSHAKING  AWAIT_HELLO    open_as_operator                 OPERATOR, OPEN
    HANDSHAKING  AWAIT_HELLO    open_as_peer (HELLO role broker) PEER, OPEN
    HANDSHAKING  AWAIT_WELCOME  open_as_peer (WELCOME)           PEER, OPEN
    any          any            fail / close / connection lost   (role kept), CLOSED

A link's role decides which control frames it may send (meshbus.broker.core.dispatch).
Peer-only state (the peer's advertised address, slot, link tags, heartbeat
bookkeeping) lives in ``PeerInfo``, present exactly when the role is PEER.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from meshbus.protocol.control import Load


class LinkState(enum.Enum):
    AWAIT_HELLO = "await-hello"
    AWAIT_WELCOME = "await-welcome"
    OPEN = "open"
    CLOSED = "closed"


class LinkRole(enum.Enum):
    HANDSHAKING = "handshaking"
    CONNECTOR = "connector"
    OPERATOR = "operator"
    PEER = "peer"
    STREAM = "stream"  # a stream's sink: never a TCP link
    NATS = "nats"  # the NATS bridge (meshbus.broker.nats.bridge): never a TCP link


class CloseReason(enum.Enum):
    """Why a link closed; logged, counted in ``stat``, and sent to the peer when it is an error."""

    CLIENT_BYE = "client-bye"
    CLIENT_EOF = "client-eof"
    CONNECTION_LOST = "connection-lost"
    PROTOCOL_ERROR = "protocol-error"
    SLOW_CONSUMER = "slow-consumer"
    BROKER_SHUTDOWN = "broker-shutdown"
    REFUSED = "refused"  # redirected (full, joining, draining) or a broker name in use
    DUPLICATE_LINK = "duplicate-link"
    HEARTBEAT_TIMEOUT = "heartbeat-timeout"
    PEER_BYE = "peer-bye"
    # Bytes from a peer after a silence past the heartbeat budget: this broker stalled
    # (or the network held them), and the peer has declared it dead meanwhile.
    STALLED = "stalled"
    # A reload of the config file removed the link's user, or changed its credential.
    REVOKED = "revoked"
    # A connector's link, closed by a broker cut off from most of the mesh
    # (--partition-handling pause-minority).
    MINORITY = "minority"


@dataclass(eq=False)
class PeerInfo:
    """What a peer broker's link has that no other link has.

    Neighbour identifiers: ``tag_in`` is the id this broker gave the peer (our link
    id, expected at offset 40 of its frames); ``tag_out`` the id the peer gave us,
    stamped on the frames we send it.

    Liveness: a peer silent for ``budget`` seconds is dead. The heartbeat timer finds
    that; ``hear`` finds it too when bytes come after the silence -- after this
    broker's own loop stalled, the bytes are read before any timer runs, and the
    peer has declared this broker dead meanwhile."""

    listen: str  # the address the peer advertises
    slot: int  # its dynamic-id slot
    tag_in: int
    tag_out: bytes
    clock: Callable[[], float]
    budget: float  # seconds of silence that mean the peer is dead
    heard_at: float = field(init=False)  # when bytes last came
    rtt: float | None = field(init=False, default=None)  # seconds; None until measured
    _their_sent_at: float = field(init=False, default=0.0)  # of the peer's last LOAD
    _their_load_at: float = field(init=False, default=0.0)  # when it came, by our clock

    def __post_init__(self) -> None:
        self.heard_at = self.clock()

    def timed(self, load: Load) -> Load:
        """Our heartbeat ``load`` for this peer: stamped now, echoing its last LOAD."""
        now = self.clock()
        held = now - self._their_load_at if self._their_sent_at else 0.0
        return msgspec.structs.replace(load, sent_at=now, echo=self._their_sent_at, held=held)

    def loaded(self, load: Load) -> None:
        """The peer's LOAD came: keep its stamp to echo, and time the round trip of ours
        it echoes -- from when we sent it to now, less the time the peer held it."""
        now = self.clock()
        if load.sent_at:
            self._their_sent_at, self._their_load_at = load.sent_at, now
        if load.echo:
            rtt = now - load.echo - load.held
            if 0 <= rtt <= now - load.echo:  # an echo of a stamp we never sent is no time
                self.rtt = rtt

    def silence(self) -> float:
        return self.clock() - self.heard_at

    def hear(self) -> bool:
        """Bytes came; False when they end a silence past the budget (they are stale)."""
        now = self.clock()
        fresh = now - self.heard_at <= self.budget
        self.heard_at = now
        return fresh


class Endpoint:
    """A destination of routed frames, with its counters; ``send`` writes now."""

    def __init__(self, link_id: int, role: LinkRole, max_frame: int) -> None:
        self.link_id = link_id
        self.role = role
        self.state = LinkState.OPEN
        self.name = ""  # a connector's name, a peer broker's, or the sink's
        self.max_frame = max_frame
        # Kept for the hot path, which asks it of every target: set with ``peer``.
        self.is_peer = False
        self.peer: PeerInfo | None = None
        # A connector that takes NO_ROUTE answers in batches (Hello.batched_no_route).
        self.batched_no_route = False
        self.msgs_in = 0
        self.msgs_out = 0
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def closed(self) -> bool:
        return self.state is LinkState.CLOSED

    def send(self, data: bytes | bytearray) -> None:
        raise NotImplementedError


def is_peer(endpoint: Endpoint) -> bool:
    """The routing table's test for a remote owner: a peer broker's link."""
    return endpoint.is_peer
