"""Durable streams on a broker: capture, group commit, acks, and the STREAM requests.

A stream hosted here is a *member* of each group it captures, with an address
of its own, like any service: the routing table and its mesh-wide sync bring
every message sent to a captured address to this broker, one copy per broker,
with no code of their own. The member's link is a ``StreamSink``: the broker's
hot path queues frames for it like for any link, and at the end of the read the
sink gets them as one block of bytes.

Group commit: what the sinks receive during one turn of the event loop is
appended in one ``append_batch`` per stream (one transaction), and only then
are the reliable frames among them acknowledged -- an ack means *stored*. A
reliable frame is stored once: it is its own publish id (source, message id)
unless it carries one (``publish_id`` in the extension block).

STREAM requests name a stream; one hosted by another broker is relayed there
(the brokers tell each other the streams they host in their LOAD heartbeats).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from operator import itemgetter
from typing import IO, Any

import msgspec

from meshbus.address import CAST_MULTICAST, describe_address
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.captures import STREAM_SERVER
from meshbus.broker.core.endpoint import Endpoint, LinkRole, LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import Peers
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.mesh.relay import Relay
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.replication.compaction import CompactionPolicy
from meshbus.broker.replication.consumers import ConsumerCommand, Outcome
from meshbus.broker.replication.driver import RaftDriver, ReplicationError
from meshbus.broker.replication.meta import ADD, ALREADY, EXISTS, ConfigBody, MetaCommand
from meshbus.broker.replication.placement import replacement_order, spread
from meshbus.broker.replication.streams import ReplicatedStreams
from meshbus.broker.replication.transport import PeerTransport
from meshbus.broker.security.permissions import CONSUMERS, stream_operation
from meshbus.broker.security.quotas import STREAM_BYTES
from meshbus.broker.upkeep import StoreUpkeep
from meshbus.errors import ProtocolError
from meshbus.protocol.batch import received_rows
from meshbus.protocol.control import (
    OP_ADD,
    OP_JOIN,
    OP_LEAVE,
    OP_REMOVE,
    Load,
    RaftFrame,
    StoredRow,
    StreamReply,
    StreamRequest,
    owner_of,
)
from meshbus.protocol.ext import Ext, ack_frames, split
from meshbus.protocol.headers import decode_headers
from meshbus.protocol.layout import (
    DATA_HEADER,
    FLAG_ACK,
    FLAG_EXT,
    FLAG_RELIABLE,
    ControlType,
    ErrorCode,
)
from meshbus.raft import ProposalRefused, RaftError, RaftSettings, Randomness
from meshbus.storage.data_dir import lock_data_dir
from meshbus.storage.errors import ConsumerNotFound, StoreError, StoreFull, StreamNotFound
from meshbus.storage.raftlog import RaftWal
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import (
    ConsumerConfig,
    ConsumerInfo,
    MemoryStreamStore,
    MirroredStore,
    NewMessage,
    StoredMessage,
    StreamConfig,
    StreamStatus,
)
from meshbus.util import FailureLog

log = logging.getLogger("meshbus.broker")

# The requests a replica of a replicated stream sends on to its leader: they change the
# stream's state (a consumer's is in its Raft log too). And the reads that go there too
# when asked with ``current``.
_CONSUMER_CHANGES = frozenset({"consumer_add", "consumer_delete", "next", "ack"})
_LEADER_ONLY = _CONSUMER_CHANGES | {"delete"}
_READS = frozenset({"fetch", "info", "consumer_info"})

_unpack_header = DATA_HEADER.unpack_from
_HEADER_SIZE = DATA_HEADER.size
# NewMessage is a NamedTuple: tuple.__new__ builds one without its Python-level __new__.
_new_message = tuple.__new__
_payload_of = itemgetter(2)  # NewMessage.payload
# Room left in a fetch answer for everything but the payloads.
_ROW_OVERHEAD = 96
# Replicated streams (meshbus.broker.replication): a tick every --raft-tick seconds; an
# election after 10-20 silent ticks, a heartbeat every tick; 4 entries per APPEND of at
# most an eighth of a frame each, so an APPEND fits in a peer frame.
RAFT_SETTINGS = RaftSettings(election_ticks=10, heartbeat_ticks=1, max_append_entries=4)
# The same in a block (four indices, two offsets), with room for every message to
# have a source, destination, group and priority of its own.
_COLUMN_OVERHEAD = 128


class StreamTaken(ReplicationError):
    """A replicated stream's add of a name the mesh has a stream of (ERROR STREAM_EXISTS)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"stream {name!r} exists already in the mesh; delete it first or choose another name"
        )


class StreamSink(Endpoint):
    """Where a stream's member is attached: what is routed to it is stored. It has no
    socket; the outbox hands it a read's frames as one block of bytes."""

    def __init__(self, store: Callable[[bytes], None]) -> None:
        # Stores any frame a connector may send. No link id: it is never a TCP link.
        super().__init__(0, LinkRole.STREAM, max_frame=1 << 40)
        self.name = "streams"
        self._store = store

    def send(self, data: bytes | bytearray) -> None:
        self._store(bytes(data))


class StreamHost:
    """The streams this broker hosts, and the STREAM requests (answered here or relayed
    to the stream's host)."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        routing: RoutingTable[Endpoint],
        sync: RouteSync,
        relay: Relay,
        outbox: Outbox,
        usage: UsageTable,
        hosted_changed: Callable[[], None],
        may_capture: Callable[[str, bytes], bool],
        peers: Peers,
        ready_brokers: Callable[[], dict[str, str]],
        randomness: Randomness,
    ) -> None:
        """``usage`` counts the bytes of the streams each user adds (its quota);
        ``hosted_changed`` tells the peers at once that the streams hosted here (or what
        this broker knows of the meta group) changed.
        ``may_capture(owner, group)``: a stream added by user ``owner`` may capture
        ``group`` now (asked at start and after every reload). ``peers``, the mesh's
        ``ready_brokers`` (this one included, each with its zone) and ``randomness``
        (election timeouts) are for replicated streams."""
        self._config = config
        self._routing = routing
        self._sync = sync
        self._relay = relay
        self._outbox = outbox
        self._usage = usage
        self._hosted_changed = hosted_changed
        self._may_capture = may_capture
        data_dir = config.data_dir
        self.store: MirroredStore
        self._lock: IO[bytes] | None = None
        self._ready_brokers = ready_brokers
        self._peers = peers
        self.replicated: ReplicatedStreams | None = None
        self._upkeep: StoreUpkeep | None = None
        if data_dir:
            os.makedirs(data_dir, exist_ok=True)
            self._lock = lock_data_dir(data_dir)
            path = os.path.join(data_dir, "streams.db")
            self.store = store = SqliteStreamStore(path, fsync=config.fsync)
            self._upkeep = StoreUpkeep(store)
            self.replicated = self._replication(data_dir, store, peers, randomness)
        else:
            self.store = MemoryStreamStore()
        self.sink = StreamSink(self._captured)
        self.members: dict[str, bytes] = {}  # stream -> its member address
        self._by_member: dict[bytes, str] = {}
        self._by_group: dict[bytes, list[str]] = defaultdict(list)
        # stream -> the groups it captures no more: its owner may not join them now
        self.paused: dict[str, tuple[bytes, ...]] = {}
        # stream -> (messages of this turn, sender -> reliable message ids to acknowledge)
        self._batch: dict[str, tuple[list[NewMessage], dict[bytes, list[int]]]] = {}
        self.elsewhere: dict[str, Link] = {}  # streams hosted by peers
        # stream -> (its host, since when): hosted by a peer this broker lost the link to,
        # so that a request for it says so instead of "no such stream".
        self.unreachable: dict[str, tuple[str, float]] = {}
        self.stored = 0
        self.dropped = 0
        self._store_failures = FailureLog(log, "could not store")
        self._adding: set[asyncio.Task[None]] = set()  # replicated adds waiting for the meta group

    def _replication(
        self, data_dir: str, store: SqliteStreamStore, peers: Peers, randomness: Randomness
    ) -> ReplicatedStreams:
        wal, recovery = RaftWal.open(os.path.join(data_dir, "raft.wal"))
        if recovery.damage:
            log.error(
                "the Raft log was damaged: its replicated streams repair from their leaders",
                extra={"path": wal.path, "damage": recovery.damage},
            )
        elif recovery.torn_bytes:
            log.warning(
                "the Raft log ended in a write cut short by a crash; it was dropped",
                extra={"path": wal.path, "bytes": recovery.torn_bytes},
            )
        config = self._config
        transport = PeerTransport(peers, config.max_frame, wal.incarnation)

        def run_blocking(work: Callable[[], None]) -> asyncio.Future[None]:
            # Submitted now, not when awaited: the driver applies while its log syncs.
            return asyncio.get_running_loop().run_in_executor(None, work)

        def driver(machine: ReplicatedStreams) -> RaftDriver:
            return RaftDriver(
                name=lambda: config.name,
                wal=wal,
                transport=transport,
                machine=machine,
                settings=RAFT_SETTINGS,
                randomness=randomness,
                run_blocking=run_blocking,
                replace_after=math.ceil(config.replace_after / config.raft_tick),
                candidates=candidates,
                compaction=CompactionPolicy(config.raft_compact_entries, config.raft_compact_bytes),
                # The log file is rewritten once past twice its live records and this:
                # with compaction, a few snapshots' worth.
                rewrite_slack=8 * config.raft_compact_bytes,
            )

        def candidates(stream: str) -> list[str]:
            replicated = self.replicated
            assert replicated is not None
            voters, learners = replicated.driver.members_of(stream)
            order = replacement_order(stream, self._ready_brokers(), [*voters, *learners])
            return [b for b in order if peers.get(b) is not None]

        return ReplicatedStreams(
            name=lambda: config.name,
            store=store,
            transport=transport,
            driver=driver,
            capture=self._lead,
            release=self._unhost,
            deleted=self._replica_deleted,
            acknowledge=self._acknowledge,
            entry_limit=config.max_frame // 8,
            linked=lambda broker: peers.get(broker) is not None,
            meta_voters=config.meta_voters,
            meta_changed=self._hosted_changed,
            copy_retry=RAFT_SETTINGS.election_ticks,
        )

    def advertised(self) -> tuple[int, list[str], str]:
        """What this broker's LOAD says for replicated streams: its incarnation, the meta
        group's voters and leader as it knows them."""
        replicated = self.replicated
        if replicated is None:
            return 0, [], ""
        voters, leader = replicated.meta.advertised()
        return replicated.driver.incarnation, voters, leader

    def peer_meta(self, peer: Link, load: Load) -> None:
        if self.replicated is not None:
            meta = self.replicated.meta
            meta.peer_loaded(peer.name, load.meta_voters, load.meta_leader, load.incarnation)

    def names(self) -> list[str]:
        return list(self.members)

    # -- hosting -----------------------------------------------------------------------

    def restore(self) -> None:
        """The streams in the store start capturing again (the broker is ready: it has
        a slot for their member addresses); a replicated stream only where it leads."""
        replicated = self.replicated
        if replicated is not None:
            replicated.restore()
        for config in self.store.streams():
            self._usage.stream_added(config.owner, config.name, config.max_bytes)
            if replicated is None or config.name not in replicated:
                self._host(config)
        if self._upkeep is not None:
            self._upkeep.start()

    def _purge_later(self) -> None:
        if self._upkeep is not None:
            self._upkeep.purge_later()

    def _host(self, config: StreamConfig) -> None:
        if config.name in self.members:
            return
        member = self._routing.allocate_dynamic(STREAM_SERVER, self.sink)
        self._sync.announce(OP_ADD, member)
        self._capture_as(config, member)

    def _lead(self, config: StreamConfig, member: bytes, session: bytes, epoch: int) -> None:
        """Replicated stream ``config`` captures here, as the stream's fixed member, taken
        over from whoever had it with a lower ``epoch`` (meshbus.broker.replication)."""
        routing = self._routing
        epoch = min(epoch, 0xFFFF_FFFF)
        owner = routing.owner(member)
        if owner is self.sink:
            return
        if owner is not None and routing.epoch_of(member) >= epoch:
            # A leader of a later term has it (the peers keep that one too), or another
            # replica without a leader, as much entitled: taking it back and forth would
            # only churn the routes.
            return
        if config.name in self.members:
            # Taken over by a peer since (another replica without a leader, with the same
            # epoch), which may be gone now: start again.
            self._unhost(config.name)
        if owner is None:
            routing.add_service(member, self.sink, session, epoch)
        else:
            routing.take_over(member, self.sink, session, epoch)
        self._sync.announce(OP_ADD, member, owner_of(session, epoch))
        self._capture_as(config, member)

    def _capture_as(self, config: StreamConfig, member: bytes) -> None:
        self.members[config.name] = member
        self._by_member[member] = config.name
        self._capture(config)
        self._hosted_changed()

    def _capture(self, config: StreamConfig) -> None:
        """The stream captures each of its groups its owner may join now, and stops
        capturing the others (docs/security.md, "Streams and consumers have owners")."""
        name = config.name
        member = self.members[name]
        routing, sync, by_group = self._routing, self._sync, self._by_group
        paused = []
        for group in config.captures:
            allowed = not config.owner or self._may_capture(config.owner, group)
            capturing = name in by_group.get(group, ())
            if allowed and not capturing:
                routing.join(member, group)
                sync.announce(OP_JOIN, member, group)
                by_group[group].append(name)
            elif not allowed:
                paused.append(group)
                if capturing:
                    routing.leave(member, group)
                    sync.announce(OP_LEAVE, member, group)
                    by_group[group].remove(name)
        if tuple(paused) != self.paused.get(name, ()):
            log.warning(
                "a stream's captures follow its owner's rights",
                extra={
                    "stream": name,
                    "owner": config.owner,
                    "paused": [describe_address(group) for group in paused],
                },
            )
        if paused:
            self.paused[name] = tuple(paused)
        else:
            self.paused.pop(name, None)

    def recheck_captures(self) -> None:
        """After a reload: each stream added by a user captures what that user may join
        now."""
        for config in self.store.streams():
            if config.owner and config.name in self.members:
                self._capture(config)

    def host_local(self, config: StreamConfig) -> None:
        """A stream of the broker's own (telemetry), created unless it exists."""
        self.store.add_stream(config)
        self._host(config)

    def _unhost(self, name: str) -> None:
        member = self.members.pop(name, None)
        if member is None:
            return
        del self._by_member[member]
        self.paused.pop(name, None)
        for streams in self._by_group.values():
            if name in streams:
                streams.remove(name)
        if self._routing.owner(member) is self.sink:  # else a new leader took it over
            self._routing.remove_service(member, self.sink)
            self._sync.announce(OP_REMOVE, member)
        self._hosted_changed()

    def on_raft(self, link: Link, correlation: int, body: RaftFrame) -> None:
        """RAFT from a peer: its replicated streams' messages (meshbus.broker.replication)."""
        if self.replicated is not None:
            self.replicated.on_frame(link, correlation, body)
        else:
            log.warning(
                "a RAFT frame for a replicated stream, and this broker has no --data-dir",
                extra={"stream": body.group, "from": link.name},
            )

    def peer_streams(self, peer: Link, names: list[str]) -> None:
        if self.replicated is not None:
            self.replicated.links_changed()  # a leader linked again
        for name, link in list(self.elsewhere.items()):
            if link is peer and name not in names:
                del self.elsewhere[name]
        for name, (host, _) in list(self.unreachable.items()):
            if host == peer.name or name in names:
                del self.unreachable[name]
        for name in names:
            self.elsewhere[name] = peer

    def peer_lost(self, peer: Link) -> None:
        if self.replicated is not None:
            self.replicated.meta.peer_lost(peer.name)
            self.replicated.peer_lost(peer.name)
        now = time.time()
        for name, link in list(self.elsewhere.items()):
            if link is peer:
                del self.elsewhere[name]
                self.unreachable[name] = (peer.name, now)

    # -- capturing ---------------------------------------------------------------------

    def _captured(self, data: bytes) -> None:
        """Frames routed to the sink during one read: queued for this turn's commit, with
        the reliable ones' ids to acknowledge once it is done. Once per frame: kept tight."""
        batch = self._batch
        if not batch:
            asyncio.get_running_loop().call_soon(self._commit)
        by_member, by_group = self._by_member, self._by_group
        pos, end = 0, len(data)
        while pos < end:
            (length, _, _, flags, _, dst, src, _, msg_id, _, _) = _unpack_header(data, pos)
            frame_end = pos + 4 + length
            payload = data[pos + _HEADER_SIZE : frame_end]
            pos = frame_end
            if flags & FLAG_ACK:
                # An ack is no message: the broker lets any user ack a unicast address,
                # so storing one would let it write where it may not send.
                self.dropped += 1
                continue
            if flags & FLAG_EXT:
                try:
                    ext, payload = split(payload)
                    if ext.batch:
                        rows = self._rows(ext, payload, src, dst)
                    if ext.headers:
                        # Stored ones are read back without a check (a Spark read).
                        decode_headers(ext.headers)
                except ProtocolError as exc:
                    self.dropped += 1
                    log.warning(
                        "dropped a frame with a bad extension block",
                        extra={"src": describe_address(src), "error": str(exc)},
                    )
                    continue
                if ext.batch:
                    self._queue(dst, src, msg_id, flags, rows)
                    continue
                publish = ext.publish_id
                if not publish and flags & FLAG_RELIABLE:
                    publish = src + msg_id.to_bytes(8, "big")
                fields = (
                    src, ext.origin or dst, payload, ext.group, ext.priority, publish, ext.headers
                )  # fmt: skip
            elif flags & FLAG_RELIABLE:
                # A reliable frame is its own publish id: a resend after a failover is
                # stored once.
                fields = (src, dst, payload, b"", 0, src + msg_id.to_bytes(8, "big"), b"")
            else:
                fields = (src, dst, payload, b"", 0, b"", b"")
            message = _new_message(NewMessage, fields)
            for name in (by_member[dst],) if dst in by_member else by_group.get(dst, ()):
                entry = batch.get(name)
                if entry is None:
                    entry = batch[name] = ([], {})
                entry[0].append(message)
                if flags & FLAG_RELIABLE:
                    entry[1].setdefault(src, []).append(msg_id)

    @staticmethod
    def _rows(ext: Ext, payload: bytes, src: bytes, dst: bytes) -> list[NewMessage]:
        """A batch frame's rows as messages of their own, each with its publish id (so a
        resent batch is stored once per row); ProtocolError if it is not a batch of
        rows in a format this broker reads."""
        origin = ext.origin or dst
        new = _new_message
        return [
            new(NewMessage, (src, origin, row.payload, b"", row.priority, row.publish_id, b""))
            for row in received_rows(ext, payload)
        ]

    def _queue(
        self, dst: bytes, src: bytes, msg_id: int, flags: int, messages: list[NewMessage]
    ) -> None:
        """A batch frame's rows, for this turn's commit; the frame is acknowledged once
        all of them are stored."""
        batch, by_member = self._batch, self._by_member
        for name in (by_member[dst],) if dst in by_member else self._by_group.get(dst, ()):
            entry = batch.get(name)
            if entry is None:
                entry = batch[name] = ([], {})
            entry[0].extend(messages)
            if flags & FLAG_RELIABLE:
                entry[1].setdefault(src, []).append(msg_id)

    def _commit(self) -> None:
        batch, self._batch = self._batch, {}
        now = time.time()
        store = self.store
        limit = self._config.max_store_bytes
        for name, (messages, acks) in batch.items():
            try:
                size = sum(map(len, map(_payload_of, messages)))
                if store.total_bytes() + store.growth(name, size) > limit:
                    raise StoreFull(
                        f"the streams of this broker hold {store.total_bytes()} payload bytes; "
                        f"{size} more would pass its limit of {limit} bytes per data dir "
                        "(meshbus broker --max-store-bytes): delete or trim a stream"
                    )
                replicated = self.replicated
                if replicated is not None and name in replicated:
                    member = self.members.get(name)
                    if member is not None:  # else: no longer the leader
                        replicated.append(name, member, messages, acks)
                    continue
                store.append_batch(name, messages, now)
            except StoreError as exc:
                # Not acknowledged, so reliable senders try again; plain sends are lost.
                self._store_failures.failed(str(exc), stream=name)
                self.dropped += len(messages)
                continue
            if self._store_failures.failing:
                self._store_failures.succeeded()
            self.stored += len(messages)
            member = self.members.get(name)
            if member is not None and acks:
                self._send_acks(member, acks)
        self._outbox.flush()

    def _acknowledge(self, member: bytes, acks: dict[bytes, list[int]]) -> None:
        """A replicated stream's commit: its reliable frames are acknowledged now."""
        self._send_acks(member, acks)
        self._outbox.flush()

    def _replica_deleted(self, name: str) -> None:
        if name in self.store:
            self.store.delete_stream(name)
            self._usage.stream_deleted(name)
            self._purge_later()

    def _send_acks(self, member: bytes, acks: dict[bytes, list[int]]) -> None:
        """One ACK frame per sender for what this commit stored (meshbus.protocol.ext)."""
        routing = self._routing
        for src, ids in acks.items():
            owner = routing.route_unicast(src)
            if owner is not None:
                for frame in ack_frames(member, src, ids):
                    self._outbox.deliver(owner, frame)

    # -- requests ----------------------------------------------------------------------

    def on_request(self, link: Link, correlation: int, body: StreamRequest) -> None:
        if not link.is_peer:  # the user that asks, as this broker knows it
            permissions = link.permissions
            body = msgspec.structs.replace(
                body,
                user=link.user or "",
                any_consumer=permissions is None or permissions.may_operate(CONSUMERS),
            )
        answer = self._relay.answer
        name = body.stream
        replicated = self.replicated
        if replicated is not None and name in replicated and body.op not in ("add", "list"):
            refusal = self._replica_refusal(body)
            leader = replicated.leader(name)
            if refusal is None:
                pass  # this replica answers: its committed prefix
            elif (peer := self._peers.get(leader or "")) is not None and not link.is_peer:
                self._relay.relay(peer, ControlType.STREAM, body, link, correlation)
                return
            else:
                self._refuse(link, ErrorCode.UNAVAILABLE, refusal, correlation)
                return
        elif body.op not in ("add", "list") and name not in self.members:
            peer = self.elsewhere.get(name)
            if peer is not None and not link.is_peer:
                self._relay.relay(peer, ControlType.STREAM, body, link, correlation)
                return
            if name in self.unreachable:
                self._refuse(link, ErrorCode.UNAVAILABLE, self._unreachable(name), correlation)
                return
            self._refuse(link, ErrorCode.NO_STREAM, str(StreamNotFound(name)), correlation)
            return
        not_theirs = self._not_theirs(body)
        if not_theirs:
            self._refuse(link, ErrorCode.PERMISSION_DENIED, not_theirs, correlation)
            return
        if body.op == "add" and body.replicas > 1:
            self._add_replicated(link, correlation, body)
            return
        if replicated is not None and name in replicated:
            if body.op == "delete":
                self._delete_replicated(link, correlation, replicated.delete(name))
                return
            if body.op in _CONSUMER_CHANGES:
                self._consume_replicated(link, correlation, body, replicated)
                return
        try:
            reply = self._handle(link, body)
        except (StoreError, ValueError, TypeError, OverflowError) as exc:
            self._refuse_for(link, exc, correlation)
            return
        if body.op != "add":
            answer(link, ControlType.STREAM_REPLY, reply, correlation)
            return

        def captured_mesh_wide() -> None:
            # Like a JOIN's SYNCED: a send through any broker after this reaches the stream.
            if link.state is LinkState.OPEN:
                answer(link, ControlType.STREAM_REPLY, reply, correlation)

        self._sync.after_confirmed(captured_mesh_wide)

    def _delete_replicated(
        self, link: Link, correlation: int, committed: asyncio.Future[int]
    ) -> None:
        """Answer a replicated stream's delete once it is committed (every replica then
        deletes it), or with why it was not."""

        def done(future: asyncio.Future[int]) -> None:
            if link.state is not LinkState.OPEN:
                future.exception()  # read: nobody waits for it now
                return
            error = future.exception()
            if error is None:
                self._relay.answer(link, ControlType.STREAM_REPLY, StreamReply(), correlation)
            else:
                message = f"the delete was not committed: {error}; ask again"
                self._refuse(link, ErrorCode.UNAVAILABLE, message, correlation)
            self._outbox.flush()

        committed.add_done_callback(done)

    def _refuse_for(self, link: Link, error: BaseException, correlation: int) -> None:
        """The ERROR for a request the store or its checks refused."""
        if isinstance(error, (StreamNotFound, ConsumerNotFound)):
            code = ErrorCode.NO_STREAM
        elif isinstance(error, StreamTaken):
            code = ErrorCode.STREAM_EXISTS
        elif isinstance(error, ReplicationError):
            code = ErrorCode.UNAVAILABLE
        else:
            code = ErrorCode.STREAM_ERROR
        self._refuse(link, code, str(error), correlation)

    def _consume_replicated(
        self, link: Link, correlation: int, body: StreamRequest, replicated: ReplicatedStreams
    ) -> None:
        """A change of a replicated stream's consumer, on its leader: answered as the
        R=1 store's once its entry is committed and applied here (every replica applies
        it; meshbus.broker.replication.consumers)."""
        op, name = body.op, body.stream
        try:
            if op == "consumer_add":
                command = ConsumerCommand.add(_consumer_config(body))
            elif op == "consumer_delete":
                command = ConsumerCommand.delete(body.consumer)
            elif op == "next":
                command = ConsumerCommand.next(body.consumer, body.max_count)
            else:
                command = ConsumerCommand.ack(body.consumer, list(body.seqs))
        except ValueError as exc:
            self._refuse_for(link, exc, correlation)
            return

        def applied(future: asyncio.Future[Outcome]) -> None:
            error = future.exception()  # read, even when nobody waits for it now
            if link.state is not LinkState.OPEN:
                return
            if error is not None:
                self._refuse_for(link, error, correlation)
            else:
                reply = _consumer_reply(op, future.result(), link.max_frame)
                self._relay.answer(link, ControlType.STREAM_REPLY, reply, correlation)
            self._outbox.flush()

        replicated.consume(name, command).add_done_callback(applied)

    def _replica_refusal(self, body: StreamRequest) -> str | None:
        """Why this replica of a replicated stream does not answer ``body`` itself (None:
        it does -- a read of its committed prefix); the leader may (a delete, a change of a
        consumer, a current read)."""
        replicated = self.replicated
        assert replicated is not None
        name = body.stream
        op = body.op
        leader_only = op in _LEADER_ONLY or (body.current and op in _READS)
        if not leader_only or replicated.leads(name):
            return None
        leader = replicated.leader(name)
        if leader is None:
            return (
                f"stream {name!r} has no leader now (an election is under way, or fewer "
                "than a majority of its replicas are up); ask again in a moment"
            )
        return f"stream {name!r} is led by broker {leader}; ask it"

    def _not_theirs(self, body: StreamRequest) -> str:
        """Why ``body`` may not use the consumer it names: another user made it ("" when
        it may)."""
        if body.any_consumer or stream_operation(body.op) != "consume":
            return ""
        owner = self.store.consumer_owner(body.stream, body.consumer)
        if not owner or owner == body.user:  # none yet (the op says so), nobody's, or its own
            return ""
        return (
            f"permission denied: user {body.user!r} may not {body.op} consumer "
            f"{body.consumer!r} of stream {body.stream!r}: user {owner!r} made it, and only "
            f"it or a user with the operator right {CONSUMERS!r} may use or delete it "
            "(permissions.operator)"
        )

    def _unreachable(self, name: str) -> str:
        host, since = self.unreachable[name]
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        return (
            f"stream {name!r} is hosted by broker {host}, unreachable from this broker since "
            f"{at} ({time.time() - since:.0f} s ago); it is back when its broker is -- "
            f"adding a stream of the same name elsewhere would make a second one"
        )

    def _refuse(self, link: Link, code: ErrorCode, message: str, correlation: int) -> None:
        self._relay.refuse(link, code, message, correlation)

    def _handle(self, link: Link, body: StreamRequest) -> StreamReply:
        store = self.store
        name = body.stream
        op = body.op
        if op == "add":
            if name in self.elsewhere:
                raise ValueError(f"stream {name!r} is hosted by broker {self.elsewhere[name].name}")
            cap = self._config.max_stream_bytes
            if body.max_bytes > cap:
                raise StoreFull(
                    f"stream {name!r}: max_bytes {body.max_bytes} is more than this broker "
                    f"allows a stream, {cap} bytes (meshbus broker --max-stream-bytes)"
                )
            hosted = len(store.streams())
            if name not in store and hosted >= self._config.max_streams:
                raise StoreFull(
                    f"this broker hosts {hosted} streams, its limit (meshbus broker "
                    "--max-streams); delete one first or add the stream on another broker"
                )
            config = _stream_config(body, body.max_bytes or cap)  # every stream has a cap
            new = name not in store
            if new:
                self._usage.check(config.owner, STREAM_BYTES, config.max_bytes)
            info = store.add_stream(config)
            if new:
                self._usage.stream_added(config.owner, name, config.max_bytes)
            self._host(config)
            return StreamReply(info=self._info(info))
        if op == "list":
            here = [{"name": n, "broker": self._config.name} for n in self.members]
            replicated = self.replicated
            if replicated is not None:
                # The meta group's record, where this broker holds a copy of it
                held = [*replicated.configs, *replicated.meta.state.streams]
                here += [
                    {"name": n, "broker": replicated.leader(n) or ""}
                    for n in dict.fromkeys(held)
                    if n not in self.members and n not in self.elsewhere
                ]
            # A name both here and announced by a peer is a replicated stream whose
            # leadership moves: listed once, as this broker sees it.
            listed_here = {s["name"] for s in here}
            there = [
                {"name": n, "broker": peer.name}
                for n, peer in self.elsewhere.items()
                if n not in listed_here
            ]
            listed = sorted(here + there, key=lambda s: s["name"])
            permissions = link.permissions
            if permissions is not None:  # only what its user may read (docs/security.md)
                listed = [s for s in listed if permissions.may_stream(op, s["name"])]
            return StreamReply(streams=listed)
        if op == "info":
            return StreamReply(info=self._info(store.info(name)))
        if op == "delete":
            self._unhost(name)
            store.delete_stream(name)
            self._usage.stream_deleted(name)
            self._purge_later()
            return StreamReply()
        if op == "fetch" and body.columns:
            # At most half the frame for the other fields (their worst case per message,
            # in a block encoded for this answer), the rest for payloads.
            room = link.max_frame - 4096
            count = max(1, min(body.max_count, room // (2 * _COLUMN_OVERHEAD)))
            limit = max(1, room - count * _COLUMN_OVERHEAD)
            return StreamReply(blocks=store.read_blocks(name, body.from_seq, count, limit))
        if op == "fetch":
            limit = max(1, link.max_frame - 4096)
            rows = store.read(name, body.from_seq, body.max_count, limit)
            return StreamReply(messages=_fit([_row(m, 1) for m in rows], limit))
        if op == "consumer_info":
            return StreamReply(info=_consumer(store.consumer_info(name, body.consumer)))
        outcome: Outcome
        if op == "consumer_add":
            outcome = store.add_consumer(name, _consumer_config(body))
        elif op == "consumer_delete":
            outcome = store.delete_consumer(name, body.consumer)
        elif op == "next":
            outcome = store.consumer_next(name, body.consumer, body.max_count, time.time())
        elif op == "ack":
            outcome = store.consumer_ack(name, body.consumer, body.seqs)
        else:
            raise ValueError(f"unknown stream request {op!r}")
        return _consumer_reply(op, outcome, link.max_frame)

    def _add_replicated(self, link: Link, correlation: int, body: StreamRequest) -> None:
        """A replicated stream's add: decided by the meta group's leader -- here if this
        broker leads it, else relayed there (a connector's request), once the group has
        one (founded here if the mesh has none yet: meshbus.broker.replication.metagroup)."""
        try:
            config = self._replicated_config(body)
        except (StoreError, ValueError, StreamTaken) as exc:
            self._refuse_for(link, exc, correlation)
            return
        task = asyncio.create_task(self._add_through_meta(link, correlation, body, config))
        self._adding.add(task)
        task.add_done_callback(self._adding.discard)

    async def _add_through_meta(
        self, link: Link, correlation: int, body: StreamRequest, config: StreamConfig
    ) -> None:
        replicated = self.replicated
        assert replicated is not None
        meta = replicated.meta
        me = self._config.name
        longest_election = 2 * RAFT_SETTINGS.election_ticks * self._config.raft_tick
        if not link.is_peer:
            meta.found_if_none(sorted(self._ready_brokers()))
            # A new meta group elects its leader first (one election timeout or two).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3 * longest_election):
                    while not meta.leads() and self._peers.get(meta.leader_name()) is None:
                        meta.leader_moved.clear()
                        await meta.leader_moved.wait()
        leader = meta.leader_name()
        if not meta.leads():
            peer = self._peers.get(leader) if leader != me else None
            if peer is not None and not link.is_peer and link.state is LinkState.OPEN:
                self._relay.relay(peer, ControlType.STREAM, body, link, correlation)
                self._outbox.flush()
                return
            why = f"broker {leader} leads it now" if leader else "it has no leader now"
            self._refuse(
                link,
                ErrorCode.UNAVAILABLE,
                f"stream {body.stream!r}: the mesh's meta group, which adds replicated "
                f"streams, cannot decide here ({why}: an election is under way, or fewer than "
                "a majority of its voters are up); ask again in a moment",
                correlation,
            )
            self._outbox.flush()
            return
        try:
            reply = await self._decide_add(config, body.replicas)
        except (StoreError, ValueError, StreamTaken) as exc:
            error: BaseException = exc
        except (RaftError, ReplicationError):
            error = ReplicationError(
                f"stream {body.stream!r}: the meta group did not commit the add here (its "
                "leadership moved, or it took no proposal for an election timeout); it may "
                f"still be: ask `meshbus stream info {body.stream}` in a moment, and add it "
                "again if there is no such stream"
            )
        else:
            if link.state is LinkState.OPEN:
                self._relay.answer(link, ControlType.STREAM_REPLY, reply, correlation)
                self._outbox.flush()
            return
        if link.state is LinkState.OPEN:
            self._refuse_for(link, error, correlation)
            self._outbox.flush()

    async def _decide_add(self, config: StreamConfig, count: int) -> StreamReply:
        """On the meta leader: the name is free, the replicas are placed (spread over the
        ready brokers' zones), and the record is committed; its members found the group
        from it (MetaGroup.apply)."""
        replicated = self.replicated
        assert replicated is not None
        meta = replicated.meta
        name = config.name
        ready = self._ready_brokers()
        encoded = _encode_config(config)
        record = meta.state.streams.get(name)
        if record is not None:
            if not record.same_stream(encoded, count):
                raise StreamTaken(name)
            return self._added(config, record.brokers, ready)  # asked again
        if len(ready) < count:
            raise ValueError(
                f"stream {name!r}: --replicas {count} needs {count} ready brokers in the mesh, "
                f"and it has {len(ready)} ({', '.join(sorted(ready))})"
            )
        replicas = spread(name, ready, count)
        command = MetaCommand(ADD, name, encoded, meta.placed(replicas))
        for _ in range(2 * RAFT_SETTINGS.election_ticks):
            try:
                outcome = await meta.propose(command)
            except ProposalRefused:
                # A new leader takes proposals once it committed an entry of its term
                # (a round trip), and none while its membership changes: a tick later.
                await asyncio.sleep(self._config.raft_tick)
                continue
            if outcome == EXISTS:
                raise StreamTaken(name)
            if outcome == ALREADY:  # the same stream, added by an entry before this one
                replicas = meta.state.streams[name].brokers
            break
        else:
            raise ReplicationError(f"stream {name!r}: the meta group takes no proposal now")
        return self._added(config, replicas, ready)

    def _added(
        self, config: StreamConfig, replicas: list[str], ready: dict[str, str]
    ) -> StreamReply:
        """The answer to a replicated add: the stream as placed on ``replicas``."""
        info = self._info(StreamStatus(config, 1, 0, 0, 0, ()))
        info.update(replicas=replicas, leader="")
        info["zones"] = [ready.get(b, "") for b in replicas]
        if self._config.name not in replicas:
            info["store"] = ""  # this broker placed it and holds no copy
        return StreamReply(info=info)

    def _replicated_config(self, body: StreamRequest) -> StreamConfig:
        """The checks the broker asked makes of a replicated add (the meta leader makes
        the mesh-wide ones)."""
        name, count = body.stream, body.replicas
        if self.replicated is None:
            raise ValueError(
                f"stream {name!r}: --replicas {count} needs a broker with --data-dir (the "
                "Raft log and the replicas' stores are files); this one keeps streams in memory"
            )
        if count not in (3, 5):
            raise ValueError(f"stream {name!r}: --replicas is 1, 3 or 5, not {count}")
        cap = self._config.max_stream_bytes
        config = _stream_config(body, min(body.max_bytes or cap, cap))
        if self._taken_by_another(config, count):
            raise StreamTaken(name)
        hosted = len(self.store.streams())
        if hosted >= self._config.max_streams:
            raise StoreFull(
                f"this broker hosts {hosted} streams, its limit (meshbus broker "
                "--max-streams); delete one first or add the stream on another broker"
            )
        self._usage.check(config.owner, STREAM_BYTES, config.max_bytes)
        return config

    def _taken_by_another(self, config: StreamConfig, count: int) -> bool:
        """Whether this broker knows that ``config.name`` is another stream than the one
        asked for. The same replicated stream asked again (an add whose answer was lost)
        is not: the meta leader answers it with the stream, as the store of an R=1
        stream answers an identical add. A name a peer announces that this broker holds
        no record of is left to the meta leader, whose record tells a replicated stream
        from one of one replica."""
        replicated = self.replicated
        assert replicated is not None
        name = config.name
        record = replicated.meta.state.streams.get(name)
        if record is not None:
            return not record.same_stream(_encode_config(config), count)
        if name in replicated:
            return replicated.configs[name] != config
        if name in self.members:
            return True
        return name in self.elsewhere and replicated.meta.holds()

    def _info(self, info: StreamStatus) -> dict[str, Any]:
        config = info.config
        return {
            "name": config.name,
            "broker": self._config.name,
            "captures": [describe_address(c) for c in config.captures],
            "first_seq": info.first_seq,
            "last_seq": info.last_seq,
            "messages": info.messages,
            "bytes": info.bytes,
            "consumers": list(info.consumers),
            "max_msgs": config.max_msgs,
            "max_bytes": config.max_bytes,
            "max_age": config.max_age,
            "dedupe_window": config.dedupe_window,
            "owner": config.owner,
            "store": os.path.abspath(self.store.path)
            if isinstance(self.store, SqliteStreamStore)
            else "",
            "host": socket.gethostname(),
            **(self.replicated.describe(config.name) if self.replicated is not None else {}),
        }

    def expire(self) -> None:
        """Retention by age; a replicated stream's goes through its log (its leader
        proposes it: ReplicatedStreams.expire)."""
        now = time.time()
        replicated = self.replicated
        try:
            if replicated is None:
                self.store.expire(now)
                return
            self.store.expire(
                now, [c.name for c in self.store.streams() if c.name not in replicated]
            )
            replicated.expire(now)
        except StoreError as exc:
            log.error("stream retention failed", extra={"error": str(exc)})

    async def hand_over_leaderships(self, grace: float) -> None:
        """Before a drain: each replicated stream this broker leads gets another leader
        (RaftDriver.hand_over) while this broker still answers, so appends go on
        without waiting an election timeout for its loss. Waited for up to the
        transfer's own bound (the longest election timeout) or ``grace``."""
        if self.replicated is None:
            return
        replicated = self.replicated
        driver = replicated.driver
        replicated.leader_moved.clear()
        asked = driver.hand_over()
        longest_election = 2 * RAFT_SETTINGS.election_ticks * self._config.raft_tick
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(grace, longest_election)):
                while any(driver.is_leader(g) for g in asked):
                    await replicated.leader_moved.wait()
                    replicated.leader_moved.clear()
        if kept := [g for g in asked if driver.is_leader(g)]:
            log.warning(
                "draining: streams %s still led here; they elect a leader once it stops",
                ", ".join(kept),
            )
        elif asked:
            log.info("draining: the leadership of streams %s handed over", ", ".join(asked))

    def close(self) -> None:
        if self._upkeep is not None:
            self._upkeep.close()
        for task in self._adding:
            task.cancel()
        if self.replicated is not None:
            self.replicated.meta.close()
            self.replicated.driver.close()
        self.store.close()
        if self._lock is not None:
            self._lock.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "hosted": sorted(self.members),
            "elsewhere": {n: link.name for n, link in sorted(self.elsewhere.items())},
            "stored": self.stored,
            "dropped": self.dropped,
            "replicated": {
                n: self.replicated.leader(n) or "" for n in sorted(self.replicated.configs)
            }
            if self.replicated is not None
            else {},
            # Why this broker acknowledges no append to a replicated stream ("" if it does).
            "raft_log_failed": self.replicated.driver.failed if self.replicated else "",
            "raft": self.replicated.observe()
            if self.replicated is not None
            else {
                "syncs": 0,
                "sync_seconds": 0.0,
                "compactions": 0,
                "snapshots_installed": 0,
                "copied_blocks": 0,
                "served_blocks": 0,
                "streams": {},
            },
            "paused": {
                n: [describe_address(group) for group in groups]
                for n, groups in sorted(self.paused.items())
            },
        }


def _row(message: StoredMessage, delivery: int) -> StoredRow:
    return (
        message.seq,
        message.stored_at,
        message.src,
        message.dst,
        message.group,
        message.priority,
        message.payload,
        delivery,
        message.headers,
    )


def _fit(rows: list[StoredRow], limit: int) -> list[StoredRow]:
    """As many rows as fit in one answer frame (at least one)."""
    size = 0
    for i, row in enumerate(rows):
        size += len(row[6]) + _ROW_OVERHEAD
        if size > limit and i:
            return rows[:i]
    return rows


def _consumer_config(body: StreamRequest) -> ConsumerConfig:
    """The consumer a ``consumer_add`` asks for; ValueError if it is not one."""
    return ConsumerConfig(
        name=body.consumer,
        ack_wait=body.ack_wait,
        max_deliver=body.max_deliver,
        start_seq=body.start_seq,
        owner=body.user,
    )


def _consumer_reply(op: str, outcome: Outcome, max_frame: int) -> StreamReply:
    """The answer to a change of a consumer (``op``), from what the store gave."""
    if isinstance(outcome, ConsumerInfo):  # consumer_add
        return StreamReply(info=_consumer(outcome))
    if isinstance(outcome, list):  # next
        rows = [_row(d.message, d.delivery) for d in outcome]
        return StreamReply(messages=_fit(rows, max(1, max_frame - 4096)))
    if isinstance(outcome, int):  # ack
        return StreamReply(acked=outcome)
    return StreamReply()  # consumer_delete


def _consumer(info: Any) -> dict[str, Any]:
    return {
        "stream": info.stream,
        "name": info.config.name,
        "ack_wait": info.config.ack_wait,
        "max_deliver": info.config.max_deliver,
        "start_seq": info.config.start_seq,
        "owner": info.config.owner,
        "next_seq": info.next_seq,
        "ack_floor": info.ack_floor,
        "pending": info.pending,
        "dropped": info.dropped,
    }


def _encode_config(config: StreamConfig) -> bytes:
    return msgspec.msgpack.encode(ConfigBody.of(config))


def _stream_config(body: StreamRequest, max_bytes: int) -> StreamConfig:
    """The configuration an ``add`` asks for, with its byte cap; ValueError for a capture
    that is not a multicast address."""
    for group in body.captures:
        if group[0] != CAST_MULTICAST:
            raise ValueError(
                f"a stream captures multicast addresses, not {describe_address(group)}"
            )
    return StreamConfig(
        name=body.stream,
        captures=tuple(body.captures),
        max_msgs=body.max_msgs,
        max_bytes=max_bytes,
        max_age=body.max_age,
        dedupe_window=body.dedupe_window,
        owner=body.user,
    )
