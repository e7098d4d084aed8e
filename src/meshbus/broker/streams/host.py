"""Durable streams on a broker: capture, group commit, acks.

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

The brokers tell each other the streams they host in their LOAD heartbeats
(``elsewhere``; ``unreachable`` once that peer's link is lost), for the STREAM
requests (meshbus.broker.streams.requests). With a --data-dir, the replicated streams
(meshbus.broker.replication) are built here, and capture here where they lead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from operator import itemgetter
from typing import IO, Any

from meshbus.address import describe_address
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.endpoint import Endpoint, LinkRole
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import Peers
from meshbus.broker.core.reserved import STREAM_SERVER
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.replication.compaction import CompactionPolicy
from meshbus.broker.replication.driver import RaftDriver
from meshbus.broker.replication.placement import replacement_order
from meshbus.broker.replication.streams import ReplicatedStreams
from meshbus.broker.replication.transport import PeerTransport
from meshbus.broker.streams.upkeep import StoreUpkeep
from meshbus.errors import ProtocolError
from meshbus.protocol.batch import received_rows
from meshbus.protocol.control import (
    OP_ADD,
    OP_JOIN,
    OP_LEAVE,
    OP_REMOVE,
    Load,
    RaftFrame,
    owner_of,
)
from meshbus.protocol.ext import Ext, ack_frames, split
from meshbus.protocol.headers import decode_headers
from meshbus.protocol.layout import (
    DATA_HEADER,
    FLAG_ACK,
    FLAG_EXT,
    FLAG_RELIABLE,
)
from meshbus.raft import RaftSettings, Randomness
from meshbus.storage.data_dir import lock_data_dir
from meshbus.storage.errors import StoreError, StoreFull
from meshbus.storage.raftlog import RaftWal
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import (
    MemoryStreamStore,
    MirroredStore,
    NewMessage,
    StreamConfig,
)
from meshbus.util import FailureLog

log = logging.getLogger("meshbus.broker")


_unpack_header = DATA_HEADER.unpack_from
_HEADER_SIZE = DATA_HEADER.size
# NewMessage is a NamedTuple: tuple.__new__ builds one without its Python-level __new__.
_new_message = tuple.__new__
_payload_of = itemgetter(2)  # NewMessage.payload
# Replicated streams (meshbus.broker.replication): a tick every --raft-tick seconds; an
# election after 10-20 silent ticks, a heartbeat every tick; 4 entries per APPEND of at
# most an eighth of a frame each, so an APPEND fits in a peer frame.
RAFT_SETTINGS = RaftSettings(election_ticks=10, heartbeat_ticks=1, max_append_entries=4)


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
    """The streams this broker hosts and captures, the streams its peers host, and the
    replicated streams it holds."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        routing: RoutingTable[Endpoint],
        sync: RouteSync,
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
        self._outbox = outbox
        self._usage = usage
        self._hosted_changed = hosted_changed
        self._may_capture = may_capture
        data_dir = config.data_dir
        self.store: MirroredStore
        self._lock: IO[bytes] | None = None
        self._ready_brokers = ready_brokers
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
            release=self.unhost,
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
                self.host(config)
        if self._upkeep is not None:
            self._upkeep.start()

    def purge_later(self) -> None:
        if self._upkeep is not None:
            self._upkeep.purge_later()

    def host(self, config: StreamConfig) -> None:
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
            self.unhost(config.name)
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
        self.host(config)

    def unhost(self, name: str) -> None:
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
            self.purge_later()

    def _send_acks(self, member: bytes, acks: dict[bytes, list[int]]) -> None:
        """One ACK frame per sender for what this commit stored (meshbus.protocol.ext)."""
        routing = self._routing
        for src, ids in acks.items():
            owner = routing.route_unicast(src)
            if owner is not None:
                for frame in ack_frames(member, src, ids):
                    self._outbox.deliver(owner, frame)

    # -- requests ----------------------------------------------------------------------

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
