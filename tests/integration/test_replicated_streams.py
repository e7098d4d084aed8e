"""Replicated streams (--replicas 3) on three real broker processes, each with its own
--data-dir: the leader killed with kill -9 while a producer sends reliably, and a
stream that lost a majority of its replicas refusing to acknowledge.

Also what the nemeses of test_replicated_faults.py share: ``Replicas`` (three brokers
behind TCP gates, killed, paused, cut off and restarted by name), ``Producer`` (unique
values sent reliably in the background, each acknowledgement recorded) and
``Consumer`` and ``check_copies`` (what was acknowledged is stored, once, in order, the
same on every replica)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import meshbus
from bench.gate import BrokerGate
from meshbus import Multicast, ReliableConfig, RetryPolicy
from meshbus.client.streams import StreamInfo, StreamMessage
from meshbus.errors import DeliveryFailed, MeshbusError, StreamError, Timeout
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import wait_members, wait_until
from tests.integration.test_cli import run_cli
from tests.integration.test_streams import fetch_all

# Election timeouts are 1-2 s at the default --raft-tick (0.1 s); a leader's death is
# noticed after one, so appends resume within a few.
RESUME_WITHIN = 10.0
STREAM = "ledger"


@dataclass
class Replicas:
    """Brokers r0, r1, ... of one mesh, each with its data dir (``root``/NAME: a replica
    is known to its group by its name, so one that restarts keeps it) and a gate in front
    (bench.gate: the brokers dial each other through the gates, clients dial the brokers
    themselves), so a test can kill, pause, cut off and restart them by name. They stop
    at the end without waiting for connectors to move away (--drain-grace 0.5): the others
    are stopping too."""

    root: Path
    args: tuple[str, ...]
    gates: dict[str, BrokerGate] = field(default_factory=dict)
    brokers: dict[str, BrokerProcess] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)
    cut: set[str] = field(default_factory=set)

    @classmethod
    async def start(cls, root: Path, count: int = 3, *args: str) -> Replicas:
        replicas = cls(root, args)
        for i in range(count):
            await replicas.add(f"r{i}")
        return replicas

    async def add(self, name: str) -> BrokerProcess:
        """A new broker ``name``, with its gate, joining the mesh."""
        gate = self.gates[name] = BrokerGate()
        await gate.start()
        return await self.restart(name)

    def __getitem__(self, name: str) -> BrokerProcess:
        return self.brokers[name]

    @property
    def names(self) -> list[str]:
        return sorted(self.brokers)

    def data_dir(self, name: str) -> Path:
        return self.root / name

    def running(self, name: str) -> bool:
        return self.brokers[name].process.returncode is None

    async def restart(self, name: str) -> BrokerProcess:
        """Start broker ``name`` (again) from its data dir, joining through a running one
        (not a paused or cut off one: its join would wait on it)."""
        seed = next(
            (
                self.gates[n].address
                for n in self.names
                if self.running(n) and n not in self.paused | self.cut
            ),
            "",
        )
        broker = await start_broker(
            "--name", name, "--data-dir", str(self.data_dir(name)),
            "--advertise", self.gates[name].address, *(("--seed", seed) if seed else ()),
            "--drain-grace", "0.5", *self.args,
        )  # fmt: skip
        self.gates[name].upstream = broker.address
        self.brokers[name] = broker
        return broker

    async def kill(self, *names: str) -> None:
        """kill -9: nothing it did not fsync survives (docs/raft.md)."""
        for name in names:
            process = self.brokers[name].process
            process.kill()
            assert await process.wait() == -9

    def pause(self, name: str) -> None:
        self.brokers[name].process.send_signal(signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        self.brokers[name].process.send_signal(signal.SIGCONT)
        self.paused.discard(name)

    def cut_off(self, name: str) -> None:
        """Cut every link between broker ``name`` and the others (both gates of each
        link); its clients still reach it."""
        self.cut.add(name)
        for other in self.names:
            if other != name:
                self.gates[name].shut_out(other)
                self.gates[other].shut_out(name)

    def reconnect(self, name: str) -> None:
        self.cut.discard(name)
        for other in self.names:
            if other != name:
                self.gates[name].open_to(other)
                self.gates[other].open_to(name)

    async def close(self) -> None:
        for name in self.names:
            if self.running(name):
                self.resume(name)
        await stop_all([b for n, b in self.brokers.items() if self.running(n)])
        for gate in self.gates.values():
            await gate.close()


@contextlib.asynccontextmanager
async def replicated_stream(
    root: Path, *args: str, count: int = 3, brokers: int = 0
) -> AsyncIterator[tuple[Replicas, StreamInfo]]:
    """``Replicas`` holding stream ``STREAM`` (capturing multicast:ledger, ``count``
    replicas, on as many brokers or on ``brokers``), once it has a leader and every
    broker routes to its member."""
    replicas = await Replicas.start(root, brokers or count, *args)
    try:
        first = replicas[replicas.names[0]]
        async with await meshbus.connect(first.address, server="op", operator=True) as op:
            await op.streams.add(STREAM, f"multicast:{STREAM}", replicas=count)
            info = await led(op, STREAM)
        # The stream's member address follows its leader: a leadership that moves on a
        # loaded host (a broker stalled past its heartbeat budget, an election of up to
        # 20 ticks of --raft-tick 0.3) moves it again before every table has it.
        await wait_members(list(replicas.brokers.values()), Multicast(STREAM), 1, timeout=30)
        yield replicas, info
    finally:
        await replicas.close()


async def led(conn: meshbus.Connector, stream: str, not_by: str = "") -> StreamInfo:
    """The stream's info once a leader (other than ``not_by``) is elected."""
    info: StreamInfo | None = None

    async def has_leader() -> bool:
        nonlocal info
        info = await conn.streams.info(stream)
        return info.leader not in ("", not_by)

    await wait_until(has_leader, f"a leader of stream {stream}", timeout=20)
    assert info is not None
    return info


# What a Producer records of a send its broker knew no member to send to (send_reliable
# returns 0: a multicast to nobody, where nothing can be lost or stored).
NO_MEMBER = "no member of the stream's group"


class Producer:
    """Sends PREFIX0, PREFIX1, ... to the stream's group reliably, one at a time, until
    stopped; records each value acknowledged (in order, with when) and each given up.
    A value given up may still be stored (its entry committed after the sender gave up),
    at most once; an acknowledged one must be."""

    def __init__(self, conn: meshbus.Connector, prefix: str) -> None:
        self.prefix = prefix.encode()
        self.acked: list[int] = []
        self.acked_at: list[float] = []
        self.failed: list[tuple[int, str]] = []
        self._conn = conn
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def on(cls, broker: BrokerProcess, prefix: str, retry: RetryPolicy) -> Producer:
        # No keepalive: it stays with its broker through a pause (no failover).
        conn = await meshbus.connect(
            broker.address,
            server=f"pub{prefix}",
            reliable=ReliableConfig(retry=retry),
            keepalive=0,
        )
        return cls(conn, prefix)

    async def _run(self) -> None:
        publisher = await self._conn.register()
        value = 0
        while True:
            try:
                sent = await publisher.send_reliable(
                    f"multicast:{STREAM}", self.prefix + b"%d" % value
                )
            except (DeliveryFailed, Timeout) as exc:  # no ack; or its broker paused
                self.failed.append((value, str(exc)))
            except MeshbusError as exc:  # its broker was killed: it sends no more
                self.failed.append((value, str(exc)))
                return
            else:
                if sent:
                    self.acked.append(value)
                    self.acked_at.append(time.monotonic())
                else:  # 0: its broker knew no member of the group, so nobody took it
                    self.failed.append((value, NO_MEMBER))
                    await asyncio.sleep(0.05)
            value += 1

    def acked_since(self, moment: float) -> int:
        return sum(1 for at in self.acked_at if at > moment)

    @property
    def ended(self) -> bool:
        """It sends no more: its link failed (``failed[-1]`` says how)."""
        return self._task.done()

    async def wait_acked(self, count: int, since: float = 0.0, timeout: float = 20.0) -> float:
        """Until ``count`` values more were acknowledged after ``since``; seconds from
        ``since`` to the first of them."""

        async def enough() -> bool:
            return self.acked_since(since) >= count

        given_up = self.failed[-3:]
        what = f"{count} acknowledgements of {self.prefix!r} (the last given up: {given_up})"
        await wait_until(enough, what, timeout)
        return next(at for at in self.acked_at if at > since) - since

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, MeshbusError):
            await self._task
        await self._conn.close()


class Consumer:
    """Reads the stream from one replica, in the background, as it grows: what it has
    read must stay the stream's prefix (a replica serves only what is committed)."""

    def __init__(self, conn: meshbus.Connector) -> None:
        self.read: list[StreamMessage] = []
        self._conn = conn
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def on(cls, broker: BrokerProcess) -> Consumer:
        return cls(await meshbus.connect(broker.address, server="consumer"))

    async def _run(self) -> None:
        while True:
            try:
                self.read += await self._conn.streams.fetch(STREAM, len(self.read) + 1, 500)
            except (MeshbusError, TimeoutError):
                pass  # no leader to relay to for a moment
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, MeshbusError):
            await self._task
        await self._conn.close()


async def check_copies(
    replicas: Replicas,
    producers: list[Producer],
    consumer: Consumer | None = None,
    removed: tuple[str, ...] = (),
) -> list[StreamMessage]:
    """Once every running replica (but those ``removed`` from the stream's group, which
    keep the copy they had) has the same last seq twice in a row (a resend the
    producers' brokers still held when they stopped may commit meanwhile), their copies
    are the same; in it every acknowledged value is stored once, in the order
    acknowledged, no value is stored twice, and seqs run 1..n. What ``consumer`` read is
    a prefix of it."""
    names = [n for n in replicas.names if replicas.running(n) and n not in removed]
    async with contextlib.AsyncExitStack() as stack:
        conns = [
            await stack.enter_async_context(
                await meshbus.connect(replicas[name].address, server="check")
            )
            for name in names
        ]
        await led(conns[0], STREAM)
        last: set[int] = set()

        async def settled() -> bool:
            nonlocal last
            seen = {(await conn.streams.info(STREAM)).last_seq for conn in conns}
            same = len(seen) == 1 and seen == last
            last = seen
            await asyncio.sleep(0.1)
            return same

        await wait_until(settled, f"the copies of {names} in step", timeout=20)
        copies = {
            name: await fetch_all(conn, STREAM) for name, conn in zip(names, conns, strict=True)
        }
    stored = copies[names[0]]
    for name, copy in copies.items():
        assert [(m.seq, m.payload) for m in copy] == [(m.seq, m.payload) for m in stored], name
    assert [m.seq for m in stored] == list(range(1, len(stored) + 1))
    payloads = [m.payload for m in stored]
    assert len(payloads) == len(set(payloads)), "a value stored twice"
    for producer in producers:
        values = [int(p[len(producer.prefix) :]) for p in payloads if p.startswith(producer.prefix)]
        acked = set(producer.acked)
        lost = acked - set(values)
        assert not lost, f"acknowledged and lost: {sorted(lost)}"
        assert [v for v in values if v in acked] == producer.acked, "acknowledged out of order"
    if consumer is not None:
        read = [(m.seq, m.payload) for m in consumer.read]
        assert read == [(m.seq, m.payload) for m in stored[: len(read)]], "a read rewritten"
    return stored


async def test_the_leader_killed_loses_no_acknowledged_message(tmp_path: Path) -> None:
    replicas = await Replicas.start(tmp_path)
    names = replicas.names
    try:
        added = await run_cli(
            "stream", "add", STREAM, "--capture", f"multicast:{STREAM}", "--replicas", "3",
            "--broker", replicas[names[0]].address, "--json",
        )  # fmt: skip
        assert added.code == 0, added.err
        assert sorted(json.loads(added.out)["replicas"]) == names
        async with await meshbus.connect(
            replicas[names[0]].address, server="op", operator=True
        ) as op:
            info = await led(op, STREAM)
        assert sorted(info.replicas) == names
        shown = await run_cli("stream", "info", STREAM, "--broker", replicas[names[1]].address)
        assert shown.code == 0, shown.err
        assert re.search(rf"leader\s+│?\s*{info.leader}", shown.out), shown.out
        assert all(name in shown.out for name in names)
        # asked of a follower, the states and lags come from the leader
        states = re.findall(r"replica (r\d)\s+│?\s*(\w+), (\d+) entries behind", shown.out)
        assert sorted(n for n, _, _ in states) == names, shown.out
        assert {n: s for n, s, _ in states if n == info.leader} == {info.leader: "leader"}
        await wait_members(list(replicas.brokers.values()), Multicast(STREAM), 1)
        leader = info.leader
        survivor = replicas[next(n for n in names if n != leader)]
        acked: list[int] = []
        failed: list[int] = []
        async with await meshbus.connect(survivor.address, server="pub") as conn:
            publisher = await conn.register()
            # Plain sends first: no publish id, so only the applied index keeps a replica
            # that restarts from applying them twice. (At most once: one sent while the
            # leadership moves may be lost, so only some are waited for.)
            for i in range(20):
                await publisher.send(f"multicast:{STREAM}", b"plain-%d" % i)

            async def plain_stored() -> bool:
                return len(await fetch_all(conn, STREAM)) > 0

            await wait_until(plain_stored, "the plain sends stored")
            killed_at = 0.0
            resumed_at = 0.0
            for value in range(300):
                if value == 100:
                    await replicas.kill(leader)
                    killed_at = time.monotonic()
                try:
                    await publisher.send_reliable(f"multicast:{STREAM}", b"v%d" % value)
                except DeliveryFailed:
                    failed.append(value)
                    continue
                acked.append(value)
                if killed_at and not resumed_at:
                    resumed_at = time.monotonic()
            assert resumed_at - killed_at < RESUME_WITHIN, (killed_at, resumed_at)
            assert len(acked) == 300, failed  # the resends carried every one through
            new = await led(conn, STREAM, not_by=leader)
            assert sorted(new.replicas) == names
        # Read through the new leader: its committed prefix has every acknowledged value.
        async with await meshbus.connect(replicas[new.leader].address, server="reader") as conn:
            stored = await fetch_all(conn, STREAM)
        assert stored[0].payload.startswith(b"plain-")
        values = [int(m.payload[1:]) for m in stored if m.payload.startswith(b"v")]
        assert len(values) == len(set(values)), "a value stored twice"
        assert [v for v in values if v in set(acked)] == acked  # all there, in order
        assert [m.seq for m in stored] == list(range(1, len(stored) + 1))
        # The other survivor serves its committed prefix: the same, once it caught up.
        other = replicas[next(n for n in names if n not in (leader, new.leader))]
        async with await meshbus.connect(other.address, server="reader") as conn:
            # A current read asked of this follower is answered by the leader.
            current = await conn.streams.fetch(STREAM, len(stored), 10, current=True)
            assert [m.payload for m in current] == [stored[-1].payload]

            async def caught_up() -> bool:
                return len(await fetch_all(conn, STREAM)) == len(stored)

            await wait_until(caught_up, "the other survivor's copy")
            copy = await fetch_all(conn, STREAM)
            # stat (and /metrics, from the same): it saw the old leader, then the new
            seen = (await conn.stat())["streams"]["raft"]
        assert [(m.seq, m.payload) for m in copy] == [(m.seq, m.payload) for m in stored]
        assert seen["syncs"] > 0
        assert seen["streams"][STREAM]["leader"] == new.leader
        assert seen["streams"][STREAM]["leader_changes"] >= 2
        # The old leader back from its data dir: what it applied before is not applied
        # twice (its store records the last entry applied), and it catches up.
        back = await replicas.restart(leader)
        async with await meshbus.connect(back.address, server="reader") as conn:

            async def back_in_step() -> bool:
                info = await conn.streams.info(STREAM)
                return info.last_seq == len(stored) and info.leader == new.leader

            await wait_until(back_in_step, "the restarted broker's copy", timeout=20)
            copy = await fetch_all(conn, STREAM)
            assert [(m.seq, m.payload) for m in copy] == [(m.seq, m.payload) for m in stored]
            # A delete asked of a follower goes to the leader; every replica deletes the
            # stream once the deletion is committed.
            await conn.streams.delete(STREAM)

            async def gone_everywhere() -> bool:
                for broker in replicas.brokers.values():
                    async with await meshbus.connect(broker.address, server="check") as c:
                        try:
                            await c.streams.info(STREAM)
                        except StreamError:
                            continue
                        return False
                return True

            await wait_until(gone_everywhere, "the stream deleted on every replica")
    finally:
        await replicas.close()


async def test_a_minority_acknowledges_nothing(tmp_path: Path) -> None:
    async with replicated_stream(tmp_path) as (replicas, _):
        survivor, *doomed = replicas.names
        await replicas.kill(*doomed)
        retry = RetryPolicy(ack_timeout=0.5, max_attempts=5)
        async with await meshbus.connect(
            replicas[survivor].address, server="pub", reliable=ReliableConfig(retry=retry)
        ) as conn:
            publisher = await conn.register()
            # Never acknowledged: a replica without a majority cannot commit it.
            with pytest.raises(DeliveryFailed, match="no acknowledgement"):
                await publisher.send_reliable(f"multicast:{STREAM}", b"unacked")
            info = await conn.streams.info(STREAM)
            assert info.leader == ""  # the last one stepped down: no majority answers it
            assert [m.payload for m in await fetch_all(conn, STREAM)] == []


async def test_the_followers_elect_at_once_when_the_leaders_links_close(tmp_path: Path) -> None:
    """kill -9 resets the leader's links, and its followers campaign at once
    (``RaftNode.leader_lost``) instead of after an election timeout of silence. With
    --raft-tick 0.3 that timeout is 3-6 s: a new leader named well within it -- the
    bound is the timeouts', not a speed goal -- was elected by that path."""
    async with replicated_stream(tmp_path, "--raft-tick", "0.3") as (replicas, info):
        survivor = next(n for n in replicas.names if n != info.leader)
        async with await meshbus.connect(replicas[survivor].address, server="pub") as conn:
            publisher = await conn.register()
            await replicas.kill(info.leader)
            killed_at = time.monotonic()
            new = await led(conn, STREAM, not_by=info.leader)
            elected_in = time.monotonic() - killed_at
            await publisher.send_reliable(f"multicast:{STREAM}", b"after")
        assert elected_in < 2.5, f"elected {elected_in:.2f} s after the kill"
        async with await meshbus.connect(replicas[new.leader].address, server="reader") as conn:
            assert [m.payload for m in await fetch_all(conn, STREAM)] == [b"after"]
