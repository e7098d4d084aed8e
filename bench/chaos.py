"""`python -m bench chaos`: reliable sends and message groups while the mesh is shaken.

A mesh of 3 broker processes (each with its own --data-dir), one sender and one
receiver connector on each, every connector given the whole broker list so it can
fail over. The senders send COUNT reliable unicast messages, each to a receiver on
another broker, and GROUPS message groups of GROUP-SIZE messages to an anycast
address every receiver is a member of (the last one final); the groups run
interleaved with the unicast traffic from start to end, so every group lives through
every event. While the traffic runs:

* at 20% of the sends, broker A is killed (kill -9) and restarted on its port and
  data dir, joining through C;
* at 32%, broker C is paused (SIGSTOP) for ``PAUSE`` seconds, twice the heartbeat
  budget, then resumed: its peers declare it dead meanwhile, and the mesh must heal;
* at 42%, the link between A and B is cut for ``--cut`` seconds (3 by default) while
  both still reach C (every broker is behind a TCP gate, bench.gate, that the others
  dial), then works again, and the mesh must heal. The cut is longer than the heartbeat
  budget (A and B drop each other); however long it is, a group whose member is out of
  reach from its sender stays with that member, since C still names its broker
  (docs/mesh.md, "One group, one member"): the sender's messages wait for the link.
  ``healed_s``: the longer of the two heals, from SIGCONT or from the link working
  again until every broker links to every other. With ``--isolate`` B is cut off from
  A and C both: to each side the other looks crashed, and only ``--partition-handling
  pause-minority`` keeps a group from being processed on both sides;
* at 55%, broker B gets SIGTERM: it drains (its connectors move away), then exits;
* at 72%, a 4th broker D joins through C, and the mesh rebalances onto it.

The senders pause at each of those marks until its event has begun (for the join: until
D is ready, so the rest of the traffic meets the rebalance), so the events always fall
inside the traffic however fast it runs. Then every sender waits for all
its sends to be acknowledged, and the receivers are drained.

Every payload carries (id, sender, group, seq), and the receiving application counts:
lost -- ids sent (``send`` returned) never received; duplicated -- ids received more
than once; out_of_order -- group messages received below a seq already received from
that (sender, group); two_members -- groups of which one message reached two
members (processed twice: what a paused member's broker can cause). A send that
raised is not counted as sent: the application was told; such errors are shown in
the table.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import click

import meshbus
from bench.brokers import MeshbusProcess, MeshbusProcesses
from bench.gate import BrokerGate
from bench.harness import CheckFailed, close_all, run_on_brokers
from bench.report import new_table, print_tables
from meshbus.cli.broker import PARTITION_HANDLING

PAYLOAD = struct.Struct(">IHHI")  # id, sender, group (NO_GROUP for unicast), seq
NO_GROUP = 0xFFFF
_POOL = meshbus.Anycast("chaos")
_CONNECTORS_PER_KIND = 3  # senders, and receivers: one of each per founding broker
# The share of the sends at which each event begins: kill, pause, partition, drain, join.
_MARKS = (0.20, 0.32, 0.42, 0.55, 0.72)
PAUSE = 3.0  # seconds broker C stays stopped: twice the default 1.5 s heartbeat budget
# Give-up bounds: far above anything healthy, they only turn a hang into a clear result.
_STEP_LIMIT = 30.0  # a broker starting, forming the mesh, draining
_ACK_LIMIT = 120.0  # every send acknowledged (or given up: ~15 s after its first attempt)
_QUIET = 3.0  # no new message for this long, after the acks: the receivers are drained
_PROGRESS_EVERY = 2.0

Send = tuple[int, meshbus.Address, int, int, bool]  # id, unicast dst, group, seq, final


@dataclass
class Mark:
    """A share of the sends at which an event begins; the senders wait there until it has."""

    at: int
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    begun: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Traffic:
    """The senders' shared state: how far they are, and the marks they wait at."""

    total: int
    sent_ids: bytearray = field(init=False)
    attempted: int = 0
    sent: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    given_up: int = 0
    marks: list[Mark] = field(init=False)

    def __post_init__(self) -> None:
        self.sent_ids = bytearray(self.total)
        self.marks = [Mark(int(self.total * share)) for share in _MARKS]

    async def admit(self) -> None:
        """Wait while the senders stand at a mark whose event has not begun."""
        for mark in self.marks:
            if self.attempted < mark.at:
                return
            if not mark.begun.is_set():
                mark.reached.set()
                await mark.begun.wait()


class Tally:
    """The receiving application: per id how often it arrived, per group the order."""

    def __init__(self, total: int) -> None:
        self.counts = bytearray(total)
        self.received = 0  # distinct ids
        self.last_at = time.perf_counter()
        self.out_of_order = 0
        self._last_seq: dict[tuple[int, int], int] = {}
        self._holder: dict[tuple[int, int], str] = {}
        self.switches = 0  # a group's next message came to another member
        self.unflagged = 0  # ... without group_reassigned set on it
        self._member_of: dict[int, str] = {}  # group message id -> the member it reached
        self.two_members: set[tuple[int, int]] = set()  # (sender, group)

    def listener(self, member: str) -> Callable[[meshbus.Message], None]:
        def on_message(message: meshbus.Message) -> None:
            msg_id, sender, group, seq = PAYLOAD.unpack_from(message.payload)
            seen = self.counts[msg_id]
            self.counts[msg_id] = min(seen + 1, 255)
            self.last_at = time.perf_counter()
            if group != NO_GROUP and self._member_of.setdefault(msg_id, member) != member:
                self.two_members.add((sender, group))
            if seen:
                return  # a duplicate: counted once, in duplicated, not in the order
            self.received += 1
            if group == NO_GROUP:
                return
            key = (sender, group)
            if seq < self._last_seq.get(key, 0):
                self.out_of_order += 1
            else:
                self._last_seq[key] = seq
            held = self._holder.get(key)
            if held is not None and held != member:
                self.switches += 1
                self.unflagged += not message.group_reassigned
            self._holder[key] = member

        return on_message


class Timeline:
    """The events, timed from the start of the traffic, echoed on stderr as they happen."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.rows: list[tuple[float, str, str]] = []
        self.healed_s = -1.0  # the longer heal, after the pause or the cut; -1: not measured

    def now(self) -> float:
        return time.perf_counter() - self.began

    def add(self, event: str, detail: str = "") -> None:
        self.rows.append((self.now(), event, detail))
        click.echo(f"chaos t={self.now():6.1f} s  {event} {detail}".rstrip(), err=True)


def plan_sends(
    count: int, groups: int, group_size: int, receivers: Sequence[meshbus.Address]
) -> list[list[Send]]:
    """Per sender, its sends in order: unicast to the receivers on other brokers in turn,
    and the group messages of its groups round robin, spread evenly among them."""
    plans = []
    n = _CONNECTORS_PER_KIND
    for s in range(n):
        unicast = [
            (msg_id, receivers[(s + 1 + k % (n - 1)) % n], NO_GROUP, 0, False)
            for k, msg_id in enumerate(range(s, count, n))
        ]
        own = range(s, groups, n)
        grouped = [
            (count + g * group_size + seq - 1, receivers[0], g, seq, seq == group_size)
            for seq in range(1, group_size + 1)
            for g in own
        ]
        # Merged by position in its own list, so group messages run from start to end.
        keyed = [((k + 1) / len(unicast), item) for k, item in enumerate(unicast)]
        keyed += [((k + 1) / len(grouped), item) for k, item in enumerate(grouped)]
        plans.append([item for _, item in sorted(keyed, key=lambda pair: pair[0])])
    return plans


async def _send_all(
    index: int, service: meshbus.Service, plan: list[Send], traffic: Traffic
) -> None:
    pack = PAYLOAD.pack
    for msg_id, dst, group, seq, final in plan:
        await traffic.admit()
        traffic.attempted += 1
        payload = pack(msg_id, index, group, seq)
        try:
            if group == NO_GROUP:
                await service.send(dst, payload, reliable=True)
            else:
                await service.send(_POOL, payload, group=f"g{group}", final=final)
        except meshbus.MeshbusError as exc:
            # Not retried: the application was told, so it is not a silent loss.
            traffic.errors[type(exc).__name__] += 1
            continue
        traffic.sent_ids[msg_id] = 1
        traffic.sent += 1


class Starter:
    """Starts the run's brokers, each behind a gate of its own that the others dial (by
    data dir: a restarted broker keeps its gate), every one with ``args``."""

    def __init__(self, brokers: MeshbusProcesses, args: tuple[str, ...]) -> None:
        self._brokers = brokers
        self._args = args
        self.gates: dict[str, BrokerGate] = {}

    async def start(self, data_dir: str, *args: str) -> MeshbusProcess:
        gate = self.gates.get(data_dir)
        if gate is None:
            gate = self.gates[data_dir] = BrokerGate()
            await gate.start()
        broker = await asyncio.wait_for(
            self._brokers.start(
                "--data-dir", data_dir, "--advertise", gate.address, *self._args, *args
            ),
            _STEP_LIMIT,
        )
        gate.upstream = broker.address
        return broker

    async def close(self) -> None:
        for gate in self.gates.values():
            await gate.close()


@dataclass(frozen=True)
class Cut:
    """The partition nemesis: B's link to A cut for ``seconds`` while both reach C, or,
    with ``isolate``, B cut off from A and C both."""

    seconds: float
    isolate: bool


async def _formed(mesh: list[MeshbusProcess]) -> None:
    """Until every broker links to every other and all are ready (operator links: they
    are not connectors, so they neither count nor move)."""
    deadline = time.monotonic() + _STEP_LIMIT
    for broker in mesh:
        async with await meshbus.connect(broker.address, server="chaos", operator=True) as op:
            while True:
                stat = await op.stat(detail=False)
                states = stat["mesh"]
                if (
                    len(stat["peer_links"]) == len(mesh) - 1
                    and len(states) == len(mesh)
                    and all(b["ready"] and not b["draining"] for b in states)
                ):
                    break
                if time.monotonic() > deadline:
                    raise CheckFailed(f"no full mesh of {len(mesh)} brokers in {_STEP_LIMIT:.0f} s")
                await asyncio.sleep(0.05)


async def _shake(
    starter: Starter,
    dirs: dict[str, str],
    mesh: list[MeshbusProcess],
    traffic: Traffic,
    timeline: Timeline,
    cut: Cut,
) -> None:
    """The events, each once the senders reach its mark (they wait there until it begins)."""
    a, b, c = mesh
    await traffic.marks[0].reached.wait()
    a.process.kill()
    await a.process.wait()
    timeline.add("kill -9", a.name)
    traffic.marks[0].begun.set()
    again = await starter.start(dirs["a"], "--listen", a.address, "--seed", c.address)
    timeline.add("restarted", f"{again.name} at {again.address}, ready in {again.start_ms:.0f} ms")

    await traffic.marks[1].reached.wait()
    c.process.send_signal(signal.SIGSTOP)
    timeline.add("SIGSTOP (pause)", f"{c.name} for {PAUSE:.0f} s")
    traffic.marks[1].begun.set()
    await asyncio.sleep(PAUSE)
    c.process.send_signal(signal.SIGCONT)
    resumed = time.perf_counter()
    timeline.add("SIGCONT", c.name)
    await _formed([again, b, c])
    healed = time.perf_counter() - resumed
    timeline.healed_s = healed
    timeline.add("healed", f"a full mesh again {healed:.2f} s after SIGCONT")

    await traffic.marks[2].reached.wait()
    gate_a, gate_b, gate_c = (starter.gates[dirs[n]] for n in "abc")
    # Each gate keeps out the brokers on the other side (a gate holds no name twice).
    apart = [(gate_a, b.name), (gate_b, again.name)]
    if cut.isolate:
        apart += [(gate_c, b.name), (gate_b, c.name)]
        timeline.add("isolated", f"{b.name} from {again.name} and {c.name} for {cut.seconds:g} s")
    else:
        timeline.add(
            "link cut", f"{again.name} - {b.name} for {cut.seconds:g} s, both reach {c.name}"
        )
    for gate, name in apart:
        gate.shut_out(name)
    traffic.marks[2].begun.set()
    await asyncio.sleep(cut.seconds)
    for gate, name in apart:
        gate.open_to(name)
    mended = time.perf_counter()
    timeline.add("link works", f"{b.name} linked again")
    await _formed([again, b, c])
    healed = time.perf_counter() - mended
    timeline.healed_s = max(timeline.healed_s, healed)
    timeline.add("healed", f"a full mesh again {healed:.2f} s after the link works")

    await traffic.marks[3].reached.wait()
    b.process.send_signal(signal.SIGTERM)
    timeline.add("SIGTERM (drain)", b.name)
    traffic.marks[3].begun.set()
    try:
        code = await asyncio.wait_for(b.process.wait(), _STEP_LIMIT)
        timeline.add("drained, exited", f"{b.name}, exit code {code}")
    except TimeoutError:
        # What the mesh did, not a failed setup: reported, and the traffic goes on.
        timeline.add("still running", f"{b.name}, {_STEP_LIMIT:.0f} s after SIGTERM")

    await traffic.marks[4].reached.wait()
    timeline.add("join", "a 4th broker, seed " + c.name)
    joined = await starter.start(dirs["d"], "--seed", c.address)
    timeline.add("joined", f"{joined.name}, ready in {joined.start_ms:.0f} ms")
    # Only now: the rest of the traffic runs while connectors move onto the newcomer.
    traffic.marks[4].begun.set()
    await _rebalanced([again, c, joined], timeline)


async def _rebalanced(live: list[MeshbusProcess], timeline: Timeline) -> None:
    """Until the connectors are within one of even over the ``live`` brokers; a mesh that
    does not get there is reported, not failed: the counts still say what was delivered."""
    deadline = time.monotonic() + _STEP_LIMIT
    ops = [await meshbus.connect(b.address, server="chaos", operator=True) for b in live]
    try:
        while True:
            counts = [int((await op.stat(detail=False))["connectors"]) for op in ops]
            spread = "/".join(map(str, counts))
            if sum(counts) == 2 * _CONNECTORS_PER_KIND and max(counts) - min(counts) <= 1:
                timeline.add("rebalanced", f"connectors per broker {spread}")
                return
            if time.monotonic() > deadline:
                timeline.add("not rebalanced", f"after {_STEP_LIMIT:.0f} s: {spread}")
                return
            await asyncio.sleep(0.05)
    finally:
        await close_all(ops)


async def _progress(
    traffic: Traffic, tally: Tally, senders: list[meshbus.Connector], timeline: Timeline
) -> None:
    while True:
        await asyncio.sleep(_PROGRESS_EVERY)
        unacked = sum(conn.unacked for conn in senders)
        click.echo(
            f"chaos t={timeline.now():6.1f} s  sent {traffic.sent:,}/{traffic.total:,}  "
            f"received {tally.received:,}  unacked {unacked:,}",
            err=True,
        )


@dataclass
class Outcome:
    timeline: Timeline
    traffic: Traffic
    tally: Tally
    failovers: int
    moves: int
    landed: Counter[str]


async def _run(
    starter: Starter, workdir: str, count: int, groups: int, group_size: int, cut: Cut
) -> Outcome:
    try:
        return await _run_gated(starter, workdir, count, groups, group_size, cut)
    finally:
        await starter.close()


async def _run_gated(
    starter: Starter, workdir: str, count: int, groups: int, group_size: int, cut: Cut
) -> Outcome:
    dirs = {name: os.path.join(workdir, name) for name in "abcd"}
    first = await starter.start(dirs["a"])
    rest = await asyncio.gather(*(starter.start(dirs[n], "--seed", first.address) for n in "bc"))
    mesh = [first, *rest]
    await _formed(mesh)
    addresses = [broker.address for broker in mesh]
    conns: list[meshbus.Connector] = []
    try:
        for kind in ("chsend", "chrecv"):
            for i in range(_CONNECTORS_PER_KIND):
                # Its own broker first (connect tries them in order), then the others.
                order = addresses[i:] + addresses[:i]
                conns.append(await meshbus.connect(order, server=f"{kind}{i}"))
        senders, receivers = conns[:_CONNECTORS_PER_KIND], conns[_CONNECTORS_PER_KIND:]
        total = count + groups * group_size
        traffic, tally = Traffic(total), Tally(total)
        members = []
        for i, conn in enumerate(receivers):
            service = await conn.register()
            await service.join(_POOL)
            service.add_listener(tally.listener(f"receiver {i}"))
            members.append(service.address)
        sending = [await conn.register() for conn in senders]

        def given_up(_: Exception) -> None:
            traffic.given_up += 1

        for conn in senders:
            conn.on_delivery_failed(given_up)
        plans = plan_sends(count, groups, group_size, members)
        timeline = Timeline()
        timeline.add("traffic", f"{count:,} unicast + {groups} groups x {group_size}")
        progress = asyncio.create_task(_progress(traffic, tally, senders, timeline))
        try:
            # gather rather than a TaskGroup: a failed step (a broker that did not start)
            # comes out as itself, which run_on_brokers turns into a click error.
            async def send_everything() -> None:
                pairs = enumerate(zip(sending, plans, strict=True))
                await asyncio.gather(
                    *(_send_all(i, svc, plan, traffic) for i, (svc, plan) in pairs)
                )
                timeline.add("all sent", f"{traffic.sent:,} sent")

            tasks = [
                asyncio.create_task(_shake(starter, dirs, mesh, traffic, timeline, cut)),
                asyncio.create_task(send_everything()),
            ]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await asyncio.gather(*(conn.wait_acked(_ACK_LIMIT) for conn in senders))
                timeline.add("all acknowledged")
            except TimeoutError:
                left = sum(conn.unacked for conn in senders)
                timeline.add(
                    "ack wait gave up", f"{left:,} unacknowledged after {_ACK_LIMIT:.0f} s"
                )
            while tally.received < traffic.sent:
                quiet = _QUIET - (time.perf_counter() - tally.last_at)
                if quiet <= 0:
                    break
                await asyncio.sleep(min(quiet, 0.05))
            timeline.add("receivers drained", f"{tally.received:,} distinct ids received")
        finally:
            progress.cancel()
        return Outcome(
            timeline,
            traffic,
            tally,
            failovers=sum(conn.failovers for conn in conns),
            moves=sum(conn.moves for conn in conns),
            landed=Counter(conn.broker_name for conn in conns),
        )
    finally:
        await close_all(conns)


@click.command()
@click.option(
    "--count",
    type=click.IntRange(_CONNECTORS_PER_KIND * 10),
    default=100_000,
    show_default=True,
    help="Reliable unicast messages, over all senders.",
)
@click.option(
    "--groups",
    type=click.IntRange(0, NO_GROUP - 1),
    default=50,
    show_default=True,
    help="Message groups, to an anycast address with a member on every broker.",
)
@click.option(
    "--group-size",
    type=click.IntRange(1),
    default=20,
    show_default=True,
    help="Messages per group, the last one final.",
)
@click.option(
    "--cut",
    type=click.FloatRange(0.1, 60.0),
    default=3.0,
    show_default=True,
    help="Seconds the A-B link is cut (past the 1.5 s heartbeat budget by default; "
    "above the 4 s --group-grace, a group's member stays out of reach past the grace).",
)
@click.option(
    "--isolate",
    is_flag=True,
    help="Cut B off from A and C both for --cut seconds, instead of the A-B link alone: "
    "to each side the other looks crashed.",
)
@click.option(
    "--partition-handling",
    type=click.Choice(PARTITION_HANDLING),
    default="ignore",
    show_default=True,
    help="The brokers' --partition-handling: with pause-minority an isolated B hands "
    "its connectors to A and C.",
)
def chaos(
    count: int, groups: int, group_size: int, cut: float, isolate: bool, partition_handling: str
) -> None:
    """Reliable traffic through a 3-broker mesh while one broker is killed and restarted,
    one is paused past its heartbeat budget, one link is cut, one broker drains and a
    4th joins: count lost, duplicated and out-of-order messages, groups that reached
    two members, and how long the mesh took to heal after the pause and the cut.

    Progress goes to stderr as it runs, then a table of events and counts. The counts
    are the result, so the command exits 0 whatever they are (non-zero only when the
    mesh cannot be set up).

    Last line: `lost=<n> duplicated=<n> out_of_order=<n> two_members=<n> healed_s=<s>`.
    """
    with tempfile.TemporaryDirectory(prefix="meshbus-chaos-") as workdir:
        outcome = run_on_brokers(
            lambda brokers: _run(
                Starter(brokers, ("--partition-handling", partition_handling)),
                workdir,
                count,
                groups,
                group_size,
                Cut(cut, isolate),
            )
        )
    traffic, tally = outcome.traffic, outcome.tally
    counts = tally.counts
    sent_ids = traffic.sent_ids
    lost = sum(1 for i, was_sent in enumerate(sent_ids) if was_sent and not counts[i])
    duplicated = sum(1 for seen in counts if seen > 1)
    events = new_table(
        f"chaos: {count:,} unicast + {groups} groups x {group_size}", ("t s", "event", "detail")
    )
    for at, event, detail in outcome.timeline.rows:
        events.add_row(f"{at:.1f}", event, detail)
    events.add_section()
    landed = ", ".join(f"{name or '-'}: {n}" for name, n in sorted(outcome.landed.items()))
    errors = ", ".join(f"{name}: {n}" for name, n in traffic.errors.items()) or "none"
    for event, detail in (
        ("sent", f"{traffic.sent:,} of {traffic.total:,}; send errors: {errors}"),
        ("given up", f"{traffic.given_up:,} (on_delivery_failed)"),
        ("failovers", str(outcome.failovers)),
        ("moves", str(outcome.moves)),
        ("connectors at the end", landed),
        ("group member switches", f"{tally.switches} ({tally.unflagged} without group_reassigned)"),
        ("lost / duplicated / out of order", f"{lost} / {duplicated} / {tally.out_of_order}"),
        ("groups that reached two members", str(len(tally.two_members))),
    ):
        events.add_row("", event, detail)
    print_tables(events)
    click.echo(
        f"lost={lost} duplicated={duplicated} out_of_order={tally.out_of_order} "
        f"two_members={len(tally.two_members)} healed_s={outcome.timeline.healed_s:.2f}"
    )
