"""The meta group on three brokers in one process: real drivers, Raft logs and SQLite
stores, the RAFT frames between them delivered by hand (and dropped where a test says
so). What it decides is decided once: a name is taken by the first add committed, a
stream's group is founded only from a committed record, and a leader that committed an
add and stopped before telling the members leaves no stream half-founded."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from meshbus.broker.replication.compaction import CompactionPolicy
from meshbus.broker.replication.driver import RaftDriver
from meshbus.broker.replication.group import GroupMeta
from meshbus.broker.replication.members import Member
from meshbus.broker.replication.meta import (
    ADD,
    ADDED,
    ALREADY,
    EXISTS,
    META_GROUP,
    ConfigBody,
    MetaCommand,
    Placed,
)
from meshbus.broker.replication.streams import ReplicatedStreams
from meshbus.broker.replication.transport import found_frame, join_frame
from meshbus.protocol.control import (
    RaftChunkBody,
    RaftFetchBody,
    RaftFrame,
)
from meshbus.raft import Message, RaftSettings
from meshbus.storage.raftlog import RaftWal
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import StreamConfig

NAMES = ("b1", "b2", "b3", "b4")  # b4 holds no copy of the meta group
VOTERS = ["b1", "b2", "b3"]
SETTINGS = RaftSettings(election_ticks=10, heartbeat_ticks=1)
GROUP = bytes([2]) + bytes(15)
OTHER = bytes([2]) + bytes(14) + b"\x01"


class PeerLink:
    """What a RAFT frame's handler reads of the link it came on: the peer's name."""

    def __init__(self, name: str) -> None:
        self.name = name


class Wire:
    """One broker's sends, queued for ``Mesh.turns`` to deliver: Raft messages, and
    RAFT frames (founding, the meta group's commands and answers)."""

    def __init__(self, sender: str, mesh: Mesh, incarnation: int) -> None:
        self.sender = sender
        self.mesh = mesh
        self.incarnation = incarnation  # in every RAFT frame, as PeerTransport sends

    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        self.mesh.messages.append((self.sender, broker, group, messages))

    def stranger(self, broker: str, group: str) -> None:
        self.frame(broker, RaftFrame(group=group, stranger=True))

    def join(self, broker: str, group: str, meta: GroupMeta, member: Member) -> None:
        self.frame(broker, join_frame(group, meta, member))

    def found(
        self,
        broker: str,
        group: str,
        replicas: list[str],
        config: bytes,
        incarnations: Sequence[int] = (),
    ) -> None:
        self.frame(broker, found_frame(group, replicas, config, incarnations))

    def frame(self, broker: str, body: RaftFrame) -> None:
        body = msgspec.structs.replace(body, incarnation=self.incarnation)
        self.mesh.frames.append((self.sender, broker, body))

    def fetch(self, broker: str, group: str, body: RaftFetchBody) -> None:
        self.frame(broker, RaftFrame(group=group, fetch=body))

    def chunk(self, broker: str, group: str, body: RaftChunkBody) -> None:
        self.frame(broker, RaftFrame(group=group, chunk=body))


async def inline(work: Callable[[], None]) -> None:
    work()


class Broker:
    def __init__(
        self,
        name: str,
        tmp: Path,
        mesh: Mesh,
        voters: Sequence[str],
        replace_after: int,
        compaction: CompactionPolicy | None,
    ) -> None:
        self.name = name
        self.store = SqliteStreamStore(tmp / f"{name}.db")
        self.wal, _ = RaftWal.open(str(tmp / f"{name}.wal"))
        wire = Wire(name, mesh, self.wal.incarnation)

        def driver(machine: ReplicatedStreams) -> RaftDriver:
            return RaftDriver(
                name=lambda: name,
                wal=self.wal,
                transport=wire,
                machine=machine,
                settings=SETTINGS,
                randomness=random.Random(NAMES.index(name)),
                run_blocking=inline,
                replace_after=replace_after,
                compaction=compaction,
                candidates=lambda _: [b for b in NAMES if b not in mesh.down],
            )

        self.streams = ReplicatedStreams(
            name=lambda: name,
            store=self.store,
            transport=wire,  # type: ignore[arg-type]  # the frames a PeerTransport sends
            driver=driver,
            capture=lambda *_: None,
            release=lambda _: None,
            deleted=lambda _: None,
            acknowledge=lambda *_: None,
            entry_limit=16 * 1024,
            linked=lambda _: True,
            copy_retry=SETTINGS.election_ticks,
            meta_voters=voters,
        )
        self.meta = self.streams.meta
        self.streams.restore()


class Mesh:
    def __init__(
        self,
        tmp: Path,
        voters: Sequence[str] = (),
        replace_after: int = 0,
        compaction: CompactionPolicy | None = None,
    ) -> None:
        """``voters``: every broker's --meta-voter; ``replace_after``: their
        --replace-after, in ticks (0: never); ``compaction``: their logs' policy."""
        self.messages: list[tuple[str, str, str, Sequence[Message]]] = []
        self.frames: list[tuple[str, str, RaftFrame]] = []
        self.down: set[str] = set()  # brokers whose sends and receives are lost
        self.drop_founding = False  # lose every frame that founds a stream's group
        self.mute_meta: set[str] = set()  # brokers whose meta group sends are lost
        self.brokers = {
            name: Broker(name, tmp, self, voters, replace_after, compaction) for name in NAMES
        }

    def __getitem__(self, name: str) -> Broker:
        return self.brokers[name]

    def tell_loads(self) -> None:
        """Every broker's LOAD to every other (what it knows of the meta group)."""
        for sender in self.brokers.values():
            incarnation, voters, leader = (
                sender.streams.driver.incarnation,
                *sender.meta.advertised(),
            )
            for receiver in self.brokers.values():
                if receiver is sender:
                    continue
                if {sender.name, receiver.name} & self.down:
                    receiver.meta.peer_lost(sender.name)  # its link closed
                else:
                    receiver.meta.peer_loaded(sender.name, voters, leader, incarnation)

    async def turns(self, ticks: int = 3) -> None:
        for tick in range(ticks + 1):
            if tick:
                for broker in self.up():
                    broker.streams.driver.tick()
            for _ in range(30):
                await asyncio.sleep(0)  # what the callbacks of this turn proposed
                for broker in self.up():
                    await broker.streams.driver.turn()
                self.tell_loads()
                messages, self.messages[:] = list(self.messages), []
                frames, self.frames[:] = list(self.frames), []
                for sender, to, group, batch in messages:
                    if group == META_GROUP and sender in self.mute_meta:
                        continue
                    if not {sender, to} & self.down:
                        incarnation = self[sender].streams.driver.incarnation
                        self[to].streams.driver.receive(sender, group, batch, incarnation)
                for sender, to, body in frames:
                    founding = body.group != META_GROUP and bool(body.replicas)
                    if {sender, to} & self.down or (founding and self.drop_founding):
                        continue
                    if body.group == META_GROUP and sender in self.mute_meta:
                        continue
                    self[to].streams.on_frame(PeerLink(sender), 0, body)  # type: ignore[arg-type]
                if not messages and not frames:
                    break

    def up(self) -> list[Broker]:
        return [b for n, b in self.brokers.items() if n not in self.down]

    async def meta_leader(self) -> Broker:
        for _ in range(60):
            leaders = [b for b in self.up() if b.meta.leads()]
            if leaders:
                await self.turns(1)
                return leaders[0]
            await self.turns(1)
        raise AssertionError("no meta leader elected")

    def close(self) -> None:
        for broker in self.brokers.values():
            broker.streams.driver.close()
            broker.store.close()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    made = Mesh(tmp_path)
    yield made
    made.close()


def add(
    name: str, members: Sequence[str] = VOTERS, captures: tuple[bytes, ...] = (GROUP,)
) -> MetaCommand:
    config = msgspec.msgpack.encode(ConfigBody.of(StreamConfig(name, captures)))
    return MetaCommand(ADD, name, config, [Placed(b) for b in members])


def records(mesh: Mesh) -> dict[str, Any]:
    """Each voter's records (they must be the same)."""
    return {
        n: {s: (r.brokers, r.confirmed) for s, r in b.meta.state.streams.items()}
        for n, b in mesh.brokers.items()
        if b.meta.holds()
    }


async def test_the_broker_that_adds_first_founds_it_on_the_first_three_by_name(
    mesh: Mesh,
) -> None:
    assert mesh["b4"].meta.found_if_none(list(NAMES))  # a broker that is no voter
    await mesh.turns()
    assert [n for n, b in mesh.brokers.items() if b.meta.holds()] == VOTERS
    leader = await mesh.meta_leader()
    assert leader.name in VOTERS
    for broker in mesh.brokers.values():  # from their copy, or the voters' LOADs
        assert broker.meta.advertised() == (VOTERS, leader.name)
    # Once one is known, nobody founds another.
    assert mesh["b1"].meta.found_if_none(["b2", "b3", "b4"])
    await mesh.turns()
    assert not mesh["b4"].meta.holds()


async def test_two_adds_of_one_name_at_once_make_one_stream(mesh: Mesh) -> None:
    mesh["b1"].meta.found_if_none(list(NAMES))
    leader = await mesh.meta_leader()
    asker = next(b for b in mesh.up() if b is not leader and b.name != "b4")
    # One proposed on the leader, one sent to it by a follower, one by a non-voter,
    # each placing the stream elsewhere: the first applied wins; of the others, the
    # same stream is there already, another one is refused.
    first = leader.meta.propose(add("ledger", ["b1", "b2", "b3"]))
    second = asker.meta.request(add("ledger", ["b2", "b3", "b4"]))
    third = mesh["b4"].meta.request(add("ledger", ["b1", "b3", "b4"], captures=(OTHER,)))
    await mesh.turns()
    assert [first.result(), second.result(), third.result()] == [ADDED, ALREADY, EXISTS]
    held = records(mesh)
    assert len(held) == 3
    assert all(h == next(iter(held.values())) for h in held.values())
    # The stream's group is founded on the record's members only; its leader reports
    # its members, which confirms the record.
    for _ in range(30):
        if all(r["ledger"][1] for r in records(mesh).values()):
            break
        await mesh.turns(1)
    assert {n: r["ledger"] for n, r in records(mesh).items()} == dict.fromkeys(
        VOTERS, (["b1", "b2", "b3"], True)
    )
    assert [n for n, b in mesh.brokers.items() if "ledger" in b.streams] == VOTERS
    assert mesh["b4"].streams.driver.groups.keys() == set()


async def test_an_add_committed_by_a_leader_that_stops_is_founded_by_the_next(
    mesh: Mesh,
) -> None:
    mesh["b1"].meta.found_if_none(list(NAMES))
    leader = await mesh.meta_leader()
    mesh.drop_founding = True  # the leader stops before the members hear of it
    placed = [n for n in NAMES if n != leader.name]
    added = leader.meta.propose(add("ledger", placed))
    await mesh.turns()
    assert added.result() == ADDED
    assert not any("ledger" in b.streams for b in mesh.brokers.values())
    mesh.drop_founding = False
    mesh.down.add(leader.name)
    others = [b for b in mesh.up() if b.name in VOTERS]
    for _ in range(60):
        if any(b.meta.leads() for b in others):
            break
        await mesh.turns(1)
    new = next(b for b in others if b.meta.leads())
    await mesh.turns()  # it applies an entry of its term, then founds what is unconfirmed
    members = [n for n, b in mesh.brokers.items() if "ledger" in b.streams]
    assert members == placed, new.name
    for _ in range(30):
        if records(mesh)[new.name]["ledger"][1]:
            break
        await mesh.turns(1)
    assert records(mesh)[new.name]["ledger"] == (placed, True)


async def test_a_replica_placed_as_another_self_founds_nothing(mesh: Mesh) -> None:
    mesh["b1"].meta.found_if_none(list(NAMES))
    leader = await mesh.meta_leader()
    wiped = mesh["b4"].streams.driver.incarnation + 1  # placed as a self it no longer is
    command = add("ledger", ["b2", "b3", "b4"])
    command = msgspec.structs.replace(
        command, members=[Placed("b2"), Placed("b3"), Placed("b4", wiped)]
    )
    assert (await asyncio.gather(leader.meta.propose(command), mesh.turns()))[0] == ADDED
    assert [n for n, b in mesh.brokers.items() if "ledger" in b.streams] == ["b2", "b3"]


async def test_a_deleted_stream_frees_its_name(mesh: Mesh) -> None:
    mesh["b1"].meta.found_if_none(list(NAMES))
    leader = await mesh.meta_leader()
    leader.meta.propose(add("ledger"))
    stream_leader: Broker | None = None
    for _ in range(60):
        await mesh.turns(1)
        stream_leader = next((b for b in mesh.up() if b.streams.leads("ledger")), None)
        if stream_leader is not None:
            break
    assert stream_leader is not None
    deleted = stream_leader.streams.delete("ledger")
    await mesh.turns()
    assert deleted.done()
    assert deleted.exception() is None
    await mesh.turns()
    assert records(mesh) == {key: {} for key in VOTERS}
    again = leader.meta.propose(add("ledger"))
    await mesh.turns()
    assert again.result() == ADDED


async def test_a_stream_leader_that_stops_as_its_delete_commits_frees_the_name(
    mesh: Mesh,
) -> None:
    """The stream's leader goes down once every replica applied its delete (so no
    replica holds the group any more), before its DELETED reached the meta group: the
    followers tell the meta group too -- or the name stayed taken by a stream that no
    broker holds."""
    mesh["b1"].meta.found_if_none(list(NAMES))
    leader = await mesh.meta_leader()
    leader.meta.propose(add("ledger", ["b2", "b3", "b4"]))
    stream_leader: Broker | None = None
    for _ in range(60):
        await mesh.turns(1)
        stream_leader = next((b for b in mesh.up() if b.streams.leads("ledger")), None)
        if stream_leader is not None and all(r["ledger"][1] for r in records(mesh).values()):
            break
    assert stream_leader is not None
    mesh.mute_meta.add(stream_leader.name)  # what it tells the meta group is lost
    deleted = stream_leader.streams.delete("ledger")
    for _ in range(60):
        await mesh.turns(1)
        if not any("ledger" in b.streams for b in mesh.brokers.values()):
            break
    assert deleted.exception() is None
    mesh.down.add(stream_leader.name)
    for _ in range(60):
        await mesh.turns(1)
        if all("ledger" not in r for n, r in records(mesh).items() if n not in mesh.down):
            break
    held = {n: r for n, r in records(mesh).items() if n not in mesh.down}
    assert held == {n: {} for n in VOTERS if n not in mesh.down}
    meta_leader = await mesh.meta_leader()
    again = meta_leader.meta.propose(add("ledger", ["b1", "b2", "b3"]))
    await mesh.turns()
    assert again.result() == ADDED


async def test_a_drain_hands_the_meta_leadership_over_and_hears_of_it(mesh: Mesh) -> None:
    mesh["b1"].meta.found_if_none(list(NAMES))
    leader = await mesh.meta_leader()
    leader.streams.leader_moved.clear()  # what a drain waits on (hand_over_leaderships)
    assert leader.streams.driver.hand_over() == [META_GROUP]
    for _ in range(30):
        if not leader.meta.leads():
            break
        await mesh.turns(1)
    assert not leader.meta.leads()
    assert leader.streams.leader_moved.is_set()
    new = await mesh.meta_leader()
    assert new is not leader
    assert leader.meta.leader_name() == new.name


async def test_configured_voters_found_it_at_start_and_nobody_else_does(tmp_path: Path) -> None:
    mesh = Mesh(tmp_path, voters=["b4", "b2", "b3"])
    try:
        assert [n for n, b in mesh.brokers.items() if b.meta.holds()] == ["b2", "b3", "b4"]
        leader = await mesh.meta_leader()
        assert mesh["b1"].meta.advertised() == (["b2", "b3", "b4"], leader.name)
        assert mesh["b1"].meta.found_if_none(list(NAMES))  # one is known: none founded
        await mesh.turns()
        assert not mesh["b1"].meta.holds()
        added = leader.meta.propose(add("ledger", ["b1", "b2", "b3"]))
        await mesh.turns()
        assert added.result() == ADDED
    finally:
        mesh.close()


async def test_a_voter_silent_past_replace_after_is_replaced_by_a_broker_that_joins(
    tmp_path: Path,
) -> None:
    """The meta group holds no stream, so its join carries no stream configuration: the
    broker it adds joins all the same (it once failed to, decoding an empty one), copies
    the log and votes; the records are the same on the three voters after."""
    mesh = Mesh(tmp_path, voters=VOTERS, replace_after=30)
    try:
        leader = await mesh.meta_leader()
        added = leader.meta.propose(add("orders"))
        await mesh.turns()
        assert added.result() == ADDED
        silent = next(n for n in VOTERS if n != leader.name)
        mesh.down.add(silent)
        for _ in range(20):
            await mesh.turns(5)
            if mesh["b4"].meta.holds() and silent not in leader.meta.voters():
                break
        await mesh.turns()
        assert mesh["b4"].meta.holds()
        assert sorted(leader.meta.voters()) == sorted({*VOTERS, "b4"} - {silent})
        assert mesh["b4"].meta.state.streams.keys() == {"orders"}
        added = leader.meta.propose(add("ledger"))  # committed with b4's vote
        await mesh.turns()
        assert added.result() == ADDED
        held = records(mesh)
        del held[silent]  # cut off: it knows nothing of the change
        assert len(held) == 3
        assert len({repr(r) for r in held.values()}) == 1
    finally:
        mesh.close()


async def test_the_meta_group_s_log_is_compacted_and_its_record_kept(tmp_path: Path) -> None:
    """The record is the meta group's snapshot data: its log is compacted as a stream's
    (a user adding and deleting streams in a loop must not grow it for ever). A voter
    restarted loads the record from its log's snapshot and applies what follows; a
    voter that was down while the leader compacted past it installs the leader's
    snapshot, record and all."""
    compaction = CompactionPolicy(entries=2, bytes=1 << 20)
    mesh = Mesh(tmp_path, voters=VOTERS, compaction=compaction)
    try:
        leader = await mesh.meta_leader()
        for number in range(8):
            added = leader.meta.propose(add(f"s{number}"))
            await mesh.turns()
            assert added.result() == ADDED
        for name in VOTERS:
            assert mesh[name].streams.driver.groups[META_GROUP].node.log.snapshot.index > 0
        assert len(records(mesh)["b1"]) == 8
        # A follower restarted: its record, from the snapshot and the entries after it.
        follower = next(n for n in VOTERS if n != leader.name)
        before = records(mesh)[follower]
        mesh[follower].streams.driver.close()
        mesh[follower].store.close()
        restarted = Broker(follower, tmp_path, mesh, VOTERS, 0, compaction)
        mesh.brokers[follower] = restarted
        assert restarted.meta.state.applied > 0  # the snapshot's record, before any turn
        await restarted.streams.driver.turn()  # the committed entries after it, again
        assert records(mesh)[follower] == before
        # The other follower down while the leader adds and compacts past it.
        lagging = next(n for n in VOTERS if n not in (leader.name, follower))
        mesh.down.add(lagging)
        await mesh.turns(2 * SETTINGS.election_ticks)
        for number in range(8, 16):
            added = leader.meta.propose(add(f"s{number}"))
            await mesh.turns()
            assert added.result() == ADDED
        leader_log = leader.streams.driver.groups[META_GROUP].node.log
        lagging_log = mesh[lagging].streams.driver.groups[META_GROUP].node.log
        compacted_to = leader_log.snapshot.index
        assert compacted_to > lagging_log.last_index  # behind the compaction
        mesh.down.discard(lagging)

        def installed() -> bool:
            log = mesh[lagging].streams.driver.groups[META_GROUP].node.log
            return log.snapshot.index >= compacted_to and len(records(mesh)[lagging]) == 16

        for _ in range(60):
            await mesh.turns(1)
            if installed():
                break
        assert installed()
        # And it goes on applying what follows.
        added = leader.meta.propose(add("s16"))
        await mesh.turns()
        assert added.result() == ADDED
        held = records(mesh)
        assert held[lagging] == held[leader.name] == held[follower]
        assert len(held[lagging]) == 17
    finally:
        mesh.close()


async def test_a_record_past_half_a_frame_keeps_the_meta_log_whole(mesh: Mesh) -> None:
    """The meta group's snapshot goes to a voter behind in one RAFT frame: a record past
    half of one (about 2,500 streams with the default --max-frame) is not snapshotted,
    and the log is kept whole, as before there were snapshots."""
    streams = mesh["b1"].streams
    state = streams.meta.state
    for number in range(20):
        state.apply(number + 1, add(f"s{number}"))
    assert streams.snapshot(META_GROUP) == state.dump()
    record = state.streams["s0"]
    per_record = len(state.dump()) // 20
    for number in range(20, 4 * 16 * 1024 // per_record + 20):
        state.streams[f"s{number}"] = record
    assert streams.snapshot(META_GROUP) is None
