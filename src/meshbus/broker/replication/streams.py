"""Replicated streams: a stream held by 3 or 5 brokers, one Raft group each.

Placement: the mesh's meta group (meshbus.broker.replication.metagroup) decides it. Its
leader checks the name is free, picks the replicas (placement.spread: rendezvous hashing
of the stream's name over the ready brokers, spread over their zones), commits the
record, and sends each replica a RAFT frame that founds the group with that list as its
first membership -- the same on every founding member, so no election is needed to
agree on it. After that the group's leader changes it, one member at a time: it
replaces a replica whose broker came back as another incarnation (a wiped data dir) or
that it has not heard from for --replace-after, by the next broker in the stream's
placement order, one of a zone no other replica is in first (placement.replacement_order;
meshbus.broker.replication.members), and reports the members to the meta group, whose
record follows.

The leader alone captures: it holds the stream's member address -- a fixed one per
stream (``member_address``), taken over by each new leader with the Raft term as its
epoch, so a reliable sender's resends reach whichever broker leads now and its acks
come from the address it expects. A turn's captures become one entry (or a few, each at
most ``entry_limit`` bytes); the reliable frames among them are acknowledged once the
entry is committed -- fsynced on a majority of the voters, the leader's own disk
counted only once its fsync is done -- and applied here. Sequence numbers and
publish-id dedupe are the store's, applied in log order on every replica: a resend
across a leader change is stored once.

Every replica applies the committed entries to its own store (``raft_entry`` records
the entry's index with what it changed, so a restart applies each once), at the clock of
the leader that made the entry, and serves its committed prefix to a fetch made on it;
any other broker relays a request to the leader. Besides appends the log holds the
stream's delete, its durable consumers' changes (``consume``:
meshbus.broker.replication.consumers) and its retention by age (``expire``), so that
every replica holds the same state at each index.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from meshbus.address import CAST_UNICAST, DYNAMIC_INSTANCE_MIN
from meshbus.broker.core.link import Link
from meshbus.broker.core.reserved import REPLICATED_STREAM_SERVER
from meshbus.broker.replication.consumers import (
    CommandBatch,
    ConsumerCommand,
    ConsumerCommands,
    Outcome,
    apply_commands,
)
from meshbus.broker.replication.copies import StoreCopies, encode_mark
from meshbus.broker.replication.driver import RaftDriver
from meshbus.broker.replication.group import GroupMeta
from meshbus.broker.replication.members import Member
from meshbus.broker.replication.meta import (
    DELETED,
    MEMBERS,
    META_GROUP,
    MetaCommand,
    Placed,
    decode_config,
)
from meshbus.broker.replication.metagroup import MetaGroup
from meshbus.broker.replication.transport import PeerTransport
from meshbus.broker.replication.wire import from_body
from meshbus.errors import ProtocolError
from meshbus.protocol.control import RaftFrame, RaftJoinBody
from meshbus.raft import Entry
from meshbus.storage.errors import StoreError
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import NewMessage, StreamConfig

log = logging.getLogger("meshbus.broker")

_APPEND = 0
_DELETE = 1
_CONSUMERS = 2
_EXPIRE = 3


def member_address(stream: str) -> bytes:
    """The stream's member address, the same on every broker: a dynamic-range instance
    of server ``rstream`` drawn from the name (no broker allocates from that server)."""
    digest = int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=4).digest(), "big")
    instance = DYNAMIC_INSTANCE_MIN + digest % (2**32 - DYNAMIC_INSTANCE_MIN)
    return bytes([CAST_UNICAST]) + REPLICATED_STREAM_SERVER + instance.to_bytes(4, "big")


def member_session(stream: str) -> bytes:
    """The session its member address is registered with: every leader's is the same,
    so a new leader's ADD (with a higher epoch, its term) takes the address over."""
    return b"rstream:" + hashlib.blake2b(stream.encode(), digest_size=16).digest()


# An entry's data: (kind, the leader's clock when it made it, what it holds): for
# _APPEND the messages captured, for _CONSUMERS a CommandBatch, for _DELETE and _EXPIRE
# (retention by age, at that clock) nothing.
_Rows = list[tuple[bytes, bytes, bytes, bytes, int, bytes, bytes]]
_encode = msgspec.msgpack.Encoder().encode
_decode_entry = msgspec.msgpack.Decoder(tuple[int, float, msgspec.Raw]).decode
_decode_rows = msgspec.msgpack.Decoder(_Rows).decode
_decode_batch = msgspec.msgpack.Decoder(CommandBatch).decode


class ReplicatedStreams:
    """The replicated streams this broker holds: the state machine of their groups."""

    def __init__(
        self,
        *,
        name: Callable[[], str],
        store: SqliteStreamStore,
        transport: PeerTransport,
        driver: Callable[[ReplicatedStreams], RaftDriver],
        capture: Callable[[StreamConfig, bytes, bytes, int], None],
        release: Callable[[str], None],
        deleted: Callable[[str], None],
        acknowledge: Callable[[bytes, dict[bytes, list[int]]], None],
        entry_limit: int,
        linked: Callable[[str], bool],
        copy_retry: int,
        meta_voters: Sequence[str] = (),
        meta_changed: Callable[[], None] = lambda: None,
    ) -> None:
        """``capture(config, member, session, epoch)`` makes this broker capture the
        stream (it leads it); ``release(name)`` stops that; ``deleted(name)`` deletes it
        from the store (its deletion is committed); ``acknowledge(member, acks)``
        sends the ACKs of what a commit stored. ``driver(self)`` builds the driver with
        this as its state machine. ``linked(broker)``: a peer link to it is open now.
        ``meta_voters`` (--meta-voter) and ``meta_changed`` (tell the peers what this
        broker knows of the meta group) are the meta group's (``MetaGroup``).
        ``copy_retry``: ticks after which a copy's unanswered request is sent again
        (copies.py); its chunks are at most ``entry_limit`` * 2 bytes of blocks."""
        self._name = name
        self._store = store
        self._transport = transport
        self._capture = capture
        self._release = release
        self._deleted = deleted
        self._acknowledge = acknowledge
        self._entry_limit = entry_limit
        self._linked = linked
        self.driver = driver(self)
        self.copies = StoreCopies(
            store=store,
            fetch=transport.fetch,
            chunk=transport.chunk,
            installed=self.driver.installed,
            chunk_bytes=2 * entry_limit,
            retry_ticks=copy_retry,
        )
        self._consumers = ConsumerCommands(self._propose_commands, entry_limit)
        self.configs: dict[str, StreamConfig] = {}
        self._records: dict[str, int] = {}  # stream -> the meta entry that added it (meta.py)
        self.capturing: dict[str, int] = {}  # stream -> the epoch it captures with here
        self.refused = 0  # captured messages never proposed (too large, no leader)
        self._warned: dict[str, int] = {}  # stream -> the term of its last _not_stored
        self.leader_moved = asyncio.Event()  # set whenever a group's leader changes
        self._expiring: set[str] = set()  # streams whose expiry entry is not applied yet
        self._reported: dict[str, int] = {}  # stream -> the term its members were reported in
        self.meta = MetaGroup(
            name=name,
            driver=self.driver,
            transport=transport,
            configured=meta_voters,
            found=self.found,
            changed=meta_changed,
        )

    def __contains__(self, name: object) -> bool:
        return name in self.configs

    def restore(self) -> None:
        """The groups of the log, back with their streams (at start)."""
        for group, meta in self.driver.recover():
            if group != META_GROUP:
                self._hold(group, meta)
        self.meta.recovered()
        self.meta.start()

    def _hold(self, group: str, meta: GroupMeta) -> None:
        founded = decode_config(meta.app)
        config = founded.config()
        if config.name not in self._store:
            self._store.add_stream(config)
        self.configs[group] = config
        self._records[group] = founded.record

    # -- lifecycle ----------------------------------------------------------------------

    def found(self, group: str, replicas: list[str], app: bytes) -> None:
        meta = GroupMeta(list(replicas), app)
        self._hold(group, meta)
        self.driver.create(group, replicas, app)

    def delete(self, name: str) -> asyncio.Future[int]:
        """Propose the stream's deletion (the leader only): every replica deletes it when
        it applies the entry; the future is done once it is committed and applied here."""
        return self.driver.propose(name, _encode((_DELETE, 0.0, [])))

    def on_frame(self, link: Link, correlation: int, body: RaftFrame) -> None:
        group = body.group
        if group == META_GROUP and not (body.messages or body.stranger or body.join):
            self.meta.on_frame(link, body)
            return
        if body.join is not None:
            self._join(link, body, body.join)
            return
        if body.stranger:
            self.driver.stranger(link.name, group, body.incarnation)
            return
        if body.fetch is not None:
            if self._is_member(link.name, group):
                self.copies.serve(link.name, group, body.fetch)
            return
        if body.chunk is not None:
            self.copies.received(link.name, group, body.chunk, self.driver.now)
            return
        if body.replicas:
            if self._name() in body.replicas and group not in self.configs:
                place = body.replicas.index(self._name())
                placed = body.incarnations[place] if place < len(body.incarnations) else 0
                if placed not in (0, self.driver.incarnation):
                    return  # placed on this broker's former self (a wiped data dir)
                try:
                    self.found(group, body.replicas, body.create)
                except (msgspec.DecodeError, ValueError, StoreError) as exc:
                    log.error(
                        "could not found a replicated stream",
                        extra={"stream": group, "from": link.name, "error": str(exc)},
                    )
            return
        try:
            messages = [from_body(m) for m in body.messages]
        except ProtocolError as exc:
            log.warning("dropped a RAFT frame", extra={"from": link.name, "error": str(exc)})
            return
        self.driver.receive(link.name, group, messages, body.incarnation)

    def _is_member(self, broker: str, group: str) -> bool:
        """Whether ``broker`` holds a member of ``group`` (only they may copy it)."""
        state = self.driver.groups.get(group)
        return state is not None and bool(state.current().of_broker(broker))

    def _join(self, link: Link, body: RaftFrame, join: RaftJoinBody) -> None:
        """This broker is added to a group by its leader: it takes part, from an empty
        log, if the join is for this incarnation of it (one for a wiped self is not)."""
        group = body.group
        if join.incarnation != self.driver.incarnation:
            return
        members = [Member(m.node, m.broker, m.incarnation) for m in join.members]
        meta = GroupMeta(list(body.replicas), body.create, join.node, members)
        if group == META_GROUP:  # it has no stream, so no configuration to decode
            self.meta.join(meta)
            return
        try:
            founded = decode_config(meta.app)
            config = founded.config()
            if config.name not in self._store:
                self._store.add_stream(config)
            if self.driver.join(group, meta):
                self.configs[group] = config
                self._records[group] = founded.record
                log.warning(
                    "joined a replicated stream as a new replica; it copies the log",
                    extra={"stream": group, "from": link.name, "node": join.node},
                )
        except (msgspec.DecodeError, ValueError, StoreError) as exc:
            log.error(
                "could not join a replicated stream",
                extra={"stream": group, "from": link.name, "error": str(exc)},
            )

    # -- appends --------------------------------------------------------------------------

    def append(
        self, name: str, member: bytes, messages: list[NewMessage], acks: dict[bytes, list[int]]
    ) -> None:
        """A turn's captures of ``name``: proposed as entries of at most the entry limit;
        the reliable frames are acknowledged once every entry is committed and applied."""
        now = time.time()
        entries: list[_Rows] = [[]]
        size = 0
        for message in messages:
            weight = len(message.payload) + len(message.headers) + 128
            if weight > self._entry_limit:
                # Not acknowledged: a reliable sender gives up with DeliveryFailed.
                log.error(
                    "a message too large for a replicated stream was not stored",
                    extra={"stream": name, "bytes": weight, "limit": self._entry_limit},
                )
                self.refused += 1
                return
            if size + weight > self._entry_limit:
                entries.append([])
                size = 0
            entries[-1].append(tuple(message))  # type: ignore[arg-type]
            size += weight
        futures = [self.driver.propose(name, _encode((_APPEND, now, batch))) for batch in entries]

        def committed(_: object) -> None:
            # Every future's outcome is read (an unread exception would be logged).
            failures = [f for f in futures if not f.done() or f.cancelled() or f.exception()]
            if failures:
                self.refused += len(messages)
                self._not_stored(name, failures[0])
            elif acks:
                self._acknowledge(member, acks)

        futures[-1].add_done_callback(committed)

    # -- durable consumers ------------------------------------------------------------------

    def consume(self, name: str, command: ConsumerCommand) -> asyncio.Future[Outcome]:
        """A change of one of the stream's consumers (the leader only), proposed with the
        others of this turn as one entry; its outcome once committed and applied here
        (meshbus.broker.replication.consumers)."""
        return self._consumers.submit(name, command)

    def _propose_commands(self, name: str, batch: CommandBatch) -> asyncio.Future[int]:
        return self.driver.propose(name, _encode((_CONSUMERS, time.time(), batch)))

    def expire(self, now: float) -> None:
        """Retention by age, as an entry: each stream led here that holds a message past
        its max_age gets one, and every replica trims at its clock -- not at its own, so
        that every replica holds the same messages, and its consumers the same
        positions, at each index."""
        for name in self.configs:
            if name in self._expiring or not self.leads(name) or name not in self._store:
                continue
            if self._store.aged(name, now):
                self._expiring.add(name)
                proposed = self.driver.propose(name, _encode((_EXPIRE, now, None)))
                proposed.add_done_callback(functools.partial(self._expired, name))

    def _expired(self, name: str, done: asyncio.Future[int]) -> None:
        self._expiring.discard(name)
        if not done.cancelled():
            done.exception()  # read: the next heartbeat proposes it again if need be

    def _not_stored(self, name: str, failed: asyncio.Future[int]) -> None:
        """Say once per term why captures of ``name`` are not acknowledged here."""
        state = self.driver.groups.get(name)
        term = state.term if state is not None else 0
        if self._warned.get(name) == term:
            return
        self._warned[name] = term
        error = "cancelled" if failed.cancelled() else str(failed.exception())
        log.warning(
            "appends to a replicated stream are not acknowledged: no leader that a majority "
            "of its replicas elected takes them here (reliable senders resend, then give up)",
            extra={"stream": name, "term": term, "error": error},
        )

    # -- the state machine -------------------------------------------------------------------

    def apply(self, group: str, entries: Sequence[Entry]) -> None:
        if group == META_GROUP:
            self.meta.apply(entries)
            return
        config = self.configs.get(group)
        if config is None:
            return
        store = self._store
        applied = store.applied(group) if group in store else 0
        if entries[-1].index > applied and self.copies.copying(group):
            self.copies.abort(group)  # caught up by entries after all: the copy goes
        for entry in entries:
            if entry.membership is not None and self.leads(group):
                self._report(group)  # the meta group's record follows the group
            if not entry.data or entry.membership is not None or entry.index <= applied:
                continue  # a no-op, a membership, or applied before a restart
            try:
                kind, at, held = _decode_entry(entry.data)
                if kind == _DELETE:
                    # The name is free once the meta group knows. Every replica tells it:
                    # once this one drops the group, nothing here says so again.
                    record = self._records.pop(group, 0)
                    self._tell_meta(MetaCommand(DELETED, group, record=record))
                    self._reported.pop(group, None)
                    self.configs.pop(group, None)
                    if self.capturing.pop(group, 0):
                        self._release(group)
                    # Dropped after this turn of the driver, which settles the delete's
                    # own proposal first (a drop fails the proposals still waiting).
                    asyncio.get_running_loop().call_soon(self.driver.drop, group)
                    self._deleted(group)
                    return
                if kind == _EXPIRE:
                    with store.raft_entry(group, entry.index):
                        store.expire(at, [group])
                    continue
                if kind == _CONSUMERS:
                    batch = _decode_batch(held)
                    mine = self._consumers.waits_for(batch)
                    outcomes = apply_commands(
                        store, group, batch.commands, at, entry.index, read=mine
                    )
                    if mine:
                        self._consumers.settle(batch, outcomes)
                    continue
                messages = [NewMessage(*row) for row in _decode_rows(held)]
                store.append_entry(group, messages, at, entry.index)
            except (StoreError, msgspec.DecodeError) as exc:
                self._not_applied(group, entry.index, exc)
                return

    def _not_applied(self, group: str, index: int, error: Exception) -> None:
        """The replica cannot hold what the others do (its store failed, or the entry is
        not one this broker reads): it stops taking part until it restarts -- it would
        answer with a log it does not apply -- and keeps its log, so that a restart (room
        on the disk again, a broker that reads the entry) applies from where it stopped."""
        log.error(
            "a replicated stream's entry could not be stored here; this replica stops "
            "until the broker restarts (free space or fix the disk first)",
            extra={"stream": group, "index": index, "error": str(error)},
        )
        if self.capturing.pop(group, 0):
            self._release(group)
        self.driver.suspend(group, f"its entry {index} could not be stored here: {error}")

    def applied(self, group: str) -> int:
        if group == META_GROUP:
            return self.meta.state.applied
        return self._store.applied(group) if group in self._store else 0

    def snapshot(self, group: str) -> bytes | None:
        """A snapshot's data: the store's mark (copies.SnapshotMark), not its messages;
        the meta group's, its record whole (MetaGroup.snapshot) -- none while that is
        past what one RAFT frame carries to a voter behind (half a frame): its log is
        then kept whole, as it was before its snapshots."""
        if group == META_GROUP:
            data = self.meta.snapshot()
            return data if len(data) <= 4 * self._entry_limit else None
        if group not in self._store:
            return b""
        info = self._store.info(group)
        return encode_mark(self._store.applied(group), info.first_seq, info.last_seq)

    def install(self, group: str, source: str, index: int, now: int) -> None:
        if group == META_GROUP:
            self.meta.install()
        elif group in self.configs:
            self.copies.want(group, source, index, now)

    def flush(self) -> None:
        self._store.flush()

    def leader_changed(self, group: str, leader: str | None, term: int) -> None:
        """Who captures: the leader, as the stream's member with epoch 2 * term + 1; while
        no leader is known, each replica that knows none, with epoch 2 * term -- below
        any leader of its term, so it never takes the address from one. A replica without
        a leader takes what is sent to the stream and acknowledges none of it (it cannot
        commit), so a reliable sender gets no acknowledgement rather than the "no member,
        nothing lost" a multicast to nobody would be."""
        self.leader_moved.set()  # a drain waits for the meta group's leadership too
        if group == META_GROUP:
            self.meta.leader_changed(leader, term)
            return
        config = self.configs.get(group)
        if config is None:
            return
        if leader == self._name() and self._reported.get(group) != term:
            self._reported[group] = term
            self._report(group)
        if leader == self._name():
            epoch = 2 * term + 1
        elif leader is None or not self._linked(leader):
            # A leader this broker lost the link to has lost its routes here too: until
            # the group hears of one again, the stream still has a member.
            epoch = 2 * term
        else:
            epoch = 0
        if self.capturing.get(group, 0) == epoch:
            return
        if group in self.capturing:
            del self.capturing[group]
            self._release(group)
        if epoch:
            self.capturing[group] = epoch
            self._capture(config, member_address(group), member_session(group), epoch)

    def _report(self, group: str) -> None:
        """Tell the meta group the members of ``group`` now (this broker leads it)."""
        state = self.driver.groups.get(group)
        if state is not None:
            members = [Placed(m.broker, state.incarnation_of(m)) for m in state.current().members]
            record = self._records.get(group, 0)
            self._tell_meta(MetaCommand(MEMBERS, group, members=members, record=record))

    def _tell_meta(self, command: MetaCommand) -> None:
        def told(outcome: asyncio.Future[str]) -> None:
            if not outcome.cancelled() and (error := outcome.exception()) is not None:
                log.warning(
                    "the meta group did not commit a replicated stream's change; it is "
                    "sent again in a second",
                    extra={"stream": command.stream, "error": str(error)},
                )
                asyncio.get_running_loop().call_later(1.0, self._tell_meta, command)

        self.meta.request(command).add_done_callback(told)

    def peer_lost(self, broker: str) -> None:
        """A link to ``broker`` closed: if it was the last, the groups it leads elect
        another leader at once (``RaftDriver.broker_lost``); the captures follow."""
        if not self._linked(broker):
            self.driver.broker_lost(broker)
        self.links_changed()

    def links_changed(self) -> None:
        """A peer link opened or closed: the captures follow (``leader_changed``)."""
        for group, state in self.driver.groups.items():
            self.leader_changed(group, state.leader, state.term)
            if group == META_GROUP:
                continue
            epoch = self.capturing.get(group)
            if epoch:  # taken over by a peer that may be gone: take it back
                config = self.configs[group]
                self._capture(config, member_address(group), member_session(group), epoch)

    # -- what stream info shows -------------------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        state = self.driver.groups.get(name)
        if state is None:
            return {}
        voters, learners = self.driver.members_of(name)
        return {
            "replicas": voters,
            "learners": learners,
            "leader": state.leader or "",
            "term": state.node.term,
            "committed": state.node.log.committed,
            "snapshot": state.node.log.snapshot.index,
            "applied": self._store.applied(name) if name in self._store else 0,
            "replica_states": self.driver.replica_states(name),
        }

    def observe(self) -> dict[str, Any]:
        """For stat and /metrics: the Raft log's fsyncs and their time, its compactions,
        the snapshots installed here and the blocks copied for them (here and for
        others), and per stream its leader, term, commit lag (entries held here beyond
        the commit index: on the leader, what waits for a majority), its last snapshot
        and the entries held since, leader changes seen here and, on the leader, its
        replicas' states (``RaftDriver.replica_states``)."""
        driver = self.driver
        return {
            "syncs": driver.stats.syncs,
            "sync_seconds": driver.stats.sync_seconds,
            "compactions": driver.stats.compactions,
            "snapshots_installed": driver.stats.snapshots_installed,
            "copied_blocks": self.copies.copied_blocks,
            "served_blocks": self.copies.served_blocks,
            "streams": {
                name: {
                    "leader": state.leader or "",
                    "term": state.node.term,
                    "commit_lag": state.node.log.last_index - state.node.log.committed,
                    # The log held in memory: the entries since its last snapshot.
                    "snapshot": state.node.log.snapshot.index,
                    "log_entries": state.node.log.last_index - state.node.log.snapshot.index,
                    "leader_changes": state.leader_changes,
                    "replicas": driver.replica_states(name),
                }
                for name, state in sorted(driver.groups.items())
                if name != META_GROUP
            },
            "meta": {
                "voters": self.meta.voters(),
                "leader": self.meta.leader_name(),
                # its record, where this broker holds a copy
                "streams": sorted(self.meta.state.streams) if self.meta.holds() else None,
            },
        }

    def leader(self, name: str) -> str | None:
        return self.driver.leader_of(name)

    def leads(self, name: str) -> bool:
        return self.driver.is_leader(name)
