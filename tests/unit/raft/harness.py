"""A driver for the Raft core in one process: a disk per node, a network of queued
messages with cuts, and nodes that crash and restart -- what the interaction tests
(test_interaction.py) script by hand and the simulation (test_simulation.py) draws
at random. It follows the driver's contract of docs/raft.md to the letter."""

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


class Disk:
    """What one node has fsynced. A Ready is written as one record: all of it or none."""

    def __init__(self, stored: Stored) -> None:
        self.hard_state = stored.hard_state
        self.snapshot = stored.snapshot
        self.entries = list(stored.entries)

    def write(self, ready: Ready) -> None:
        if ready.snapshot is not None:
            self.snapshot = ready.snapshot
            self.entries = []
        if ready.entries:
            del self.entries[ready.entries[0].index - self.snapshot.index - 1 :]
            self.entries.extend(ready.entries)
        if ready.hard_state is not None:
            self.hard_state = ready.hard_state

    def compact(self, snapshot: Snapshot) -> None:
        del self.entries[: snapshot.index - self.snapshot.index]
        self.snapshot = snapshot

    def stored(self) -> Stored:
        return Stored(self.hard_state, self.snapshot, tuple(self.entries))

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

    def damage(self, keep: int | None) -> None:
        """Entries after ``keep`` fail their checksums and are cut off (None: nothing
        is readable, the snapshot neither). The term and vote are intact (docs/raft.md,
        "Corruption"): the node restarts repairing, in a new epoch."""
        if keep is None:
            self.snapshot = Snapshot(0, 0, Membership())
            self.entries = []
        else:
            del self.entries[keep - self.snapshot.index :]
        self.hard_state = dataclasses.replace(
            self.hard_state,
            commit=min(self.hard_state.commit, self.last_index),
            epoch=self.hard_state.epoch + 1,
            repairing=True,
        )


class SimNode:
    def __init__(
        self, node_id: int, settings: RaftSettings, stored: Stored, randomness: Randomness
    ) -> None:
        self.id = node_id
        self.settings = settings
        self.randomness = randomness
        self.disk = Disk(stored)
        self.core: RaftNode | None = None
        self.restart()

    def restart(self) -> None:
        self.core = RaftNode(self.id, self.settings, self.disk.stored(), self.randomness)

    def crash(self) -> None:
        """Gone: all it held in memory, and every write not yet fsynced."""
        self.core = None

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
    ) -> None:
        founding = bootstrap(Membership.of(voters, learners))
        self.settings = settings
        self.randomness = randomness
        self.nodes = {
            node: SimNode(node, settings, founding, randomness(node))
            for node in sorted(founding.entries[0].membership.members)  # type: ignore[union-attr]
        }
        self.in_flight: list[Message] = []
        self.cut: set[frozenset[int]] = set()

    def add(self, node: int) -> SimNode:
        """A new, empty node: it waits for a leader to send it the log."""
        self.nodes[node] = SimNode(node, self.settings, empty(), self.randomness(node))
        return self.nodes[node]

    def process(self, node: int, on_apply: Callable[[SimNode, Ready], None] | None = None) -> Ready:
        """One Ready of ``node``, handled as docs/raft.md says: durable, then sent,
        then applied, then advanced."""
        sim = self.nodes[node]
        core = sim.up
        ready = core.ready()
        sim.disk.write(ready)
        self.in_flight.extend(ready.messages)
        if on_apply is not None:
            on_apply(sim, ready)
        core.advance()
        return ready

    def connected(self, a: int, b: int) -> bool:
        return frozenset((a, b)) not in self.cut

    def deliver(self, message: Message) -> bool:
        """Step ``message`` into its node; False if it was lost (cut, or node down)."""
        target = self.nodes.get(message.to)
        if target is None or target.core is None or not self.connected(message.sender, message.to):
            return False
        target.core.step(message)
        return True

    def partition(self, *groups: Iterable[int]) -> None:
        sets = [set(group) for group in groups]
        for i, one in enumerate(sets):
            for other in sets[i + 1 :]:
                self.cut.update(frozenset((a, b)) for a in one for b in other)

    def hard_state(self, node: int) -> HardState:
        return self.nodes[node].disk.hard_state
