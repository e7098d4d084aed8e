"""A driver for the Raft core in one process: a disk per node, a network of queued
messages with cuts, and nodes that crash and restart -- what the interaction tests
(test_interaction.py) script by hand and the simulation (test_simulation.py) draws
at random. It follows the driver's contract of docs/raft.md to the letter, the
freedom it gives too: a Ready is started (its early messages sent, its committed
entries applied) and its write finished apart, so other nodes act while the write is
in flight, and a crash then loses it after those messages left."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from meshbus.raft import (
    Entry,
    HardState,
    Membership,
    Message,
    RaftNode,
    RaftSettings,
    Randomness,
    Ready,
    Snapshot,
    Stored,
    bootstrap,
    empty,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One write to the log: a Ready's hard state, snapshot and entries, or (with
    ``compacted``) the node's own compaction into ``snapshot``."""

    hard_state: HardState | None
    snapshot: Snapshot | None
    entries: tuple[Entry, ...]
    compacted: bool = False


class Disk:
    """What one node has fsynced, shaped like the broker's (meshbus.storage.raftlog):
    a log of records, one per Ready (all of it or none), and the hard state but its
    commit index -- term, vote, epoch, repairing -- kept apart, in a file of its own
    written after the record (docs/raft.md, "The driver's contract").

    Damage to the log (``damage``) drops a record and every record after it, the hard
    states they held with them; the kept hard state is intact. ``keeps_apart=False``
    is a driver without that file: the log's last intact record says what the hard
    state was (what the simulation shows unsafe, docs/raft.md, "Corruption")."""

    def __init__(self, stored: Stored, keeps_apart: bool = True) -> None:
        self.keeps_apart = keeps_apart
        self.base = stored  # what the log held before its first record
        self.records: list[Record] = []
        self.kept = stored.hard_state  # the file of its own (its commit is not read)
        self._replay()

    def write(self, ready: Ready, kept: bool = True) -> None:
        """``ready`` as one record; ``kept=False``: a crash came after the record and
        before the kept hard state was written."""
        self._add(Record(ready.hard_state, ready.snapshot, ready.entries))
        if kept and ready.hard_state is not None:
            self.kept = ready.hard_state
        self._read_back()

    def compact(self, snapshot: Snapshot) -> None:
        self._add(Record(None, snapshot, (), compacted=True))

    def stored(self) -> Stored:
        return Stored(self.hard_state, self.snapshot, tuple(self.entries))

    def _read_back(self) -> None:
        """``hard_state``: what a restart reads back, the kept one with the log's commit."""
        if self.keeps_apart:
            self.hard_state = dataclasses.replace(self.kept, commit=self.log_hard_state.commit)
        else:
            self.hard_state = self.log_hard_state

    @property
    def last_index(self) -> int:
        return self.snapshot.index + len(self.entries)

    def holds(self, entry: Entry) -> bool:
        """Whether this disk has ``entry`` (a committed one: a snapshot past it has it)."""
        if entry.index <= self.snapshot.index:
            return True
        if entry.index > self.last_index:
            return False
        return self.entries[entry.index - self.snapshot.index - 1] == entry

    def damage(self, records: int | None) -> None:
        """The log's record at position ``records`` fails its checksum: it and every
        record after it are dropped (None: the whole log is unreadable, snapshot
        included). The node restarts repairing, in a new epoch (docs/raft.md,
        "Corruption"), which is written before it restarts."""
        if records is None:
            self.base = Stored(HardState(), Snapshot(0, 0, Membership()))
            records = 0
        del self.records[records:]
        self._replay()
        old = self.hard_state
        new = dataclasses.replace(
            old, commit=min(old.commit, self.last_index), epoch=old.epoch + 1, repairing=True
        )
        if self.keeps_apart:
            self.kept = new
        else:
            self._add(Record(new, None, ()))
        self._read_back()

    def damage_after(self, index: int | None) -> None:
        """The first record that wrote past ``index`` is damaged (None: all of them)."""
        if index is None or any(e.index > index for e in self.base.entries):
            self.damage(None)
            return
        position = next(
            (
                n
                for n, record in enumerate(self.records)
                if any(e.index > index for e in record.entries)
                or (record.snapshot is not None and record.snapshot.index > index)
            ),
            len(self.records),
        )
        self.damage(position)

    def damage_from_term(self, term: int) -> None:
        """The first record of ``term`` (or of a later one) is damaged: what the node
        did in that term on -- its vote, its entries -- is gone from the log."""
        position = next(
            (
                n
                for n, record in enumerate(self.records)
                if record.hard_state is not None and record.hard_state.term >= term
            ),
            len(self.records),
        )
        self.damage(position)

    def _add(self, record: Record) -> None:
        self.records.append(record)
        self._apply(record)

    def _replay(self) -> None:
        self.log_hard_state = self.base.hard_state
        self.snapshot = self.base.snapshot
        self.entries = list(self.base.entries)
        for record in self.records:
            self._apply(record)
        self._read_back()

    def _apply(self, record: Record) -> None:
        snapshot = record.snapshot
        if snapshot is not None:
            del self.entries[: snapshot.index - self.snapshot.index if record.compacted else None]
            self.snapshot = snapshot
        if record.entries:
            del self.entries[record.entries[0].index - self.snapshot.index - 1 :]
            self.entries.extend(record.entries)
        if record.hard_state is not None:
            self.log_hard_state = record.hard_state


OnApply = Callable[["SimNode", Ready], None]


class SimNode:
    def __init__(
        self,
        node_id: int,
        settings: RaftSettings,
        stored: Stored,
        randomness: Randomness,
        keeps_apart: bool = True,
    ) -> None:
        self.id = node_id
        self.settings = settings
        self.randomness = randomness
        self.disk = Disk(stored, keeps_apart)
        self.core: RaftNode | None = None
        # The Ready whose write is in flight (started, not finished), and whether it
        # was applied at its start.
        self.writing: tuple[Ready, bool] | None = None
        self.restart()

    def restart(self) -> None:
        self.core = RaftNode(self.id, self.settings, self.disk.stored(), self.randomness)

    def crash(self) -> None:
        """Gone: all it held in memory, and every write not yet fsynced."""
        self.core = None
        self.writing = None

    @property
    def busy(self) -> bool:
        """A write is in flight: the node takes nothing until it is finished (the
        driver keeps what comes meanwhile in its queue)."""
        return self.writing is not None

    @property
    def up(self) -> RaftNode:
        assert self.core is not None, f"node {self.id} is down"
        return self.core


class Cluster:
    """Nodes, and the messages between them in flight (in the order sent)."""

    def __init__(
        self,
        voters: Iterable[int],
        settings: RaftSettings,
        randomness: Callable[[int], Randomness],
        learners: Iterable[int] = (),
        keeps_apart: bool = True,
    ) -> None:
        """``keeps_apart=False``: the nodes' disks keep no hard state apart from the
        log (Disk)."""
        founding = bootstrap(Membership.of(voters, learners))
        self.settings = settings
        self.randomness = randomness
        self.keeps_apart = keeps_apart
        self.nodes = {
            node: SimNode(node, settings, founding, randomness(node), keeps_apart)
            for node in sorted(founding.entries[0].membership.members)  # type: ignore[union-attr]
        }
        self.in_flight: list[Message] = []
        self.cut: set[frozenset[int]] = set()

    def add(self, node: int) -> SimNode:
        """A new, empty node: it waits for a leader to send it the log."""
        self.nodes[node] = SimNode(
            node, self.settings, empty(), self.randomness(node), self.keeps_apart
        )
        return self.nodes[node]

    def process(self, node: int, on_apply: OnApply | None = None) -> Ready:
        """One Ready of ``node``, handled as docs/raft.md says, its write at once."""
        self.start(node, on_apply)
        return self.finish(node, on_apply)

    def start(self, node: int, on_apply: OnApply | None = None, early: bool = True) -> Ready:
        """Take ``node``'s Ready and do what may precede its write's fsync: send its
        early messages, apply it (unless it installs a snapshot, or not ``early``: the
        driver may apply after the messages, as broker followers do). The write is then
        in flight until ``finish`` (a crash before loses it)."""
        sim = self.nodes[node]
        ready = sim.up.ready()
        self.in_flight.extend(ready.early_messages)
        applied = early and ready.snapshot is None
        if applied and on_apply is not None:
            on_apply(sim, ready)
        sim.writing = (ready, applied)
        return ready

    def finish(self, node: int, on_apply: OnApply | None = None) -> Ready:
        """The write in flight is durable: send the other messages, apply (if not at
        the start), advance."""
        sim = self.nodes[node]
        assert sim.writing is not None, f"node {node} has no write in flight"
        ready, applied = sim.writing
        sim.writing = None
        sim.disk.write(ready)
        self.in_flight.extend(ready.messages)
        if not applied and on_apply is not None:
            on_apply(sim, ready)
        sim.up.advance()
        return ready

    def connected(self, a: int, b: int) -> bool:
        return frozenset((a, b)) not in self.cut

    def waits(self, message: Message) -> bool:
        """Whether ``message`` must wait: its node has a write in flight."""
        target = self.nodes.get(message.to)
        return target is not None and target.busy

    def deliver(self, message: Message) -> bool:
        """Step ``message`` into its node; False if it was lost (cut, or node down).
        Not for a message that ``waits``."""
        target = self.nodes.get(message.to)
        if target is None or target.core is None or not self.connected(message.sender, message.to):
            return False
        assert not target.busy, f"{message}: node {message.to} has a write in flight"
        target.core.step(message)
        return True

    def partition(self, *groups: Iterable[int]) -> None:
        sets = [set(group) for group in groups]
        for i, one in enumerate(sets):
            for other in sets[i + 1 :]:
                self.cut.update(frozenset((a, b)) for a in one for b in other)

    def hard_state(self, node: int) -> HardState:
        return self.nodes[node].disk.hard_state
