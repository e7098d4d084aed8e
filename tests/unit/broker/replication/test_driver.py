"""The Raft driver in one process: three brokers' drivers (a fourth in the mesh for the
replacements), each with its real log file, joined by a transport that hands messages
over (or drops them for a broker that is down), and time given as ticks."""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from meshbus.broker.replication.driver import RaftDriver, ReplicationError
from meshbus.broker.replication.group import GroupMeta
from meshbus.broker.replication.members import Member
from meshbus.raft import Entry, Message, MessageType, NotLeader, RaftSettings
from meshbus.storage.errors import RaftLogFailed
from meshbus.storage.raftlog import MAGIC, RaftWal

NAMES = ("b1", "b2", "b3")
SPARE = "b4"  # in the mesh, no replica until one is replaced
SETTINGS = RaftSettings(election_ticks=10, heartbeat_ticks=1)
REPLACE_AFTER = 50  # ticks


class Machine:
    """What each broker applied, per group, and the leaders it heard of."""

    def __init__(self) -> None:
        self.applied: dict[str, list[bytes]] = {}
        self.leaders: list[tuple[str, str | None]] = []

    def apply(self, group: str, entries: Sequence[Entry]) -> None:
        applied = self.applied.setdefault(group, [])
        applied.extend(e.data for e in entries if e.data and e.membership is None)

    def leader_changed(self, group: str, leader: str | None, term: int) -> None:
        self.leaders.append((group, leader))

    # Snapshots: these drivers never compact (tests/unit/broker/replication/test_streams.py
    # has replicas that do, with their stores).
    def applied(self, group: str) -> int:
        return 0

    def snapshot(self, group: str) -> bytes:
        return b""

    def install(self, group: str, source: str, index: int, now: int) -> None:
        raise AssertionError("no snapshot is sent where no log is compacted")

    def flush(self) -> None:
        pass


async def inline(work: Callable[[], None]) -> None:
    work()


def hold_fsyncs(driver: RaftDriver) -> asyncio.Event:
    """Make ``driver``'s writes (its turn's fsync in the executor) wait until the event
    returned is set; ``driver._run_blocking = inline`` undoes it."""
    fsync_done = asyncio.Event()

    async def slow_fsync(work: Callable[[], None]) -> None:
        await fsync_done.wait()
        work()

    driver._run_blocking = slow_fsync
    return fsync_done


class Cluster:
    def __init__(self, tmp: Path, replace_after: int = 0) -> None:
        self.tmp = tmp
        self.replace_after = replace_after
        self.drivers: dict[str, RaftDriver] = {}
        self.machines: dict[str, Machine] = {}
        self.wals: dict[str, RaftWal] = {}
        self.down: set[str] = set()
        # (sender, to, what to do on the receiving driver)
        self.in_flight: list[tuple[str, str, Callable[[RaftDriver], None]]] = []
        self.incarnations = iter(range(100, 200))
        for name in (*NAMES, SPARE):
            self.start(name)

    def start(self, name: str) -> RaftDriver:
        path = self.tmp / f"{name}.wal"
        wal, _ = RaftWal.open(str(path), new_incarnation=lambda: next(self.incarnations))
        self.wals[name] = wal
        self.machines[name] = Machine()
        driver = RaftDriver(
            name=lambda: name,
            wal=wal,
            transport=self.transport(name),
            machine=self.machines[name],
            settings=SETTINGS,
            randomness=random.Random(int(name[1:])),
            run_blocking=inline,
            replace_after=self.replace_after,
            # the placement order: by name; the spare last
            candidates=lambda group: [n for n in (*NAMES, SPARE) if n not in self.down],
        )
        self.drivers[name] = driver
        driver.recover()
        return driver

    def wipe(self, name: str) -> RaftDriver:
        """``name`` restarted with its data dir wiped: a new incarnation, no group."""
        self.drivers[name].close()
        (self.tmp / f"{name}.wal").unlink()
        (self.tmp / f"{name}.state").unlink()
        return self.start(name)

    def transport(self, sender: str) -> _Transport:
        return _Transport(self, sender)

    async def turns(self, rounds: int = 30) -> None:
        """Turns and deliveries until nothing moves (or ``rounds``)."""
        for _ in range(rounds):
            for name, driver in self.drivers.items():
                if name not in self.down:
                    await driver.turn()
            flying, self.in_flight = self.in_flight, []
            for sender, to, deliver in flying:
                if to not in self.down and sender not in self.down:
                    deliver(self.drivers[to])
            if not flying and not self.in_flight:
                return

    async def tick(self, times: int = 1) -> None:
        for _ in range(times):
            for name, driver in self.drivers.items():
                if name not in self.down:
                    driver.tick()
            await self.turns()

    def leader(self, group: str) -> str | None:
        leaders = [n for n, d in self.drivers.items() if n not in self.down and d.is_leader(group)]
        assert len(leaders) <= 1
        return leaders[0] if leaders else None

    async def found(self, group: str, app: bytes = b"") -> str:
        """``group`` founded on every broker but the spare, and its leader once one is
        elected."""
        for name in NAMES:
            self.drivers[name].create(group, NAMES, app)
        return await self.elect(group)

    async def elect(self, group: str) -> str:
        for _ in range(100):
            leader = self.leader(group)
            if leader is not None:
                return leader
            await self.tick()
        raise AssertionError("no leader elected in 100 ticks")


class _Transport:
    """What meshbus.broker.replication.streams does with a RAFT frame, without the
    frame: each call is handed to the receiving driver."""

    def __init__(self, cluster: Cluster, sender: str) -> None:
        self.cluster = cluster
        self.sender = sender

    def _carry(self, broker: str, deliver: Callable[[RaftDriver, int], None]) -> None:
        incarnation = self.cluster.drivers[self.sender].incarnation
        self.cluster.in_flight.append(
            (self.sender, broker, lambda driver: deliver(driver, incarnation))
        )

    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        sender = self.sender
        self._carry(broker, lambda d, i: d.receive(sender, group, messages, i))

    def stranger(self, broker: str, group: str) -> None:
        sender = self.sender
        self._carry(broker, lambda d, i: d.stranger(sender, group, i))

    def join(self, broker: str, group: str, meta: GroupMeta, member: Member) -> None:
        joined = GroupMeta(meta.replicas, meta.app, member.node, meta.members)

        def deliver(driver: RaftDriver, _: int) -> None:
            if member.incarnation == driver.incarnation:
                driver.join(group, joined)

        self._carry(broker, deliver)


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    return Cluster(tmp_path)


async def test_a_leader_is_elected_and_appends_are_committed_everywhere(cluster: Cluster) -> None:
    leader = await cluster.found("orders", b"config")
    driver = cluster.drivers[leader]
    futures = [driver.propose("orders", f"m{i}".encode()) for i in range(10)]
    await cluster.turns()
    await cluster.tick()
    assert [f.result() for f in futures] == sorted(f.result() for f in futures)
    expected = [f"m{i}".encode() for i in range(10)]
    for name in NAMES:
        assert cluster.machines[name].applied["orders"] == expected
        assert cluster.drivers[name].leader_of("orders") == leader
    follower = next(n for n in NAMES if n != leader)
    with pytest.raises(NotLeader):
        await cluster.drivers[follower].propose("orders", b"x")


async def test_many_groups_share_one_fsync_a_turn(cluster: Cluster) -> None:
    groups = [f"s{i}" for i in range(20)]
    for name in NAMES:
        for group in groups:
            cluster.drivers[name].create(group, NAMES, b"")
    for group in groups:
        await cluster.elect(group)
    await cluster.tick(3)
    by_leader: dict[str, list[str]] = {}
    for group in groups:
        by_leader.setdefault(cluster.leader(group) or "", []).append(group)
    name, led = max(by_leader.items(), key=lambda item: len(item[1]))
    driver = cluster.drivers[name]
    for group in led:
        driver.propose(group, b"one")
    syncs, records = driver.stats.syncs, driver.stats.records
    await driver.turn()
    assert driver.stats.syncs == syncs + 1
    assert driver.stats.records == records + len(led)


async def test_a_follower_restarted_from_its_log_catches_up(cluster: Cluster) -> None:
    leader = await cluster.found("orders", b"config")
    follower = next(n for n in NAMES if n != leader)
    for i in range(5):
        cluster.drivers[leader].propose("orders", f"a{i}".encode())
    await cluster.turns()
    await cluster.tick()
    assert len(cluster.machines[follower].applied["orders"]) == 5
    # The follower goes down; the other two commit without it.
    cluster.down.add(follower)
    cluster.drivers[follower].close()
    more = [cluster.drivers[leader].propose("orders", f"b{i}".encode()) for i in range(5)]
    await cluster.turns()
    await cluster.tick()
    assert all(f.done() and not f.exception() for f in more)
    # Back from its log: the committed entries come again (the machine skips them, or,
    # like this one, starts empty), then what it missed.
    restarted = cluster.start(follower)
    assert restarted.groups["orders"].meta.app == b"config"
    cluster.down.discard(follower)
    await cluster.tick(3)
    expected = [f"a{i}".encode() for i in range(5)] + [f"b{i}".encode() for i in range(5)]
    assert cluster.machines[follower].applied["orders"] == expected
    assert cluster.leader("orders") == leader  # pre-vote: its return did not disturb


async def test_a_suspended_follower_is_silent_and_its_restart_catches_up(
    cluster: Cluster,
) -> None:
    """A follower whose machine cannot apply (its store failed: a full disk) suspends
    the group: it answers nothing -- not "no such group", which would make the leader
    take it for wiped -- and the other two commit without it; restarted, it reads the
    group back from its log and catches up."""
    leader = await cluster.found("orders", b"config")
    follower = next(n for n in NAMES if n != leader)
    stopped = cluster.drivers[follower]
    stopped.suspend("orders", "the disk is full")
    assert "orders" not in stopped.groups
    more = [cluster.drivers[leader].propose("orders", f"b{i}".encode()) for i in range(3)]
    await cluster.turns()
    await cluster.tick(SETTINGS.election_ticks)
    assert all(f.done() and not f.exception() for f in more)
    assert stopped.stats.dropped > 0
    led = cluster.drivers[leader].groups["orders"]
    assert (led.strangers, led.lost) == ({}, set())
    stopped.close()
    restarted = cluster.start(follower)
    assert "orders" in restarted.groups
    await cluster.tick(3)
    assert cluster.machines[follower].applied["orders"][-3:] == [b"b0", b"b1", b"b2"]
    assert cluster.leader("orders") == leader


async def test_a_minority_commits_nothing(cluster: Cluster) -> None:
    leader = await cluster.found("orders")
    cluster.down.update(n for n in NAMES if n != leader)
    future = cluster.drivers[leader].propose("orders", b"lost")
    await cluster.turns()
    assert not future.done()
    # check-quorum: it steps down once an election timeout passed with no majority heard
    await cluster.tick(2 * SETTINGS.election_ticks)
    assert cluster.leader("orders") is None
    with pytest.raises(ReplicationError, match="leadership moved"):
        future.result()
    assert cluster.machines[leader].applied.get("orders", []) == []


async def test_messages_not_from_a_replica_are_dropped(cluster: Cluster) -> None:
    leader = await cluster.found("orders")
    other = next(n for n in NAMES if n != leader)
    driver = cluster.drivers[other]
    dropped = driver.stats.dropped
    forged = Message(MessageType.HEARTBEAT, sender=1, to=driver.groups["orders"].node.id, term=99)
    driver.receive("intruder", "orders", [forged])
    driver.receive(leader, "nothing-here", [forged])
    assert driver.stats.dropped == dropped + 2


async def test_a_failed_log_stops_the_driver(cluster: Cluster) -> None:
    leader = await cluster.found("orders")
    driver = cluster.drivers[leader]
    cluster.wals[leader].close()  # every write now fails (EBADF), as a dead disk's would
    future = driver.propose("orders", b"x")
    await driver.turn()
    assert "the Raft log" in driver.failed
    with pytest.raises(RaftLogFailed):
        future.result()
    with pytest.raises(RaftLogFailed):
        await driver.propose("orders", b"y")


async def test_a_follower_with_a_damaged_log_repairs_before_it_votes(cluster: Cluster) -> None:
    leader = await cluster.found("orders")
    follower = next(n for n in NAMES if n != leader)
    for i in range(3):
        cluster.drivers[leader].propose("orders", f"a{i}".encode())
        await cluster.turns()
    await cluster.tick()
    cluster.down.add(follower)
    cluster.drivers[follower].close()
    # A flipped bit in the middle of its log: damage, not a torn tail.
    path = cluster.tmp / f"{follower}.wal"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    restarted = cluster.start(follower)
    node = restarted.groups["orders"].node
    assert node.repairing
    assert node.epoch == 1
    assert not node.promotable  # it neither votes nor campaigns
    cluster.down.discard(follower)
    await cluster.tick(3)
    assert not node.repairing  # the leader brought it up to date
    assert cluster.machines[follower].applied["orders"] == [b"a0", b"a1", b"a2"]


async def test_damage_to_the_log_loses_no_term_nor_vote(cluster: Cluster) -> None:
    leader = await cluster.found("orders")
    follower = next(n for n in NAMES if n != leader)
    node = cluster.drivers[follower].groups["orders"].node
    term, vote = node.term, node.vote
    assert (term, vote) == (2, NAMES.index(leader) + 1)
    cluster.down.add(follower)
    cluster.drivers[follower].close()
    # The record after the group's founding one fails its checksum: it and every record
    # after it are dropped, with the term and vote they held.
    path = cluster.tmp / f"{follower}.wal"
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    data[len(MAGIC) + 8 + length + 12] ^= 0x40
    path.write_bytes(bytes(data))
    restarted = cluster.start(follower)
    node = restarted.groups["orders"].node
    assert node.log.last_index == 1  # the founding entry alone
    assert (node.term, node.vote, node.repairing, node.epoch) == (term, vote, True, 1)
    # Damage to the founding record too: the group is gone from the log, not from the
    # state file, so a founding frame arriving late cannot found it again at term 1.
    restarted.close()
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + 12] ^= 0x40
    path.write_bytes(bytes(data))
    restarted = cluster.start(follower)
    assert "orders" not in restarted.groups
    restarted.create("orders", NAMES, b"")
    assert "orders" not in restarted.groups


async def test_hand_over_moves_each_led_group_to_a_follower_without_an_election_timeout(
    cluster: Cluster,
) -> None:
    """Before a drain (RaftDriver.hand_over): every group the broker leads gets another
    leader at once -- no tick passes, so no election timeout -- and appends go on
    there; a group it does not lead is left alone."""
    leaders = {g: await cluster.found(g) for g in ("orders", "payments")}
    leaving = leaders["orders"]
    led = sorted(g for g, name in leaders.items() if name == leaving)
    others = {g: name for g, name in leaders.items() if name != leaving}
    assert cluster.drivers[leaving].hand_over() == led
    await cluster.turns()
    for group in led:
        new = cluster.leader(group)
        assert new is not None
        assert new != leaving
        future = cluster.drivers[new].propose(group, b"after")
        await cluster.turns()
        await cluster.tick()
        assert future.done()
        assert future.result() > 0
    assert {g: cluster.leader(g) for g in others} == others
    assert cluster.drivers[leaving].hand_over() == []  # it leads nothing now


@pytest.mark.parametrize("lost", [0, 1])
async def test_hand_over_passes_a_follower_just_lost_by(cluster: Cluster, lost: int) -> None:
    """A follower lost a few ticks before a drain -- too few for a check-quorum to have
    marked it silent --, with a log as long as the other's (nothing appended since): the
    leadership goes to the other, which answers, not to the lost one, which cannot take
    it (the transfer would hold every append for an election timeout, then give up and
    leave the group to elect a leader once the drained broker is gone)."""
    leader = await cluster.found("orders")
    driver = cluster.drivers[leader]
    driver.propose("orders", b"m")
    await cluster.turns()
    await cluster.tick()
    gone = sorted(n for n in NAMES if n != leader)[lost]
    cluster.down.add(gone)
    await cluster.tick(2)
    states = {r["broker"]: (r["state"], r["lag"]) for r in driver.replica_states("orders")}
    assert states[gone] == ("follower", 0)  # as far as the leader's core knows
    assert driver.hand_over() == ["orders"]
    await cluster.turns()
    new = cluster.leader("orders")
    assert new not in (leader, gone, None)


async def test_the_leader_tells_each_replicas_state_and_lag(cluster: Cluster) -> None:
    """``stream info`` asked of the leader: every replica's state and how many entries
    of the leader's log it is not known to hold; a follower knows none of it."""
    leader = await cluster.found("orders")
    up, down = (n for n in NAMES if n != leader)
    driver = cluster.drivers[leader]
    driver.propose("orders", b"m")
    await cluster.turns()
    await cluster.tick()
    caught_up = {r["broker"]: (r["state"], r["lag"]) for r in driver.replica_states("orders")}
    assert caught_up == {leader: ("leader", 0), up: ("follower", 0), down: ("follower", 0)}
    cluster.down.add(down)
    for i in range(3):
        driver.propose("orders", f"n{i}".encode())
    await cluster.turns()
    # past a check-quorum, the one not heard from since is silent, and 3 behind
    await cluster.tick(2 * SETTINGS.election_ticks)
    states = {r["broker"]: (r["state"], r["lag"]) for r in driver.replica_states("orders")}
    assert states == {leader: ("leader", 0), up: ("follower", 0), down: ("silent", 3)}
    assert cluster.drivers[up].replica_states("orders") == []
    assert driver.replica_states("nothing") == []


async def test_hand_over_while_a_turn_waits_for_its_fsync(cluster: Cluster) -> None:
    """A drain comes whenever it comes: between a node's Ready and its advance (the turn
    waiting for its fsync in the executor), hand_over must not touch the node -- the
    core refuses anything then (DriverError) and the drain failed."""
    leader = await cluster.found("orders")
    driver = cluster.drivers[leader]
    fsync_done = hold_fsyncs(driver)
    driver.propose("orders", b"m")
    turn = asyncio.create_task(driver.turn())
    await asyncio.sleep(0)  # the turn took its Ready and waits for the disk
    assert driver.hand_over() == ["orders"]
    fsync_done.set()
    await turn
    driver._run_blocking = inline
    await cluster.turns()
    new = cluster.leader("orders")
    assert new is not None
    assert new != leader


def membership_changes(driver: RaftDriver, group: str) -> list[tuple[list[int], list[int]]]:
    """Every membership in ``group``'s log on ``driver``, in order: (voters, learners)."""
    log = driver.groups[group].node.log
    return [
        (sorted(e.membership.voters), sorted(e.membership.learners))
        for e in log.entries(log.first_index, log.last_index)
        if e.membership is not None
    ]


async def test_a_message_from_another_incarnation_of_a_member_is_dropped(
    cluster: Cluster,
) -> None:
    leader = await cluster.found("orders")
    follower = next(n for n in NAMES if n != leader)
    driver = cluster.drivers[leader]
    node = cluster.drivers[follower].groups["orders"].node.id
    answer = Message(MessageType.HEARTBEAT_RESPONSE, node, driver.groups["orders"].node.id, 2)
    dropped, received = driver.stats.dropped, driver.stats.received
    driver.receive(follower, "orders", [answer], incarnation=999)
    assert (driver.stats.dropped, driver.stats.received) == (dropped + 1, received)
    driver.receive(follower, "orders", [answer], cluster.drivers[follower].incarnation)
    assert (driver.stats.dropped, driver.stats.received) == (dropped + 1, received + 1)


async def test_a_wiped_follower_is_replaced_by_its_new_incarnation(cluster: Cluster) -> None:
    """A follower's data dir wiped while it is down: back, it holds no group and says
    so as a new incarnation. The leader adds it as a new member (a learner with a node
    id never used), which copies the whole log; the old member, not heard from, is
    removed first, then the new one promoted. Then it counts: with the other follower
    down, the leader and it commit."""
    leader = await cluster.found("orders")
    wiped, other = (n for n in NAMES if n != leader)
    driver = cluster.drivers[leader]
    for i in range(10):
        driver.propose("orders", f"a{i}".encode())
    await cluster.turns()
    old = cluster.drivers[wiped].groups["orders"].node.id
    cluster.down.add(wiped)
    await cluster.tick(3 * SETTINGS.election_ticks)
    cluster.wipe(wiped)
    assert "orders" not in cluster.drivers[wiped].groups
    cluster.down.discard(wiped)
    for i in range(5):
        driver.propose("orders", f"b{i}".encode())
    await cluster.tick(10)
    voters, learners = driver.members_of("orders")
    assert (sorted(voters), learners) == (sorted(NAMES), [])
    rebuilt = cluster.drivers[wiped].groups["orders"].node
    assert rebuilt.id == 4
    assert membership_changes(driver, "orders") == [
        ([1, 2, 3], []),
        ([1, 2, 3], [4]),
        (sorted({1, 2, 3, 4} - {old, 4}), [4]),
        (sorted({1, 2, 3, 4} - {old}), []),
    ]
    everything = [f"a{i}".encode() for i in range(10)] + [f"b{i}".encode() for i in range(5)]
    assert cluster.machines[wiped].applied["orders"] == everything
    assert cluster.drivers[wiped].members_of("orders") == driver.members_of("orders")
    cluster.down.add(other)
    future = driver.propose("orders", b"c")
    await cluster.turns()
    await cluster.tick()
    assert future.result() > 0
    assert cluster.machines[wiped].applied["orders"][-1] == b"c"
    # Restarted, the rebuilt replica is its new member still.
    cluster.drivers[wiped].close()
    assert cluster.start(wiped).groups["orders"].node.id == 4


async def test_a_silent_voter_is_replaced_by_the_next_broker_in_placement_order(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path, replace_after=REPLACE_AFTER)
    leader = await cluster.found("orders")
    gone, other = (n for n in NAMES if n != leader)
    driver = cluster.drivers[leader]
    for i in range(10):
        driver.propose("orders", f"a{i}".encode())
    await cluster.turns()
    cluster.down.add(gone)
    await cluster.tick(REPLACE_AFTER - 5)
    assert len(membership_changes(driver, "orders")) == 1  # not yet
    await cluster.tick(15)
    voters, learners = driver.members_of("orders")
    assert (sorted(voters), learners) == (sorted({leader, other, SPARE}), [])
    assert cluster.machines[SPARE].applied["orders"] == [f"a{i}".encode() for i in range(10)]
    cluster.down.add(other)
    future = driver.propose("orders", b"b")
    await cluster.turns()
    await cluster.tick()
    assert future.result() > 0
    # The removed voter, back, is no member: nothing it says counts (pre-vote and the
    # lease keep it from disturbing the group).
    cluster.down.discard(gone)
    await cluster.tick(3 * SETTINGS.election_ticks)
    assert cluster.leader("orders") == leader


class Told:
    """A transport that records whom this broker tells it holds no such group."""

    def __init__(self) -> None:
        self.strangers: list[tuple[str, str]] = []

    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        pass

    def stranger(self, broker: str, group: str) -> None:
        self.strangers.append((broker, group))

    def join(self, broker: str, group: str, meta: GroupMeta, member: Member) -> None:
        pass


async def test_a_broker_says_it_holds_no_group_only_once_it_read_its_log_back(
    tmp_path: Path,
) -> None:
    """A broker that restarts hears from its peers before its groups are read back (the
    mesh's join comes first): saying then that it holds none would make their leader
    replace it as if its data dir had been wiped. Once read back, it says so once an
    election timeout for a group it does not hold."""
    wal, _ = RaftWal.open(str(tmp_path / "b2.wal"))
    told = Told()
    driver = RaftDriver(
        name=lambda: "b2",
        wal=wal,
        transport=told,
        machine=Machine(),
        settings=SETTINGS,
        randomness=random.Random(2),
        run_blocking=inline,
    )
    heartbeat = Message(MessageType.HEARTBEAT, 1, 2, 2)
    driver.receive("b1", "orders", [heartbeat])
    assert told.strangers == []
    driver.recover()
    driver.receive("b1", "orders", [heartbeat])
    driver.receive("b1", "orders", [heartbeat])
    assert told.strangers == [("b1", "orders")]
    for _ in range(SETTINGS.election_ticks):
        driver.tick()
    await driver.turn()
    driver.receive("b1", "orders", [heartbeat])
    assert told.strangers == [("b1", "orders")] * 2
    driver.close()


async def test_a_leaders_appends_leave_while_its_fsync_runs(cluster: Cluster) -> None:
    """The leader's fsync and its followers' run at once: its appends leave before its
    own write is durable; the followers answer once theirs is; the answers wait for
    the leader's turn to end, and the commit they make needs no fsync."""
    leader = await cluster.found("orders")
    await cluster.tick(2)
    driver = cluster.drivers[leader]
    fsync_done = hold_fsyncs(driver)
    future = driver.propose("orders", b"m")
    turn = asyncio.create_task(driver.turn())
    await asyncio.sleep(0)  # the turn took its Ready and waits for the disk
    sent = [(sender, to) for sender, to, _ in cluster.in_flight]
    assert sorted(sent) == [(leader, n) for n in NAMES if n != leader]
    flying, cluster.in_flight = cluster.in_flight, []
    for _, to, deliver in flying:
        deliver(cluster.drivers[to])
    for name in NAMES:
        if name != leader:
            await cluster.drivers[name].turn()  # fsyncs, then answers
    for _, to, deliver in cluster.in_flight:
        assert to == leader
        deliver(driver)
    cluster.in_flight.clear()
    assert not future.done()
    fsync_done.set()
    await turn
    driver._run_blocking = inline
    syncs = driver.stats.syncs
    await driver.turn()  # the answers: committed, applied, acknowledged
    assert future.result() > 0
    assert driver.stats.syncs == syncs  # a commit index alone is not fsynced


async def test_committed_entries_are_acknowledged_before_the_turns_fsync(
    cluster: Cluster,
) -> None:
    leader = await cluster.found("orders")
    await cluster.tick(2)
    driver = cluster.drivers[leader]
    first = driver.propose("orders", b"first")
    await driver.turn()
    flying, cluster.in_flight = cluster.in_flight, []
    for _, to, deliver in flying:
        deliver(cluster.drivers[to])
    for name in NAMES:
        if name != leader:
            await cluster.drivers[name].turn()
    flying, cluster.in_flight = cluster.in_flight, []
    for _, _, deliver in flying:
        deliver(driver)
    # One turn steps the answers that commit the first and takes the second: its
    # write of the second must be synced, the first is durable on a majority already.
    second = driver.propose("orders", b"second")
    fsync_done = hold_fsyncs(driver)
    turn = asyncio.create_task(driver.turn())
    await asyncio.sleep(0)
    assert first.done()
    assert cluster.machines[leader].applied["orders"] == [b"first"]
    assert not second.done()
    fsync_done.set()
    await turn
    driver._run_blocking = inline
    await cluster.turns()
    assert second.result() == first.result() + 1


async def test_followers_that_lose_the_leaders_broker_elect_without_a_tick(
    cluster: Cluster,
) -> None:
    """The leader's broker is killed and its links close (RaftDriver.broker_lost): the
    survivors elect a new leader and commit before any tick -- no election timeout of
    silence is waited out --, and a group led elsewhere keeps its leader."""
    leaders = {g: await cluster.found(g) for g in ("orders", "payments", "refunds")}
    killed = leaders["orders"]
    cluster.down.add(killed)
    survivors = [n for n in NAMES if n != killed]
    for name in survivors:
        cluster.drivers[name].broker_lost(killed)
    await cluster.turns()
    for group, was in leaders.items():
        now = cluster.leader(group)
        if was != killed:
            assert now == was
            continue
        assert now in survivors
        future = cluster.drivers[now].propose(group, b"after")
        await cluster.turns()
        assert future.result() > 0


async def test_a_follower_answers_before_it_applies(cluster: Cluster) -> None:
    """A follower's applies acknowledge nothing: its answer to the leader leaves once
    its fsync is done, without waiting for its store's writes too."""
    leader = await cluster.found("orders")
    await cluster.tick(2)
    follower = next(n for n in NAMES if n != leader)
    machine = cluster.machines[follower]
    store = machine.apply
    answered: list[bool] = []

    def apply(group: str, entries: Sequence[Entry]) -> None:
        flying = [(sender, to) for sender, to, _ in cluster.in_flight]
        answered.append((follower, leader) in flying)
        store(group, entries)

    machine.apply = apply  # type: ignore[method-assign]
    for value in (b"first", b"second"):
        cluster.drivers[leader].propose("orders", value)
        await cluster.turns()
    assert machine.applied["orders"] == [b"first", b"second"]
    assert answered
    assert all(answered)
