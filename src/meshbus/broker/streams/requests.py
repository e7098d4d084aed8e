"""The STREAM requests: answered here -- from the store, or from this replica's
committed prefix --, relayed to the stream's host or leader, or refused with what to
do; and a replicated stream's add, decided by the mesh's meta group.

A request for a stream hosted by another broker is relayed there (the brokers tell
each other the streams they host in their LOAD heartbeats); one for a replicated
stream goes to its leader when it changes the stream (a delete, a consumer's change)
or asks for a current read, and is answered by any replica otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec

from meshbus.address import CAST_MULTICAST, describe_address
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.endpoint import LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import Peers
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.mesh.relay import Relay
from meshbus.broker.mesh.sync import RouteSync
from meshbus.broker.replication.consumers import ConsumerCommand, Outcome
from meshbus.broker.replication.driver import ReplicationError
from meshbus.broker.replication.meta import ADD, ALREADY, EXISTS, ConfigBody, MetaCommand
from meshbus.broker.replication.placement import spread
from meshbus.broker.replication.streams import ReplicatedStreams
from meshbus.broker.security.permissions import CONSUMERS, stream_operation
from meshbus.broker.security.quotas import STREAM_BYTES
from meshbus.broker.streams.host import RAFT_SETTINGS, StreamHost
from meshbus.protocol.control import StoredRow, StreamReply, StreamRequest
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.raft import ProposalRefused, RaftError
from meshbus.storage.errors import ConsumerNotFound, StoreError, StoreFull, StreamNotFound
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import (
    ConsumerConfig,
    ConsumerInfo,
    StoredMessage,
    StreamConfig,
    StreamStatus,
)

# The requests a replica of a replicated stream sends on to its leader: they change the
# stream's state (a consumer's is in its Raft log too). And the reads that go there too
# when asked with ``current``.
_CONSUMER_CHANGES = frozenset({"consumer_add", "consumer_delete", "next", "ack"})
_LEADER_ONLY = _CONSUMER_CHANGES | {"delete"}
_READS = frozenset({"fetch", "info", "consumer_info"})
# Room left in a fetch answer for everything but the payloads.
_ROW_OVERHEAD = 96
# The same in a block (four indices, two offsets), with room for every message to
# have a source, destination, group and priority of its own.
_COLUMN_OVERHEAD = 128


class StreamTaken(ReplicationError):
    """A replicated stream's add of a name the mesh has a stream of (ERROR STREAM_EXISTS)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"stream {name!r} exists already in the mesh; delete it first or choose another name"
        )


class StreamRequests:
    """The STREAM requests of connectors and peers, on the streams of ``streams``."""

    def __init__(
        self,
        *,
        streams: StreamHost,
        config: BrokerConfig,
        sync: RouteSync,
        relay: Relay,
        outbox: Outbox,
        usage: UsageTable,
        peers: Peers,
        ready_brokers: Callable[[], dict[str, str]],
    ) -> None:
        """``usage`` checks a user's stream quota before an add; ``sync`` answers an add
        once every peer knows its captures; ``peers`` and the mesh's ``ready_brokers``
        (this one included, each with its zone) are for replicated streams."""
        self._streams = streams
        self._config = config
        self._sync = sync
        self._relay = relay
        self._outbox = outbox
        self._usage = usage
        self._peers = peers
        self._ready_brokers = ready_brokers
        self._adding: set[asyncio.Task[None]] = set()  # replicated adds waiting for the meta group

    def close(self) -> None:
        for task in self._adding:
            task.cancel()

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
        replicated = self._streams.replicated
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
        elif body.op not in ("add", "list") and name not in self._streams.members:
            peer = self._streams.elsewhere.get(name)
            if peer is not None and not link.is_peer:
                self._relay.relay(peer, ControlType.STREAM, body, link, correlation)
                return
            if name in self._streams.unreachable:
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
        replicated = self._streams.replicated
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
        owner = self._streams.store.consumer_owner(body.stream, body.consumer)
        if not owner or owner == body.user:  # none yet (the op says so), nobody's, or its own
            return ""
        return (
            f"permission denied: user {body.user!r} may not {body.op} consumer "
            f"{body.consumer!r} of stream {body.stream!r}: user {owner!r} made it, and only "
            f"it or a user with the operator right {CONSUMERS!r} may use or delete it "
            "(permissions.operator)"
        )

    def _unreachable(self, name: str) -> str:
        host, since = self._streams.unreachable[name]
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        return (
            f"stream {name!r} is hosted by broker {host}, unreachable from this broker since "
            f"{at} ({time.time() - since:.0f} s ago); it is back when its broker is -- "
            f"adding a stream of the same name elsewhere would make a second one"
        )

    def _refuse(self, link: Link, code: ErrorCode, message: str, correlation: int) -> None:
        self._relay.refuse(link, code, message, correlation)

    def _handle(self, link: Link, body: StreamRequest) -> StreamReply:
        store = self._streams.store
        name = body.stream
        op = body.op
        if op == "add":
            host = self._streams.elsewhere.get(name)
            if host is not None:
                raise ValueError(f"stream {name!r} is hosted by broker {host.name}")
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
            self._streams.host(config)
            return StreamReply(info=self._info(info))
        if op == "list":
            here = [{"name": n, "broker": self._config.name} for n in self._streams.members]
            replicated = self._streams.replicated
            if replicated is not None:
                # The meta group's record, where this broker holds a copy of it
                held = [*replicated.configs, *replicated.meta.state.streams]
                here += [
                    {"name": n, "broker": replicated.leader(n) or ""}
                    for n in dict.fromkeys(held)
                    if n not in self._streams.members and n not in self._streams.elsewhere
                ]
            # A name both here and announced by a peer is a replicated stream whose
            # leadership moves: listed once, as this broker sees it.
            listed_here = {s["name"] for s in here}
            there = [
                {"name": n, "broker": peer.name}
                for n, peer in self._streams.elsewhere.items()
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
            self._streams.unhost(name)
            store.delete_stream(name)
            self._usage.stream_deleted(name)
            self._streams.purge_later()
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
        replicated = self._streams.replicated
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
        replicated = self._streams.replicated
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
        if self._streams.replicated is None:
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
        hosted = len(self._streams.store.streams())
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
        replicated = self._streams.replicated
        assert replicated is not None
        name = config.name
        record = replicated.meta.state.streams.get(name)
        if record is not None:
            return not record.same_stream(_encode_config(config), count)
        if name in replicated:
            return replicated.configs[name] != config
        if name in self._streams.members:
            return True
        return name in self._streams.elsewhere and replicated.meta.holds()

    def _info(self, info: StreamStatus) -> dict[str, Any]:
        config = info.config
        store = self._streams.store
        replicated = self._streams.replicated
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
            "store": os.path.abspath(store.path) if isinstance(store, SqliteStreamStore) else "",
            "host": socket.gethostname(),
            **(replicated.describe(config.name) if replicated is not None else {}),
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
