"""A seeded simulation of the Raft core, in the manner of FoundationDB's and
TigerBeetle's simulators: 3 or 5 nodes (and one more that may join) in one process,
with a fake disk and network, driven by a random schedule that a seed fixes, so a
failing seed replays exactly (``pytest -k 'size3-seed17'``).

Each step does one of: a node ticks; a node takes its Ready -- sends its early
messages (a leader's appends), applies what is committed (or, 30 % of the time, does
so only after the write and its messages) -- and its write is fsynced then or at a
later step, other nodes acting meanwhile (a node that crashes before
the fsync lost the write or kept it, at random, after those messages left: a leader's
entries may be committed by its followers alone, and it must learn them again);
a message in flight is delivered (any one: they are reordered), sometimes keeping a
copy to deliver again (duplicated), or dropped; the network is split in two or
healed; a follower is told its leader is gone (rightly or not: ``leader_lost``,
a closed link); a node crashes (losing all it had not fsynced) or restarts; a node's log is
damaged (a minority of voters at most: a record of its log fails its checksum, and it
and every later record are lost -- the entries, the commit index and the hard states
they held -- or the whole log is; it restarts repairing, with the term, vote and epoch
it kept apart from the log: harness.Disk); a node compacts its log into a snapshot;
the leader is asked for an entry, a read, a membership change or a leadership
transfer. A second schedule (STALE_LEADERS) cuts leaders off for long and crashes
less, so a stale leader leads on while the others elect, and damaged nodes meet it.

After every step, what must always hold is checked:

- a node never goes back to an older term, nor votes twice in a term, across any
  restart: what it made durable and told the others stays (a driver that keeps the
  hard state in its log only fails this: ``test_a_hard_state_lost_with_the_log_is_found``);
- election safety: at most one leader per term;
- log matching: two logs (in memory or on disk) with an entry of the same index and
  term hold the same entry there and the same entries before it;
- leader completeness: a leader's log holds every entry acknowledged (applied by a
  leader) in its term or before;
- acknowledged => durable: every acknowledged entry is on the disks of enough voters
  that every majority of the voters not repairing includes one (with no node
  repairing and an odd number of voters: on a majority), so it is never lost;
- state machine safety: no two nodes apply different entries at one index, and a
  snapshot is the state at its index;
- reads: a ReadIndex read is confirmed at an index at or past every entry
  acknowledged before it was asked.

After the schedule, the faults stop and the network heals: within a bounded number
of steps one leader must commit a new entry, every member must hold every
acknowledged entry and none may still be repairing.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

from meshbus.raft import (
    ChangeKind,
    Entry,
    Membership,
    MembershipChange,
    RaftError,
    RaftNode,
    RaftSettings,
    Ready,
    Role,
)
from tests.unit.raft.harness import Cluster, SimNode

STEPS = 2000
SEEDS = {3: range(100), 5: range(60)}
CASES = [(size, seed) for size, seeds in SEEDS.items() for seed in seeds]
STALE_SEEDS = {3: range(12), 5: range(6)}  # with the STALE_LEADERS schedule
STALE_CASES = [(size, seed) for size, seeds in STALE_SEEDS.items() for seed in seeds]

# (action, weight): how often each step is drawn.
ACTIONS = [
    ("deliver", 30),
    ("process", 25),
    ("sync", 12),
    ("tick", 14),
    ("propose", 8),
    ("drop", 2),
    ("read", 2),
    ("heal", 2),
    ("restart", 3),
    ("crash", 2),
    ("partition", 1),
    ("compact", 1),
    ("change", 1),
    ("transfer", 0.5),
    ("corrupt", 2),
    ("lose_leader", 2),
]
# A leader cut off for long and few crashes: a stale leader leads on while the others
# elect, and a damaged node may meet it (docs/raft.md, "Corruption").
STALE_LEADERS = {
    **dict(ACTIONS),
    "tick": 30,
    "heal": 0.3,
    "partition": 0.6,
    "crash": 0.3,
    "restart": 2,
    "change": 0.3,
    "corrupt": 1.5,
}


@dataclass
class Simulation:
    seed: int
    size: int
    keeps_apart: bool = True  # False: a driver that keeps the hard state in its log only
    actions: dict[str, float] = field(default_factory=lambda: dict(ACTIONS))
    late_applies: float = 0.3  # the share of Readys applied only after their write
    rng: random.Random = field(init=False)
    cluster: Cluster = field(init=False)
    leaders: dict[int, int] = field(default_factory=dict)  # term -> its leader
    acked: dict[int, tuple[Entry, int]] = field(default_factory=dict)  # index -> (entry, term)
    applied: dict[int, Entry] = field(default_factory=dict)  # index -> the entry applied there
    node_applied: dict[int, int] = field(default_factory=dict)
    seen: dict[tuple[int, int], tuple[Entry, int]] = field(default_factory=dict)
    reads: dict[int, int] = field(default_factory=dict)  # read id -> acked index when asked
    # What each node made durable and then told the others: its highest term, its vote
    # in each term -- never to be taken back, whatever its log loses.
    terms: dict[int, int] = field(default_factory=dict)
    votes: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, term) -> vote
    proposals: int = 0
    trace: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        settings = RaftSettings(
            election_ticks=6,
            heartbeat_ticks=self.rng.choice([1, 2]),
            pre_vote=self.rng.random() < 0.7,
            check_quorum=self.rng.random() < 0.7,
            max_append_entries=self.rng.choice([1, 3, 64]),
        )
        self.trace.append(str(settings))
        voters = range(1, self.size + 1)
        self.cluster = Cluster(
            voters,
            settings,
            lambda node: random.Random(self.seed * 1000 + node),
            keeps_apart=self.keeps_apart,
        )
        self.cluster.add(self.size + 1)  # may join later
        for node in self.cluster.nodes.values():
            self.node_applied[node.id] = node.disk.snapshot.index

    # -- the schedule ----------------------------------------------------------------

    def run(self, steps: int) -> None:
        names = list(self.actions)
        weights = list(self.actions.values())
        for step in range(steps):
            action = self.rng.choices(names, weights)[0]
            getattr(self, action)()
            self.trace.append(f"{step}: {action}")
            self.check()
        self.settle()

    def up(self) -> list[SimNode]:
        return [node for node in self.cluster.nodes.values() if node.core is not None]

    def cores(self) -> list[RaftNode]:
        return [node.core for node in self.cluster.nodes.values() if node.core is not None]

    def idle(self) -> list[SimNode]:
        """The nodes up with no write in flight: those that may take input."""
        return [node for node in self.up() if not node.busy]

    def leader(self) -> RaftNode | None:
        leaders = [node.up for node in self.idle() if node.up.role is Role.LEADER]
        return self.rng.choice(leaders) if leaders else None

    def tick(self) -> None:
        if idle := self.idle():
            self.rng.choice(idle).up.tick()

    def lose_leader(self) -> None:
        """A follower is told its leader is gone (its link closed): true or not --
        the leader may be alive, cut off from it alone, or just elected elsewhere."""
        followers = [node for node in self.idle() if node.up.leader is not None]
        if followers:
            node = self.rng.choice(followers)
            node.up.leader_lost()
            self.trace.append(f"{node.id} lost its leader")

    def process(self) -> None:
        ready = [node for node in self.idle() if node.up.has_ready()]
        if not ready:
            return
        node = self.rng.choice(ready)
        # Applied before the write or after its messages: the driver may do either.
        late = self.late_applies > 0 and self.rng.random() < self.late_applies
        self.cluster.start(node.id, self.on_apply, early=not late)
        if self.rng.random() < 0.5:
            self.finish(node)  # else at a later step ("sync"), others acting meanwhile

    def sync(self) -> None:
        writing = [node for node in self.up() if node.busy]
        if not writing:
            return
        node = self.rng.choice(writing)
        if self.rng.random() < 0.05:
            self.trace.append(f"crash {node.id} before fsync")
            self.crash_node(node)
            return
        self.finish(node)

    def crash_node(self, node: SimNode) -> None:
        """A crash: a write in flight may have reached the disk (and the kept hard
        state after it) or not; its early messages left either way."""
        if node.writing is not None and self.rng.random() < 0.5:
            node.disk.write(node.writing[0], kept=self.rng.random() < 0.5)
        node.crash()

    def handle(self, node: SimNode) -> None:
        self.cluster.start(node.id, self.on_apply)
        self.finish(node)

    def finish(self, node: SimNode) -> None:
        ready = self.cluster.finish(node.id, self.on_apply)
        hard = ready.hard_state
        if hard is not None:
            self.terms[node.id] = max(self.terms.get(node.id, 0), hard.term)
            if hard.vote is not None:
                vote = self.votes.setdefault((node.id, hard.term), hard.vote)
                assert vote == hard.vote, (
                    f"node {node.id} voted for {vote} and then {hard.vote} in term {hard.term}"
                )

    def deliver(self) -> None:
        flight = self.cluster.in_flight
        if not flight:
            return
        position = self.rng.randrange(len(flight))
        if self.cluster.waits(flight[position]):
            return  # its node's write is in flight: the message waits in its queue
        message = flight[position] if self.rng.random() < 0.05 else flight.pop(position)
        self.cluster.deliver(message)

    def drop(self) -> None:
        if self.cluster.in_flight:
            self.cluster.in_flight.pop(self.rng.randrange(len(self.cluster.in_flight)))

    def partition(self) -> None:
        nodes = list(self.cluster.nodes)
        self.rng.shuffle(nodes)
        cut = self.rng.randrange(1, len(nodes))
        leader = self.leader()
        if leader is not None and self.rng.random() < 0.5:
            # The leader cut off from the rest: it leads on, stale, while they elect.
            nodes.remove(leader.id)
            nodes.insert(0, leader.id)
            cut = 1
        self.cluster.cut.clear()
        self.cluster.partition(nodes[:cut], nodes[cut:])
        self.trace.append(f"partition {nodes[:cut]} | {nodes[cut:]}")

    def heal(self) -> None:
        self.cluster.cut.clear()

    def crash(self) -> None:
        if up := self.up():
            node = self.rng.choice(up)
            self.crash_node(node)
            self.trace.append(f"crash {node.id}")

    def restart(self) -> None:
        down = [node for node in self.cluster.nodes.values() if node.core is None]
        if down:
            node = self.rng.choice(down)
            self.restart_node(node)

    def restart_node(self, node: SimNode) -> None:
        node.restart()
        # The state machine comes back from the snapshot; the rest is applied again.
        self.node_applied[node.id] = node.disk.snapshot.index

    def memberships(self) -> list[Membership]:
        """The memberships in play: the committed one and each node's latest, in memory
        or on disk."""
        latest = [self.committed_membership(), *(core.membership for core in self.cores())]
        for node in self.cluster.nodes.values():
            changes = [e.membership for e in node.disk.entries if e.membership is not None]
            latest.append(changes[-1] if changes else node.disk.snapshot.membership)
        return latest

    def within_budget(self, damaged: set[int], memberships: list[Membership]) -> bool:
        """The fault model: at most a minority of any membership's voters damaged."""
        return all(
            len(damaged & members.voters) <= (len(members.voters) - 1) // 2
            for members in memberships
        )

    def damaged(self) -> set[int]:
        return {node for node in self.cluster.nodes if self.cluster.hard_state(node).repairing}

    def corrupt(self) -> None:
        damaged = self.damaged()
        victim = self.rng.choice(sorted(self.cluster.nodes))
        if victim in damaged or not self.within_budget(damaged | {victim}, self.memberships()):
            return
        node = self.cluster.nodes[victim]
        node.crash()
        disk = node.disk
        records = disk.records
        keep: int | None = None
        draw = self.rng.random()
        if draw < 0.3:
            keep = self.rng.randint(0, len(records))
        elif draw < 0.6:
            # The last records: what a node wrote lately (the entries it acknowledged
            # last, its latest vote) is what the others rely on now.
            keep = max(0, len(records) - self.rng.randint(1, 12))
        elif draw < 0.8:
            # From the record that entered its latest term on: that term and vote lost.
            term = disk.log_hard_state.term
            keep = next(
                (n for n, r in enumerate(records) if r.hard_state and r.hard_state.term >= term),
                len(records),
            )
        disk.damage(keep)
        self.trace.append(f"corrupt {victim}: keep {keep} records, log {disk.last_index}")
        self.restart_node(node)

    def compact(self) -> None:
        nodes = [n for n in self.idle() if n.up.log.applied > n.up.log.snapshot.index + 3]
        if not nodes:
            return
        node = self.rng.choice(nodes)
        index = node.up.log.applied
        snapshot = node.up.compact(index, str(index).encode())
        node.disk.compact(snapshot)

    def propose(self) -> None:
        if (leader := self.leader()) is not None:
            self.proposals += 1
            try:
                leader.propose(f"v{self.proposals}".encode())
            except RaftError:
                pass

    def read(self) -> None:
        if (leader := self.leader()) is not None:
            request = len(self.reads) + 1
            self.reads[request] = max(self.acked, default=0)
            try:
                leader.read_index(request)
            except RaftError:
                pass

    def change(self) -> None:
        leader = self.leader()
        if leader is None:
            return
        members = leader.membership
        node = self.rng.choice(sorted(self.cluster.nodes))
        if node in members.voters:
            kind = self.rng.choice([ChangeKind.REMOVE, ChangeKind.ADD_LEARNER])
            if len(members.voters) <= 2:
                return
        elif node in members.learners:
            kind = self.rng.choice([ChangeKind.ADD_VOTER, ChangeKind.REMOVE])
        else:
            kind = ChangeKind.ADD_LEARNER
        change = MembershipChange(kind, node)
        if not self.within_budget(self.damaged(), [members.changed(change)]):
            return
        try:
            leader.propose_change(change)
            self.trace.append(f"change {kind.value} {node}")
        except RaftError:
            pass

    def transfer(self) -> None:
        if (leader := self.leader()) is not None:
            try:
                leader.transfer_leadership(self.rng.choice(sorted(self.cluster.nodes)))
            except RaftError:
                pass

    # -- what is applied ------------------------------------------------------------

    def on_apply(self, node: SimNode, ready: Ready) -> None:
        core = node.up
        if ready.snapshot is not None:
            index = ready.snapshot.index
            assert ready.snapshot.data == str(index).encode() or index == 0
            known = self.applied.get(index)
            assert known is None or known.term == ready.snapshot.term, "snapshot of another log"
            self.node_applied[node.id] = index
        for entry in ready.committed:
            assert entry.index == self.node_applied[node.id] + 1, (node.id, entry)
            first = self.applied.setdefault(entry.index, entry)
            assert first == entry, f"node {node.id} applied {entry}, another {first}"
            self.node_applied[node.id] = entry.index
            if core.role is Role.LEADER:
                self.acked.setdefault(entry.index, (entry, core.term))
        for read in ready.read_states:
            assert read.index >= self.reads[read.request], (
                f"read {read.request} confirmed at {read.index}, "
                f"but {self.reads[read.request]} was acknowledged before it was asked"
            )

    # -- the invariants ----------------------------------------------------------------

    def committed_membership(self) -> Membership:
        """The membership at the highest index known committed, in memory or on disk."""
        best = (0, self.cluster.nodes[1].disk.snapshot.membership)
        for node in self.cluster.nodes.values():
            disk = node.disk
            commit = min(disk.hard_state.commit, disk.last_index)
            if commit >= best[0]:
                changes = [e for e in disk.entries if e.membership and e.index <= commit]
                best = (commit, changes[-1].membership if changes else disk.snapshot.membership)
            core = node.core
            if core is not None and core.log.committed > best[0]:
                best = (core.log.committed, core.log.membership_at(core.log.committed))
        return best[1]

    def check(self) -> None:
        for core in self.cores():
            assert core.term >= self.terms.get(core.id, 0), (
                f"node {core.id} is back at term {core.term} after {self.terms[core.id]}"
            )
            if core.role is Role.LEADER:
                leader = self.leaders.setdefault(core.term, core.id)
                assert leader == core.id, f"two leaders in term {core.term}: {leader}, {core.id}"
                self.check_complete(core)
            log = core.log
            self.check_matching(log.snapshot.term, log.entries(log.first_index, log.last_index))
        for node in self.cluster.nodes.values():
            self.check_matching(node.disk.snapshot.term, node.disk.entries)
        self.check_durable()

    def check_matching(self, base_term: int, entries: tuple[Entry, ...] | list[Entry]) -> None:
        """Log matching by induction: an (index, term) names one entry and one
        predecessor's term, wherever it is seen."""
        prev_term = base_term
        for entry in entries:
            seen = self.seen.setdefault((entry.index, entry.term), (entry, prev_term))
            assert seen == (entry, prev_term), f"logs disagree at {entry} (seen {seen})"
            prev_term = entry.term

    def check_complete(self, leader: RaftNode) -> None:
        log = leader.log
        for index, (entry, term) in self.acked.items():
            if term <= leader.term and index > log.snapshot.index:
                assert log.term(index) == entry.term, (
                    f"leader {leader.id} of term {leader.term} lacks acknowledged {entry}"
                )

    def check_durable(self) -> None:
        membership = self.committed_membership()
        healthy = [
            self.cluster.nodes[v].disk
            for v in membership.voters
            if not self.cluster.hard_state(v).repairing
        ]
        floor = min((disk.snapshot.index for disk in healthy), default=0)
        for index, (entry, _) in self.acked.items():
            if index <= floor:
                continue
            lacking = sum(1 for disk in healthy if not disk.holds(entry))
            assert lacking < membership.quorum, (
                f"acknowledged {entry} is missing from {lacking} healthy voters of "
                f"{membership}: a majority could elect a leader without it"
            )

    # -- the end ---------------------------------------------------------------------

    def settle(self) -> None:
        """No more faults: heal, restart, and let the group converge."""
        self.cluster.cut.clear()
        for node in self.cluster.nodes.values():
            if node.core is None:
                self.restart_node(node)
            elif node.busy:
                self.finish(node)
        final: tuple[int, int] | None = None  # (term, index) of the last proposal
        for _ in range(20_000):
            if any(node.up.has_ready() for node in self.up()):
                self.handle(self.rng.choice([n for n in self.up() if n.up.has_ready()]))
            elif self.cluster.in_flight:
                self.cluster.deliver(self.cluster.in_flight.pop(0))
            else:
                for core in self.cores():
                    core.tick()
            self.check()
            leader = self.leader()
            if leader is not None and (final is None or final[0] < leader.term):
                # None yet, or its leader was deposed before it was acknowledged.
                try:
                    final = (leader.term, leader.propose(b"final"))
                except RaftError:
                    continue
            if final is not None and self.converged(final[1]):
                return
        raise AssertionError(f"no convergence after the faults stopped (final={final})")

    def converged(self, final: int) -> bool:
        if final not in self.acked or self.acked[final][0].data != b"final":
            return False
        membership = self.committed_membership()
        for member in membership.members:
            node = self.cluster.nodes[member]
            if node.disk.hard_state.repairing or self.node_applied[member] < final:
                return False
            if not all(node.disk.holds(entry) for entry, _ in self.acked.values()):
                return False
        return True


def simulate(
    size: int, seed: int, steps: int, actions: dict[str, float] | None = None
) -> Simulation:
    simulation = Simulation(seed, size, actions=dict(actions or ACTIONS))
    try:
        simulation.run(steps)
    except AssertionError as error:
        tail = "\n".join(simulation.trace[-25:])
        raise AssertionError(f"size {size} seed {seed}: {error}\n{tail}") from error
    return simulation


@pytest.mark.parametrize(("size", "seed"), CASES, ids=[f"size{s}-seed{n}" for s, n in CASES])
def test_the_invariants_hold_under_faults(size: int, seed: int) -> None:
    simulation = simulate(size, seed, STEPS)
    assert simulation.acked  # the run committed something, so the checks checked


@pytest.mark.parametrize(
    ("size", "seed"), STALE_CASES, ids=[f"stale-size{s}-seed{n}" for s, n in STALE_CASES]
)
def test_the_invariants_hold_with_stale_leaders(size: int, seed: int) -> None:
    simulate(size, seed, STEPS, STALE_LEADERS)


def test_a_hard_state_lost_with_the_log_is_found() -> None:
    """The simulation's power, shown on a driver that breaks the contract: with no hard
    state kept apart, damage takes a node back to an older term (and may undo its
    vote), and some seed of the first forty shows it."""
    failure = "no seed lost a term with the log"
    for seed in range(40):
        # The schedule as it was when this was found (seed 16): no word of lost leaders,
        # every Ready applied before its write.
        actions = {**STALE_LEADERS, "lose_leader": 0}
        simulation = Simulation(seed, 3, keeps_apart=False, actions=actions, late_applies=0)
        try:
            simulation.run(STEPS)
        except AssertionError as error:
            failure = str(error)
            break
    assert "is back at term" in failure or "voted for" in failure, failure


SOAK = int(os.environ.get("MESHBUS_RAFT_SOAK", "0"))


@pytest.mark.slow
@pytest.mark.timeout(0)  # as long as the seeds asked for take (the suite's 120 s is not)
@pytest.mark.skipif(not SOAK, reason="a long soak: MESHBUS_RAFT_SOAK=<seeds> runs it")
@pytest.mark.parametrize("size", [3, 5])
def test_soak(size: int) -> None:
    """MESHBUS_RAFT_SOAK=500 pytest -m slow tests/unit/raft: many more seeds, each ten
    times longer, past the seeds the quick run covers."""
    for seed in range(1000, 1000 + SOAK):
        simulate(size, seed, STEPS * 5)
        simulate(size, seed, STEPS * 5, STALE_LEADERS)
