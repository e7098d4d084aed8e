"""Bodies of control frames (MRCMP): one msgpack map per type.

Bodies are maps, not arrays, and decoders ignore fields they do not know, so a
newer peer can add fields without breaking an older one; a field an older peer
does not send takes its default. Addresses travel as their 16 raw bytes.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from meshbus.protocol.blocks import BlockSlice
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, PROTOCOL_VERSION, ControlType
from meshbus.protocol.subjects import MAX_SUBJECT

# Bounds on what a body's numbers may be: a value outside them is a decode error (the
# sender's PROTOCOL_ERROR), never an OverflowError deep in the broker or a number SQLite
# cannot store. Sized to the fields they stand for on the wire and on disk.
U8 = Annotated[int, msgspec.Meta(ge=0, le=0xFF)]
U16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries no more; msgspec bounds stop at int64
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # connectors, messages per call
Counter = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # a sequence of route operations
# A stream's seqs: the SQLite store packs (stream id, seq) into one key, 2**40 seqs each.
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**40)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
# Seconds: a limit, a wait, a grace period (about 31 years at most; NaN is refused).
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]
# A time on a broker's clock, seconds since the epoch (a block's, a deadline).
Clock = Annotated[float, msgspec.Meta(ge=0, le=1e11)]


class Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of control bodies."""


ROLE_CONNECTOR = "connector"
ROLE_BROKER = "broker"
# An operator's link (meshbus stat, drain): no connector -- never refused or redirected,
# not counted, never moved -- and it may not register services.
ROLE_OPERATOR = "operator"

# The sign-in (docs/security.md, "Authentication"): a CHALLENGE's nonce, an Ed25519
# signature, a token's proof, and the longest user name an AUTH may carry.
NONCE_SIZE = 32
SIGNATURE_SIZE = 64
TOKEN_PROOF_SIZE = 32  # an HMAC-SHA256 (meshbus.auth.token_proof)
MAX_USER_NAME = 128
UserName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_USER_NAME)]
# A connector's session id: the reference client draws 16 random bytes. A broker with
# users binds it to the user (meshbus.broker.security.signin.bound_session, a BLAKE2b digest of the
# same length, which BLAKE2b allows up to 64 bytes).
MAX_SESSION = 64
# The most msg_ids one NO_ROUTE names besides its own (DeliveryFailure.also): 9 KiB.
MAX_ALSO = 1023
# A broker's NATS client address (HOST:PORT, --nats-advertise): a DNS name of 253
# characters, or a bracketed IPv6 address, and a port, with room to spare.
MAX_NATS_ADDRESS = 300
NatsAddress = Annotated[str, msgspec.Meta(max_length=MAX_NATS_ADDRESS)]
# Replicated streams: a broker's --zone, a broker name in a LOAD, and the voters of the
# mesh's meta group (docs/raft.md, "The meta group").
MAX_ZONE = 64
Zone = Annotated[str, msgspec.Meta(max_length=MAX_ZONE)]
BrokerName = Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)]
MAX_META_VOTERS = 5


class Hello(Body):
    """First frame on a link: connector -> broker, or dialling broker -> broker.

    ``session`` identifies a connector across reconnects (failover, moves): a
    re-registration of an address the same session owned elsewhere is a takeover,
    not a conflict. Brokers send ``role="broker"`` with their own ``listen`` address,
    dynamic-id ``slot`` (0 while joining), and the link ``tag`` they assigned to the
    broker they dial (neighbour identifiers: the receiver stamps it into every data
    frame it sends back on this link). A broker whose mesh trusts only its brokers
    (docs/security.md) sends a fresh ``nonce``: the broker it dials signs it, with this
    HELLO's ``name``, to prove itself in its CHALLENGE.
    """

    protocol: U16 = PROTOCOL_VERSION
    role: str = ROLE_CONNECTOR
    name: str = ""
    max_frame: U32 = DEFAULT_MAX_FRAME
    session: Annotated[bytes, msgspec.Meta(max_length=MAX_SESSION)] = b""
    listen: str = ""
    slot: U16 = 0
    tag: U32 = 0
    # A connector that wants SYNCED after the answer to each change it makes.
    synced: bool = False
    # How many links this connector's session opened before this one. Of two brokers
    # announcing the same session's address, the later link's wins: the other is a
    # broker that has not yet noticed the connector left it (it stalled, or was cut off).
    epoch: U32 = 0
    # 0 or NONCE_SIZE bytes (the handshake refuses any other length).
    nonce: Annotated[bytes, msgspec.Meta(max_length=NONCE_SIZE)] = b""
    # A connector that reads DeliveryFailure.also: NO_ROUTE answers for consecutive
    # frames refused alike come to it as one frame.
    batched_no_route: bool = False
    # A dialling broker's NATS client address ("": none, or a broker that predates it):
    # its peers tell their NATS clients of it (INFO connect_urls, docs/nats.md).
    nats: NatsAddress = ""


class Challenge(Body):
    """CHALLENGE: the broker wants to know who is on the link before it WELCOMEs it. The
    answer (AUTH) signs ``nonce`` -- fresh for every link -- or carries a token.

    To a dialling broker (mesh trust, docs/security.md) it also proves who answers:
    ``broker``, its name, and ``proof`` (0 or SIGNATURE_SIZE bytes), its Ed25519
    signature of ``meshbus.protocol.handshake.broker_proof_message`` -- the dialler's
    HELLO nonce and name."""

    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_SIZE, max_length=NONCE_SIZE)]
    broker: Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)] = ""
    proof: Annotated[bytes, msgspec.Meta(max_length=SIGNATURE_SIZE)] = b""


class Auth(Body):
    """AUTH: ``user`` and exactly one credential: ``signature``, the user's Ed25519
    signature of the sign-in context and the CHALLENGE's nonce
    (``meshbus.protocol.handshake.sign_in_message``), or ``token_proof``, a token user's
    proof of the same (``meshbus.auth.token_proof``)."""

    user: UserName
    signature: Annotated[bytes, msgspec.Meta(max_length=SIGNATURE_SIZE)] = b""
    token_proof: Annotated[bytes, msgspec.Meta(max_length=TOKEN_PROOF_SIZE)] = b""


class BrokerInfo(Body):
    """One broker of the mesh as its peers know it; ``nats`` is its NATS client address
    ("": no NATS listener, or one its peers are not told of)."""

    name: str
    address: str
    slot: U16 = 0
    connectors: Count = 0
    capacity: Count = 0
    ready: bool = False
    draining: bool = False
    nats: NatsAddress = ""
    zone: Zone = ""  # its --zone ("": none)


class Welcome(Body):
    """The answer to HELLO. To a connector it carries the mesh's brokers that take
    connectors (later changes come as BROKERS); to a dialling broker the accepting
    broker's ``listen`` address, the link ``tag`` it assigned to the dialler, and its
    NATS client address (``nats``, as in HELLO)."""

    protocol: U16 = PROTOCOL_VERSION
    broker: str = ""
    slot: U16 = 1
    max_frame: U32 = DEFAULT_MAX_FRAME
    listen: str = ""
    tag: U32 = 0
    nats: NatsAddress = ""
    brokers: list[BrokerInfo] = msgspec.field(default_factory=list)
    trace_every: U32 = 0  # a connector traces one send in this many (0: none)


class Register(Body):
    """Register a service: ``instance`` 0 asks the broker for a dynamic id."""

    server: str
    instance: U32 = 0


class AddressBody(Body):
    """A body that names one address (REGISTERED, UNREGISTER)."""

    address: bytes


class Membership(Body):
    """JOIN / LEAVE: ``member`` (a unicast the link owns) joins or leaves ``group``."""

    member: bytes
    group: bytes


ServiceSubject = Annotated[bytes, msgspec.Meta(max_length=MAX_SUBJECT)]


class SubjectInterest(Body):
    """SUBSCRIBE / UNSUBSCRIBE: ``member`` (a unicast the link owns) subscribes to, or
    unsubscribes from, the subject pattern ``subject``, in queue group ``queue`` (b"":
    none). The lengths are bounded here; whether they are a valid pattern and queue
    group, the broker checks (INVALID_SUBJECT)."""

    member: bytes
    subject: ServiceSubject
    queue: ServiceSubject = b""


class Empty(Body):
    """OK, PING, PONG, DRAINING, SYNCED."""


class StatRequest(Body):
    """STAT: ``detail`` False leaves out the per-service and per-group lists (large meshes).
    ``page`` > 0 asks for a further page of an answer too large for one frame."""

    detail: bool = True
    page: U32 = 0


class Error(Body):
    """``redirect`` (with code REDIRECT) names a broker that takes connectors."""

    code: U16
    message: str = ""
    redirect: str = ""


class DeliveryFailure(Body):
    """TIMEOUT / NO_ROUTE: the request (or notified send) ``msg_id`` from ``src`` failed.
    ``code`` is 0, or PERMISSION_DENIED for a frame its sender's user may not send.

    ``also``: for a connector that asked (``Hello.batched_no_route``), the msg_ids of the
    frames right after ``msg_id``'s from ``src`` to ``dst``, refused for the same reason
    and code (docs/protocol.md §7)."""

    msg_id: U64
    src: bytes
    dst: bytes
    reason: str = ""  # why, when it is not the obvious one (e.g. a frame too large)
    code: U16 = 0
    also: Annotated[list[U64], msgspec.Meta(max_length=MAX_ALSO)] = msgspec.field(
        default_factory=list
    )


class Stats(Body):
    """STATS: the answer in ``data``; or, when it does not fit in one frame, page ``page``
    of ``pages`` of its msgpack encoding in ``blob`` (the client asks for each page)."""

    data: dict[str, Any] = msgspec.field(default_factory=dict)
    page: U32 = 0
    pages: U32 = 1
    blob: bytes = b""


class Bye(Body):
    reason: str = ""


class Brokers(Body):
    """BROKERS: the mesh's brokers. To a connector: where it may fail over to (ready,
    not draining). Between brokers: gossip, so every broker links to every other."""

    brokers: list[BrokerInfo] = msgspec.field(default_factory=list)


# Route operations between brokers, (op, address, extra): ADD (address, owner), REMOVE
# (address, b""), JOIN (member, group), LEAVE (member, group). A broker only announces
# changes of its own (local) services; receivers apply them conditionally. An ADD's
# owner is the registering connector's session and its link's epoch (``owner_of``).
OP_ADD = 1
OP_REMOVE = 2
OP_JOIN = 3
OP_LEAVE = 4
# A NATS interest of the sender's clients (docs/nats.md, "Across the mesh"): (OP_INTEREST,
# subject pattern, ``interest_extra(count, queue)``). ``count`` is the number of the
# sender's subscriptions to the pattern in that queue group (for no queue group: 1 for
# any, 0 for none); 0 ends the entry. Each operation states the whole count, so a
# snapshot and the changes after it need no order between them.
OP_INTEREST = 5
# In a snapshot only: (OP_LOST_CAPTURE, group, broker name) -- the group's stream went with
# that broker's link, lost by the sender (meshbus.broker.core.captures), so that a broker
# that never saw the stream's member does not take "no member" for the answer either.
OP_LOST_CAPTURE = 6
_EPOCH = 4  # bytes of the epoch at the end of an ADD's owner


def owner_of(session: bytes, epoch: int) -> bytes:
    """An ADD's extra: the session, then the epoch of the link it registered through."""
    return session + epoch.to_bytes(_EPOCH, "big") if session else b""


def split_owner(extra: bytes) -> tuple[bytes, int]:
    """(session, epoch) from an ADD's extra; (b"", 0) when it names no session."""
    if len(extra) <= _EPOCH:
        return b"", 0
    return extra[:-_EPOCH], int.from_bytes(extra[-_EPOCH:], "big")


_COUNT = 4  # bytes of the count at the head of an interest's extra


def interest_extra(count: int, queue: bytes) -> bytes:
    """An OP_INTEREST's extra: the count (u32), then the queue group (empty for none)."""
    return count.to_bytes(_COUNT, "big") + queue


def split_interest(extra: bytes) -> tuple[int, bytes]:
    """(count, queue) from an OP_INTEREST's extra; ValueError when it is too short."""
    if len(extra) < _COUNT:
        raise ValueError(f"an interest of {len(extra)} bytes has no count")
    return int.from_bytes(extra[:_COUNT], "big"), extra[_COUNT:]


RouteOp = tuple[U8, bytes, bytes]


class Routes(Body):
    """ROUTES: route operations. ``snapshot`` marks the peer's full local state sent at
    link-up, in chunks; ``complete`` marks its last chunk. ``seq`` (not on snapshots)
    numbers the last operation of the frame: the receiver answers ROUTED with it once
    they are applied."""

    ops: list[RouteOp] = msgspec.field(default_factory=list)
    snapshot: bool = False
    complete: bool = False
    seq: Counter = 0


class Routed(Body):
    """ROUTED: every route operation up to ``seq`` from the receiver is applied here."""

    seq: Counter


class Claim(Body):
    """CLAIM / RELEASE: reserve (or give back) ``key`` mesh-wide for ``session``.

    ``key`` is a 16-byte unicast address, or a dynamic-id slot (cast byte 0)."""

    key: bytes
    session: bytes = b""


class Load(Body):
    """LOAD: a broker's state, sent to its peers on change and as the heartbeat."""

    connectors: Count = 0
    capacity: Count = 0
    slot: U16 = 0
    ready: bool = False
    draining: bool = False
    streams: list[str] = msgspec.field(default_factory=list)  # the streams it hosts
    # The round trip between two brokers, on the heartbeat's LOAD (no frame of its own, so
    # nothing but a peer's own heartbeat keeps it alive): the sender's clock as it sent
    # this, and the ``sent_at`` of the receiver's last LOAD with how long it was held
    # here since. Each end's clock is read by that end only. 0: not stamped.
    sent_at: Seconds = 0.0
    echo: Seconds = 0.0
    held: Seconds = 0.0
    # Replicated streams (docs/raft.md, "The meta group"): the sender's --zone, the
    # incarnation of its Raft state (0: no --data-dir), the voters of the mesh's meta
    # group and its leader as the sender knows them (empty: none known).
    zone: Zone = ""
    incarnation: Counter = 0
    meta_voters: Annotated[list[BrokerName], msgspec.Meta(max_length=MAX_META_VOTERS)] = (
        msgspec.field(default_factory=list)
    )
    meta_leader: BrokerName = ""


class Ready(Body):
    """READY: a joined broker takes connectors now. ``counts`` is the connector count per
    broker it saw (itself included): every broker computes its excess from this one view."""

    counts: dict[str, Count] = msgspec.field(default_factory=dict)


class Move(Body):
    """MOVE: broker -> connector, reconnect to ``address`` (rebalance or drain)."""

    address: str
    reason: str = ""


class Drain(Body):
    """DRAIN: ask the broker to drain; ``grace`` 0 uses its configured grace period."""

    grace: Seconds = 0.0


class MembersRequest(Body):
    """MEMBERS: the unicast members of ``group``, mesh-wide. With ``pick``, the one member
    an anycast send would reach now (a local one first), for a reliable anycast send."""

    group: bytes
    pick: bool = False


class MemberList(Body):
    members: list[bytes] = msgspec.field(default_factory=list)


class GroupBind(Body):
    """GROUP_BIND: which member of anycast ``group`` holds message group ``key``; binds
    it if nobody does. ``failed``: the member the sender could not reach (it may have
    died); ``expiry``: idle seconds before the binding is dropped (0: the broker's)."""

    group: bytes
    key: bytes
    failed: bytes = b""
    expiry: Seconds = 0.0
    sender: bytes = b""  # the service sending: the group ends when all its senders ended it


class GroupBound(Body):
    member: bytes
    reassigned: bool = False  # the group was bound to another member before


class GroupEnd(Body):
    """GROUP_END: ``sender`` sent the final message of group ``key`` of ``group``; the
    binding goes once every sender that bound the group has ended it."""

    group: bytes
    key: bytes
    sender: bytes = b""


# (anycast group, group key, member -- b"" to unbind --, idle expiry in seconds)
GroupOp = tuple[bytes, bytes, bytes, Seconds]


class Groups(Body):
    """GROUPS: group bindings made or dropped by the sender (its home groups)."""

    ops: list[GroupOp] = msgspec.field(default_factory=list)


class Relayed(Body):
    """RELAYED: the answer (a control frame of ``type`` with body bytes ``body``) to a
    request this broker relayed on behalf of one of its connectors."""

    type: U16
    body: bytes = b""


class Left(Body):
    """LEFT: services that left the mesh (unregistered, or their connector died)."""

    addresses: list[bytes] = msgspec.field(default_factory=list)


class Revoked(Body):
    """REVOKED: ``address``, which the connector registered, is another service's now:
    it was registered twice while the mesh was split, and the mesh kept the other."""

    address: bytes
    reason: str = ""


class TraceReport(Body):
    """TRACE: a connector got a traced frame (``sent_at`` from its EXT block)."""

    src: bytes = b""
    msg_id: U64 = 0
    dst: bytes = b""
    sent_at: float = 0.0
    received_at: float = 0.0


# Replicated streams: at most this many replicas.
MAX_REPLICAS = 5


class StreamRequest(Body):
    """STREAM: ``op`` is one of add, delete, info, list, fetch, consumer_add,
    consumer_delete, consumer_info, next, ack; each uses the fields it needs."""

    op: str
    stream: str = ""
    captures: list[bytes] = msgspec.field(default_factory=list)
    max_msgs: Seq = 0
    max_bytes: ByteCount = 0
    max_age: Seconds = 0.0
    dedupe_window: Seconds = 120.0
    from_seq: Seq = 1
    max_count: Count = 100
    consumer: str = ""
    ack_wait: Seconds = 30.0
    max_deliver: Count = 5
    start_seq: Seq = 0
    seqs: list[Seq] = msgspec.field(default_factory=list)
    columns: bool = False  # fetch: answer in StreamReply.blocks, not .messages
    # Who asks (docs/security.md, "Streams and consumers have owners"): set by the
    # connector's broker, whatever the connector wrote, and read by the stream's host from
    # a peer only. ``user``: its user ("" on a broker without users); ``any_consumer``:
    # it may use and delete every consumer (the operator right "consumers").
    user: Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)] = ""
    any_consumer: bool = False
    # add: how many brokers hold the stream (1, 3 or 5; docs/guarantees.md); more than
    # one makes it a Raft group (RAFT frames between them).
    replicas: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)] = 1
    # fetch, info of a replicated stream: answered by its leader (a replica answers from
    # its committed prefix, which may be a little behind).
    current: bool = False


# Replicated streams (RAFT): a group's members -- its replicas, and one more while a
# replacement is under way (docs/raft.md, "Replacing a replica") --, its node ids (the
# founding replicas 1..5, each later member the next number: never reused), the entries
# one message carries (the driver's max_append_entries), the messages of one frame.
MAX_MEMBERS = MAX_REPLICAS + 1
MAX_NODE_ID = 0xFFFF_FFFF
MAX_RAFT_ENTRIES = 64
MAX_RAFT_MESSAGES = 256
MAX_GROUP_NAME = 255
MAX_META_COMMAND = 64 * 1024  # a stream's configuration and its members, with room
RaftNodeId = Annotated[int, msgspec.Meta(ge=1, le=MAX_NODE_ID)]
NodeIds = Annotated[list[RaftNodeId], msgspec.Meta(max_length=MAX_MEMBERS)]


class RaftEntryBody(msgspec.Struct, array_like=True, frozen=True):
    """A log entry; ``voters`` set (learners with it) on a membership change."""

    term: Counter
    index: Counter
    data: bytes = b""
    voters: NodeIds | None = None
    learners: NodeIds = msgspec.field(default_factory=list)


class RaftSnapshotBody(msgspec.Struct, array_like=True, frozen=True):
    index: Counter
    term: Counter
    voters: NodeIds = msgspec.field(default_factory=list)
    learners: NodeIds = msgspec.field(default_factory=list)
    data: bytes = b""


class RaftMessageBody(msgspec.Struct, array_like=True, frozen=True):
    """One Raft message (meshbus.raft.Message; ``kind`` numbered in
    meshbus.broker.replication.wire)."""

    kind: U8
    sender: RaftNodeId
    to: RaftNodeId
    term: Counter
    index: Counter = 0
    log_term: Counter = 0
    entries: Annotated[list[RaftEntryBody], msgspec.Meta(max_length=MAX_RAFT_ENTRIES)] = (
        msgspec.field(default_factory=list)
    )
    commit: Counter = 0
    reject: bool = False
    hint_index: Counter = 0
    hint_term: Counter = 0
    snapshot: RaftSnapshotBody | None = None
    context: Counter = 0
    transfer: bool = False
    epoch: U32 = 0
    repairing: bool = False


class RaftMemberBody(msgspec.Struct, array_like=True, frozen=True):
    """A member of a group: its node id, its broker and the broker's incarnation (0: a
    founding member's, not known yet)."""

    node: RaftNodeId
    broker: Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)]
    incarnation: Counter = 0


class RaftJoinBody(msgspec.Struct, array_like=True, frozen=True):
    """The receiver is added to the group as ``node``, if its incarnation is
    ``incarnation``; ``members`` the group's members with it (docs/raft.md)."""

    node: RaftNodeId
    incarnation: Counter
    members: Annotated[list[RaftMemberBody], msgspec.Meta(max_length=MAX_MEMBERS)]


# A replica copying a stream's store from another (docs/raft.md, "Snapshots of a
# stream"): the blocks of one answer, the consumers of a stream, the pending deliveries
# of one consumer. A frame's size bounds them first; these bound what a decoder makes.
MAX_COPY_BLOCKS = 4096
MAX_COPY_CONSUMERS = 10_000
MAX_COPY_PENDING = 1 << 20
MAX_CONSUMER_NAME = 64
MAX_PUBLISH_ID = 0xFFFF


class RaftFetchBody(msgspec.Struct, array_like=True, frozen=True):
    """A replica asks for the stream's blocks from ``from_seq`` on; with them, once they
    reach the stream's last message, the stream's image (``RaftImageBody``)."""

    from_seq: Seq


class RaftBlockBody(msgspec.Struct, array_like=True, frozen=True):
    """One stored block, as it is (meshbus.storage.blocks): its seqs, its time, its CRC32."""

    first: Seq
    last: Seq
    stored_at: Clock
    crc: U32
    data: bytes


class RaftConsumerImageBody(msgspec.Struct, array_like=True, frozen=True):
    name: Annotated[str, msgspec.Meta(max_length=MAX_CONSUMER_NAME)]
    ack_wait: Seconds
    max_deliver: Count
    start_seq: Seq
    next_seq: Seq
    dropped: Counter
    owner: Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)]
    # (seq, deliveries so far, redelivery deadline)
    pending: Annotated[
        list[tuple[Seq, Count, Clock]], msgspec.Meta(max_length=MAX_COPY_PENDING)
    ] = msgspec.field(default_factory=list)


class RaftImageBody(msgspec.Struct, array_like=True, frozen=True):
    """A stream but its messages, as of Raft entry ``applied`` (meshbus.storage.images)."""

    applied: Counter
    first_seq: Seq
    last_seq: Seq
    payload_bytes: ByteCount
    consumers: Annotated[
        list[RaftConsumerImageBody], msgspec.Meta(max_length=MAX_COPY_CONSUMERS)
    ] = msgspec.field(default_factory=list)
    # (time, publish id, seq): ids in the dedupe window of messages retention removed
    publish_ids: Annotated[
        list[tuple[Clock, Annotated[bytes, msgspec.Meta(max_length=MAX_PUBLISH_ID)], Seq]],
        msgspec.Meta(max_length=MAX_COPY_PENDING),
    ] = msgspec.field(default_factory=list)


class RaftChunkBody(msgspec.Struct, array_like=True, frozen=True):
    """The answer to a ``RaftFetchBody`` of ``from_seq``: blocks from there on, and the
    image once they reach the stream's last message. ``missing``: the sender holds no
    such stream (any more)."""

    from_seq: Seq
    blocks: Annotated[list[RaftBlockBody], msgspec.Meta(max_length=MAX_COPY_BLOCKS)] = (
        msgspec.field(default_factory=list)
    )
    image: RaftImageBody | None = None
    missing: bool = False


class RaftFrame(Body):
    """RAFT: messages of the Raft group of replicated stream ``group`` (docs/protocol.md).
    With ``replicas`` (and ``create``, the stream's configuration) it founds the group on
    the receiving broker: the broker that added the stream sends it to every replica;
    with ``join`` as well, it adds the receiver to the group as a new member (the
    group's leader sends it). ``incarnation`` is the sender's (0: a broker from before
    incarnations); ``stranger`` says the sender holds no such group (the answer to
    messages of a group it does not hold). ``fetch`` and ``chunk``: a replica copying the
    stream's store from the sender of a snapshot, and its answer."""

    group: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GROUP_NAME)]
    messages: Annotated[list[RaftMessageBody], msgspec.Meta(max_length=MAX_RAFT_MESSAGES)] = (
        msgspec.field(default_factory=list)
    )
    replicas: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_USER_NAME)]],
        msgspec.Meta(max_length=MAX_REPLICAS),
    ] = msgspec.field(default_factory=list)
    create: bytes = b""
    incarnation: Counter = 0
    stranger: bool = False
    join: RaftJoinBody | None = None
    # Founding: the incarnation each of ``replicas`` must be to found the group (0: any),
    # as the meta group committed them; a broker that is another self founds nothing.
    incarnations: Annotated[list[Counter], msgspec.Meta(max_length=MAX_REPLICAS)] = msgspec.field(
        default_factory=list
    )
    # The meta group (``group`` is its name): a command for its leader to commit, sent
    # by the broker that needs it with its ``serial``; the leader's answer, once it is
    # applied there, carries the same serial and the ``outcome``.
    command: Annotated[bytes, msgspec.Meta(max_length=MAX_META_COMMAND)] = b""
    serial: Counter = 0
    outcome: Annotated[str, msgspec.Meta(max_length=64)] = ""
    fetch: RaftFetchBody | None = None
    chunk: RaftChunkBody | None = None


# seq, stored_at, src, dst, group, priority, payload, delivery count, header block
StoredRow = tuple[int, float, bytes, bytes, bytes, int, bytes, int, bytes]


class StreamReply(Body):
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    streams: list[dict[str, Any]] = msgspec.field(default_factory=list)
    messages: list[StoredRow] = msgspec.field(default_factory=list)
    acked: Count = 0
    # A columnar fetch: stored blocks as they are (meshbus.protocol.blocks), a bulk
    # reader's fast path with no work per message on either end.
    blocks: list[BlockSlice] = msgspec.field(default_factory=list)


# A NATS subject or queue group on the wire between brokers: a subject is at most a
# control line (--nats-max-control-line caps that at 1 MiB), and a queue group a token of it.
MAX_NATS_SUBJECT = 1024 * 1024
NatsSubject = Annotated[bytes, msgspec.Meta(max_length=MAX_NATS_SUBJECT)]
# The queue groups one message may be handed to on one broker: every group matching its
# subject there gets one copy, so as many as the receiver's subscriptions could be.
MAX_NATS_QUEUES = 100_000
# (subject, reply subject -- b"" for none --, header size, header block and payload,
# whether the receiver's plain subscriptions get it, the queue groups whose member it is
# for). The receiver checks the subjects and that the header size fits the data.
NatsRow = tuple[
    NatsSubject,
    NatsSubject,
    U32,
    bytes,
    bool,
    Annotated[list[NatsSubject], msgspec.Meta(max_length=MAX_NATS_QUEUES)],
]


class NatsMessages(Body):
    """NATS_MSGS: messages NATS clients of the sender published, for the receiver's NATS
    clients: delivered there, never forwarded again (one hop, as every frame)."""

    msgs: list[NatsRow] = msgspec.field(default_factory=list)


BODY_TYPES: dict[ControlType, type[Body]] = {
    ControlType.HELLO: Hello,
    ControlType.WELCOME: Welcome,
    ControlType.REGISTER: Register,
    ControlType.REGISTERED: AddressBody,
    ControlType.UNREGISTER: AddressBody,
    ControlType.JOIN: Membership,
    ControlType.LEAVE: Membership,
    ControlType.OK: Empty,
    ControlType.ERROR: Error,
    ControlType.TIMEOUT: DeliveryFailure,
    ControlType.NO_ROUTE: DeliveryFailure,
    ControlType.STAT: StatRequest,
    ControlType.STATS: Stats,
    ControlType.PING: Empty,
    ControlType.PONG: Empty,
    ControlType.BYE: Bye,
    ControlType.BROKERS: Brokers,
    ControlType.ROUTES: Routes,
    ControlType.CLAIM: Claim,
    ControlType.RELEASE: Claim,
    ControlType.LOAD: Load,
    ControlType.READY: Ready,
    ControlType.DRAINING: Empty,
    ControlType.MOVE: Move,
    ControlType.DRAIN: Drain,
    ControlType.ROUTED: Routed,
    ControlType.SYNCED: Empty,
    ControlType.MEMBERS: MembersRequest,
    ControlType.MEMBER_LIST: MemberList,
    ControlType.GROUP_BIND: GroupBind,
    ControlType.GROUP_BOUND: GroupBound,
    ControlType.GROUP_END: GroupEnd,
    ControlType.GROUPS: Groups,
    ControlType.STREAM: StreamRequest,
    ControlType.STREAM_REPLY: StreamReply,
    ControlType.RELAYED: Relayed,
    ControlType.WATCH: Empty,
    ControlType.LEFT: Left,
    ControlType.TRACE: TraceReport,
    ControlType.REVOKED: Revoked,
    ControlType.CHALLENGE: Challenge,
    ControlType.AUTH: Auth,
    ControlType.RAFT: RaftFrame,
    ControlType.NATS_MSGS: NatsMessages,
    ControlType.SUBSCRIBE: SubjectInterest,
    ControlType.UNSUBSCRIBE: SubjectInterest,
}

DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {
    int(t): msgspec.msgpack.Decoder(cls) for t, cls in BODY_TYPES.items()
}
ENCODER = msgspec.msgpack.Encoder()


def encode_in_bounds(ctype: ControlType, body: Body) -> bytes:
    """``body`` encoded, once it is checked the way the receiver's decoder checks it: a
    ValueError names the field when a number is outside its bounds -- what the receiver
    refuses as a PROTOCOL_ERROR, closing the link -- for a sender that would rather
    refuse it itself (a client's InvalidArgument). The check decodes the body once more:
    for requests, not for the hot path."""
    raw = ENCODER.encode(body)
    try:
        DECODERS[int(ctype)].decode(raw)
    except msgspec.ValidationError as exc:
        raise ValueError(f"a number out of range in the {ctype.name} request: {exc}") from None
    return raw
