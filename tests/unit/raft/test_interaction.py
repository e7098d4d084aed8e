"""Interaction tests of the Raft core, written as scripts in testdata/*.txt in the
manner of etcd's raft testdata (cockroachdb's datadriven): a command, ``----``, and
the output it must print. The harness (harness.py) is the driver; election timeouts
are not randomized here (each is ``election`` ticks), so a script says exactly when a
node campaigns.

    MESHBUS_REWRITE_TESTDATA=1 pytest tests/unit/raft/test_interaction.py

writes the outputs the core prints now into the files: read the diff before
committing it, since that is the review of the change.

The commands (``N`` a node id):

    cluster voters=1,2,3 [learners=4] [prevote=false] [checkquorum=false]
            [election=10] [heartbeat=1] [max-append=64] [stagger=true]
            [keeps-apart=false]   (the disks keep no hard state apart from the log)
    add-node N                a new, empty node (it waits for the leader)
    campaign N | tick N [count] | propose N data | change N add-voter|add-learner|remove M
    transfer N M | read N request-id | compact N index
    process N...              handle each node's Ready: early sends, durable, send,
                              apply, advance
    start N                   take N's Ready: send its early messages, apply it (no
                              snapshot); its write is in flight (a crash loses it)
    finish N                  that write is durable: send the rest, advance
    deliver [N...]            step the messages in flight to those nodes (all: none named)
    drop [N...]               lose the messages in flight to those nodes
    stabilize [quiet]         process and deliver until nothing is left to do
    partition 1 2 | 3         cut the network between the groups; heal
    crash N | restart N       lose what is not durable; start from the disk
    damage N keep=I|term=T|wipe   crash, the log's records lost from the first that
                              wrote past I (or was of term T or later; or all),
                              restart repairing
    status [N...] | log N
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from meshbus.raft import (
    ChangeKind,
    MembershipChange,
    RaftError,
    RaftSettings,
    Ready,
    Role,
)
from meshbus.raft.messages import describe_entry, describe_snapshot
from tests.unit.raft.harness import Cluster

TESTDATA = Path(__file__).parent / "testdata"
REWRITE = os.environ.get("MESHBUS_REWRITE_TESTDATA") == "1"


class Fixed:
    """Election timeouts without chance: the shortest, plus ``offset`` ticks."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def randrange(self, start: int, stop: int, /) -> int:
        return min(start + self.offset, stop - 1)


class Script:
    def __init__(self) -> None:
        self.cluster: Cluster | None = None

    @property
    def c(self) -> Cluster:
        assert self.cluster is not None, "start with: cluster voters=..."
        return self.cluster

    def run(self, line: str) -> list[str]:
        words = shlex.split(line)
        handler: Callable[[list[str]], list[str]] = getattr(
            self, "do_" + words[0].replace("-", "_")
        )
        try:
            return handler(words[1:])
        except RaftError as error:
            return [f"{type(error).__name__}: {error}"]

    # -- commands ------------------------------------------------------------------------

    def do_cluster(self, args: list[str]) -> list[str]:
        options = dict(arg.split("=", 1) for arg in args)
        settings = RaftSettings(
            election_ticks=int(options.get("election", 10)),
            heartbeat_ticks=int(options.get("heartbeat", 1)),
            pre_vote=options.get("prevote", "true") == "true",
            check_quorum=options.get("checkquorum", "true") == "true",
            max_append_entries=int(options.get("max-append", 64)),
        )
        voters = [int(v) for v in options["voters"].split(",")]
        learners = [int(v) for v in options["learners"].split(",")] if "learners" in options else []
        stagger = options.get("stagger") == "true"  # node N times out N-1 ticks later
        self.cluster = Cluster(
            voters,
            settings,
            lambda node: Fixed(node - 1 if stagger else 0),
            learners,
            keeps_apart=options.get("keeps-apart", "true") == "true",
        )
        return ["ok"]

    def do_add_node(self, args: list[str]) -> list[str]:
        self.c.add(int(args[0]))
        return ["ok"]

    def do_campaign(self, args: list[str]) -> list[str]:
        self.c.nodes[int(args[0])].up.campaign()
        return ["ok"]

    def do_tick(self, args: list[str]) -> list[str]:
        core = self.c.nodes[int(args[0])].up
        for _ in range(int(args[1]) if len(args) > 1 else 1):
            core.tick()
        return ["ok"]

    def do_propose(self, args: list[str]) -> list[str]:
        return [f"index {self.c.nodes[int(args[0])].up.propose(args[1].encode())}"]

    def do_change(self, args: list[str]) -> list[str]:
        change = MembershipChange(ChangeKind(args[1]), int(args[2]))
        return [f"index {self.c.nodes[int(args[0])].up.propose_change(change)}"]

    def do_transfer(self, args: list[str]) -> list[str]:
        self.c.nodes[int(args[0])].up.transfer_leadership(int(args[1]))
        return ["ok"]

    def do_read(self, args: list[str]) -> list[str]:
        self.c.nodes[int(args[0])].up.read_index(int(args[1]))
        return ["ok"]

    def do_compact(self, args: list[str]) -> list[str]:
        node = self.c.nodes[int(args[0])]
        snapshot = node.up.compact(int(args[1]), f"state@{args[1]}".encode())
        node.disk.compact(snapshot)
        return [f"snapshot {describe_snapshot(snapshot)}"]

    def do_process(self, args: list[str]) -> list[str]:
        lines: list[str] = []
        for node in map(int, args):
            lines += self.ready_lines(node, self.c.process(node))
        return lines or ["ok"]

    def do_start(self, args: list[str]) -> list[str]:
        node = int(args[0])
        ready = self.c.start(node)
        lines = [f"{node}: send early {m}" for m in ready.early_messages]
        if ready.snapshot is None:
            lines += self.applied_lines(node, ready)
        return lines or ["ok"]

    def do_finish(self, args: list[str]) -> list[str]:
        node = int(args[0])
        ready = self.c.finish(node)
        lines = self.persisted_lines(node, ready)
        lines += [f"{node}: send {m}" for m in ready.messages]
        if ready.snapshot is not None:
            lines += self.applied_lines(node, ready)
        return lines or ["ok"]

    def do_deliver(self, args: list[str]) -> list[str]:
        lines = []
        for message in self.take(args):
            lost = "" if self.c.deliver(message) else "  (lost)"
            lines.append(f"{message}{lost}")
        return lines or ["ok"]

    def do_drop(self, args: list[str]) -> list[str]:
        return [f"dropped {message}" for message in self.take(args)] or ["ok"]

    def do_stabilize(self, args: list[str]) -> list[str]:
        lines: list[str] = []
        while True:
            ready = [
                n
                for n, node in sorted(self.c.nodes.items())
                if node.core and not node.busy and node.up.has_ready()
            ]
            for node in ready:
                lines += self.ready_lines(node, self.c.process(node))
            if not ready and not self.c.in_flight:
                break
            for line in self.do_deliver([]):
                if line != "ok":
                    lines.append(f"deliver {line}")
        return ["ok"] if args == ["quiet"] or not lines else lines

    def do_partition(self, args: list[str]) -> list[str]:
        text = " ".join(args)
        self.c.partition(*([int(n) for n in group.split()] for group in text.split("|")))
        return ["ok"]

    def do_heal(self, args: list[str]) -> list[str]:
        self.c.cut.clear()
        return ["ok"]

    def do_crash(self, args: list[str]) -> list[str]:
        self.c.nodes[int(args[0])].crash()
        return ["ok"]

    def do_restart(self, args: list[str]) -> list[str]:
        self.c.nodes[int(args[0])].restart()
        return self.do_status(args[:1])

    def do_damage(self, args: list[str]) -> list[str]:
        node = self.c.nodes[int(args[0])]
        node.crash()
        how, _, at = args[1].partition("=")
        if how == "wipe":
            node.disk.damage(None)
        elif how == "term":
            node.disk.damage_from_term(int(at))
        else:
            node.disk.damage_after(int(at))
        node.restart()
        return self.do_status(args[:1])

    def do_status(self, args: list[str]) -> list[str]:
        lines = []
        for n in map(int, args or sorted(self.c.nodes)):
            core = self.c.nodes[n].core
            if core is None:
                lines.append(f"{n}: down")
                continue
            log = core.log
            line = (
                f"{n}: {core.role.value} term={core.term} leader={core.leader} "
                f"last={log.last_term}/{log.last_index} commit={log.committed} "
                f"applied={log.applied} {core.membership}"
            )
            if core.repairing:
                line += f" repairing epoch={core.epoch}"
            lines.append(line)
            if core.role is Role.LEADER:
                for peer, progress in sorted(core.progress.items()):
                    lines.append(
                        f"  {peer}: match={progress.match} next={progress.next} "
                        f"{progress.mode.value}" + (" active" if progress.recent_active else "")
                    )
        return lines

    def do_log(self, args: list[str]) -> list[str]:
        log = self.c.nodes[int(args[0])].up.log
        lines = [f"snapshot {describe_snapshot(log.snapshot)}"]
        lines += [describe_entry(e) for e in log.entries(log.first_index, log.last_index)]
        return lines

    # -- helpers ---------------------------------------------------------------------------

    def take(self, args: list[str]) -> list:  # type: ignore[type-arg]
        targets = {int(a) for a in args} or set(self.c.nodes)
        targets = {n for n in targets if n not in self.c.nodes or not self.c.nodes[n].busy}
        taken = [m for m in self.c.in_flight if m.to in targets]
        self.c.in_flight = [m for m in self.c.in_flight if m.to not in targets]
        return taken

    def ready_lines(self, node: int, ready: Ready) -> list[str]:
        lines = [f"{node}: send early {m}" for m in ready.early_messages]
        lines += self.persisted_lines(node, ready)
        lines += [f"{node}: send {m}" for m in ready.messages]
        return lines + self.applied_lines(node, ready)

    def persisted_lines(self, node: int, ready: Ready) -> list[str]:
        lines = []
        if ready.hard_state is not None:
            hard = ready.hard_state
            text = f"{node}: persist term={hard.term} vote={hard.vote} commit={hard.commit}"
            if hard.epoch or hard.repairing:
                text += f" epoch={hard.epoch} repairing={hard.repairing}"
            lines.append(text)
        if ready.snapshot is not None:
            lines.append(f"{node}: install snapshot {describe_snapshot(ready.snapshot)}")
        lines += [f"{node}: persist {describe_entry(e)}" for e in ready.entries]
        if lines and not ready.must_sync:
            lines.append(f"{node}: (no fsync: the commit index alone)")
        return lines

    def applied_lines(self, node: int, ready: Ready) -> list[str]:
        lines = [f"{node}: apply {describe_entry(e)}" for e in ready.committed]
        lines += [f"{node}: read {r.request} at {r.index}" for r in ready.read_states]
        return lines


def parse(path: Path) -> list[tuple[str, list[str] | None]]:
    """The file as (line, None) for comments and blank lines, (command, expected)."""
    items: list[tuple[str, list[str] | None]] = []
    lines = path.read_text().splitlines()
    position = 0
    while position < len(lines):
        line = lines[position]
        position += 1
        if not line.strip() or line.startswith("#"):
            items.append((line, None))
            continue
        assert lines[position] == "----", f"{path.name}:{position}: '----' after a command"
        position += 1
        expected = []
        while position < len(lines) and lines[position].strip():
            expected.append(lines[position])
            position += 1
        items.append((line, expected))
    return items


@pytest.mark.parametrize("path", sorted(TESTDATA.glob("*.txt")), ids=lambda p: p.stem)
def test_interaction(path: Path) -> None:
    script = Script()
    written: list[str] = []
    for line, expected in parse(path):
        if expected is None:
            written.append(line)
            continue
        actual = script.run(line)
        written += [line, "----", *actual]
        if not REWRITE:
            assert actual == expected, f"{path.name}: {line}\n" + "\n".join(actual)
    if REWRITE:
        path.write_text("\n".join(written) + "\n")
