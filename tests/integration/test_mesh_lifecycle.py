"""The mesh over time: crash and failover, drain, join and rebalancing, capacity, heartbeats.

Every broker here is a real process; crashes are kill -9 and SIGSTOP, drains are SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

import meshbus
from meshbus.protocol import ControlType
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import (
    IO_TIMEOUT,
    assert_next_is,
    stat,
    wait_members,
    wait_routes,
    wait_until,
)


async def echo(service: meshbus.Service) -> None:
    """Answer every request with its payload, for as long as the service lives."""
    async for msg in service:
        if msg.is_request:
            await msg.reply(msg.payload)


async def reach_all(
    probe: meshbus.Service, targets: list[meshbus.Address], timeout: float = 10
) -> None:
    """Until a request from ``probe`` to every target is answered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = list(targets)
    while pending:
        results = await asyncio.gather(
            *(probe.request(t, b"ping", timeout=0.5) for t in pending), return_exceptions=True
        )
        pending = [t for t, r in zip(pending, results, strict=True) if isinstance(r, Exception)]
        if pending:
            assert loop.time() < deadline, f"{len(pending)} services unreachable: {pending[:5]}"
            await asyncio.sleep(0.02)


class Fleet:
    """Connectors spread over brokers, each with services that answer requests."""

    def __init__(self) -> None:
        self.conns: list[meshbus.Connector] = []
        self.services: list[meshbus.Service] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def add(self, address: str, server: str, services: int, **kw: Any) -> meshbus.Connector:
        conn = await meshbus.connect(address, server=server, **kw)
        self.conns.append(conn)
        for i in range(services):
            svc = await conn.register(instance=i + 1 if i % 2 else None)
            self.services.append(svc)
            self.tasks.append(asyncio.create_task(echo(svc)))
        return conn

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for conn in self.conns:
            await conn.close()


async def connector_counts(brokers: list[BrokerProcess]) -> dict[str, int]:
    """Connectors per broker (stat's own link is an operator's, not counted)."""
    return {b.name: (await stat(b, detail=False))["connectors"] for b in brokers}


# -- crash ------------------------------------------------------------------------------------


async def test_kill_9_every_service_comes_back_with_the_same_address(mesh3):
    a, b, c = mesh3
    fleet = Fleet()
    try:
        for i in range(3):
            await fleet.add(c.address, f"v{i}", 4)
        group = meshbus.Multicast("after.crash")
        listeners = [await conn.register() for conn in fleet.conns]  # not echoing: ours
        for listener in listeners:
            await listener.join(group)
        probe_conn = await meshbus.connect(a.address, server="probe", failover=False)
        fleet.conns.append(probe_conn)
        probe = await probe_conn.register()
        await wait_members([a, b], group, len(listeners))
        addresses = [s.address for s in fleet.services]
        await reach_all(probe, addresses)
        # A request in flight through the broker that dies fails clearly, not by timeout.
        silent_conn = fleet.conns[0]
        silent = await silent_conn.register()
        asker = await fleet.conns[1].register()
        in_flight = asyncio.create_task(asker.request(probe.address, b"slow", timeout=30))
        await probe.recv(timeout=IO_TIMEOUT)  # it reached the probe; nobody answers

        # ...and so does one sent from A to a service on C that never answers: A knew the
        # request went to C alone, so it answers NO_ROUTE when C goes, not at the deadline.
        towards = asyncio.create_task(probe.request(silent.address, b"slow too", timeout=30))
        await silent.recv(timeout=IO_TIMEOUT)

        c.process.kill()  # kill -9
        with pytest.raises(meshbus.ConnectionLost, match=r"lost the link to broker"):
            await asyncio.wait_for(in_flight, IO_TIMEOUT)
        with pytest.raises(meshbus.NoRoute, match="left the mesh"):
            await asyncio.wait_for(towards, IO_TIMEOUT)
        await reach_all(probe, addresses)
        assert [s.address for s in fleet.services] == addresses
        assert all(conn.failovers == 1 for conn in fleet.conns[:3])
        assert {conn.broker_name for conn in fleet.conns[:3]} <= {a.name, b.name}
        # Group memberships came along: a multicast from A reaches every member once.
        await wait_members([a, b], group, len(listeners))
        await probe.send(group, b"all there?")
        for listener in listeners:
            await assert_next_is(listener, b"all there?")
        # The survivors noticed the crash and raised their capacity (50 -> 60).
        for broker in (a, b):
            data = await stat(broker, detail=False)
            assert c.name not in data["peers"]
            assert data["capacity"] == 60
        assert silent.address in [s.address for s in silent_conn.services]
    finally:
        await fleet.close()


async def test_a_dead_broker_is_never_offered_again(mesh3):
    """Gossip from a peer that has not noticed a crash yet must not bring the dead broker
    back into anyone's list: connectors would be redirected or moved to it."""
    a, b, c = mesh3
    conn = await meshbus.connect(a.address, server="lists")
    try:
        c.process.kill()
        await c.process.wait()
        newcomer = await start_broker("--seed", b.address)  # makes everyone gossip
        try:
            loop = asyncio.get_running_loop()
            until = loop.time() + 1.5
            while loop.time() < until:
                for broker in (a, b, newcomer):
                    names = {m["name"] for m in (await stat(broker, detail=False))["mesh"]}
                    assert c.name not in names, f"{broker.name} offers the dead {c.name}"
                assert c.address not in conn.brokers
                await asyncio.sleep(0.05)
        finally:
            await stop_all([newcomer])
    finally:
        await conn.close()


async def test_a_stopped_broker_is_detected_by_heartbeats():
    """SIGSTOP leaves sockets open: only heartbeats can tell. Peers drop it within about
    a second and a half; its connectors fail over (their own keepalive)."""
    brokers = await start_mesh(2, "--heartbeat-interval", "0.2")
    a, b = brokers
    fleet = Fleet()
    try:
        await fleet.add(b.address, "hb", 2, keepalive=0.2)
        probe_conn = await meshbus.connect(a.address, server="probe", failover=False)
        fleet.conns.append(probe_conn)
        probe = await probe_conn.register()
        await reach_all(probe, [s.address for s in fleet.services])
        start = asyncio.get_running_loop().time()
        os.kill(b.process.pid, signal.SIGSTOP)

        async def dropped() -> bool:
            return b.name not in (await stat(a, detail=False))["peers"]

        await wait_until(dropped, "the stopped broker to be dropped", timeout=5)
        assert asyncio.get_running_loop().time() - start < 3
        await reach_all(probe, [s.address for s in fleet.services])
        assert fleet.conns[0].broker_name == a.name
    finally:
        await fleet.close()
        b.process.kill()
        await stop_all(brokers)


# -- drain ------------------------------------------------------------------------------------


async def test_sigterm_drains_connectors_to_the_other_brokers_and_loses_nothing(mesh3):
    """A producer on A streams numbered requests to a consumer on C while C drains: the
    consumer's connector moves, the drained broker exits 0, and with retry on failure
    (at-least-once; the reliable send of the delivery-guarantees issue will replace it)
    every number arrives -- nothing is lost."""
    a, b, c = mesh3
    consumer_conn = await meshbus.connect(c.address, server="consumer")
    producer_conn = await meshbus.connect(a.address, server="producer")
    extra = [await meshbus.connect(c.address, server=f"x{i}") for i in range(3)]
    try:
        consumer = await consumer_conn.register(instance=1)
        producer = await producer_conn.register()
        await wait_routes(mesh3, consumer.address)
        received: set[int] = set()

        async def consume() -> None:
            async for msg in consumer:
                received.add(int(msg.payload))
                await msg.reply(b"ok")

        consumer_task = asyncio.create_task(consume())
        count = 400

        async def produce() -> None:
            for i in range(count):
                while True:
                    try:
                        await producer.request(consumer.address, b"%d" % i, timeout=1)
                        break
                    except (meshbus.Timeout, meshbus.NoRoute, meshbus.ConnectionLost):
                        await asyncio.sleep(0.01)
                if i == count // 4:
                    c.process.send_signal(signal.SIGTERM)

        await asyncio.wait_for(produce(), 60)
        assert received == set(range(count))
        assert await asyncio.wait_for(c.process.wait(), 20) == 0
        assert consumer_conn.moves == 1
        assert consumer_conn.failovers == 0, "a drain moves connectors; nothing fails"
        assert consumer_conn.broker_name in (a.name, b.name)
        counts = await connector_counts([a, b])
        assert sum(counts.values()) == 5  # the 4 from C, and the producer
        for survivor in (a, b):
            data = await stat(survivor, detail=False)
            assert data["mesh_counters"]["peers_crashed"] == 0, "a drain is not a crash"
            assert data["capacity"] == 50
        assert abs(counts[a.name] - counts[b.name]) <= 2
        consumer_task.cancel()
    finally:
        for conn in (consumer_conn, producer_conn, *extra):
            await conn.close()


async def test_drain_command_moves_connectors_and_stops_the_broker(mesh3):
    a, b, c = mesh3
    conn = await meshbus.connect(b.address, server="mover", keepalive=5)
    try:
        svc = await conn.register(instance=3)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "meshbus",
            "drain",
            "--broker",
            b.address,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, err.decode()
        assert f"broker {b.name}" in err.decode()
        assert "stopped" in err.decode()
        assert await asyncio.wait_for(b.process.wait(), 10) == 0
        assert conn.broker_name in (a.name, c.name)
        sender_conn = await meshbus.connect(a.address, server="sender", failover=False)
        sender = await sender_conn.register()
        await wait_routes([a, c], svc.address)
        await sender.send(svc.address, b"moved")
        await assert_next_is(svc, b"moved")
        await sender_conn.close()
    finally:
        await conn.close()


async def test_a_draining_broker_redirects_new_connectors_and_closes_stragglers_after_grace(
    mesh3,
):
    """A connector that ignores MOVE keeps its broker draining until the grace period
    ends; meanwhile a new connector is redirected elsewhere; then the broker closes
    the straggler and exits 0."""
    from tests.integration.helpers import RawLink

    a, b, c = mesh3
    b.process.kill()  # with B gone, A is the only broker a redirect can name
    await b.process.wait()
    straggler = await RawLink.open(c.address)
    try:
        await straggler.hello("straggler")
        await straggler.register("straggler", 1)
        drain = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "meshbus",
            "drain",
            "--broker",
            c.address,
            "--grace",
            "3",
            "--no-wait",
            stderr=asyncio.subprocess.PIPE,
        )
        assert await asyncio.wait_for(drain.wait(), 10) == 0
        async with await meshbus.connect(c.address, server="latecomer") as late:
            assert late.broker_name == a.name, "a draining broker takes no connector"
        assert c.process.returncode is None, "still draining, within its grace period"
        frames = await straggler.read_until_closed(timeout=10)
        assert any(getattr(f, "type", None) == ControlType.MOVE for f in frames)
        assert await asyncio.wait_for(c.process.wait(), 10) == 0
    finally:
        await straggler.close()


# -- join and rebalancing ---------------------------------------------------------------------


async def test_joining_broker_takes_its_share_within_one(mesh3):
    fleet = Fleet()
    try:
        for i, broker in enumerate(mesh3):
            for j in range(10):
                await fleet.add(broker.address, f"j{i}{j}", 1)
        assert set((await connector_counts(mesh3)).values()) == {10}
        newcomer = await start_broker("--seed", mesh3[0].address)
        brokers = [*mesh3, newcomer]
        try:

            async def balanced() -> bool:
                counts = await connector_counts(brokers)
                return (
                    sum(counts.values()) == 30 and max(counts.values()) - min(counts.values()) <= 1
                )

            await wait_until(balanced, "the spread to be within one", timeout=15)
            counts = await connector_counts(brokers)
            assert counts[newcomer.name] == 7
            # The brokers keep their connectors' lists current: everyone knows the newcomer.
            assert all(newcomer.address in conn.brokers for conn in fleet.conns)
            # Every service is still reachable, from every broker.
            for broker in brokers:
                probe_conn = await meshbus.connect(broker.address, server="p", failover=False)
                probe = await probe_conn.register()
                await reach_all(probe, [s.address for s in fleet.services])
                await probe_conn.close()
            assert sum(conn.moves for conn in fleet.conns) == 7
        finally:
            await stop_all([newcomer])
    finally:
        await fleet.close()


# -- capacity ---------------------------------------------------------------------------------


async def test_a_full_broker_redirects_to_one_with_room():
    brokers = await start_mesh(2, "--max-connectors", "2")
    a, b = brokers
    conns = []
    try:
        for i in range(4):
            conns.append(await meshbus.connect(a.address, server=f"cap{i}"))
        assert [c.broker_name for c in conns].count(a.name) == 2
        assert [c.broker_name for c in conns].count(b.name) == 2
        # Both full: a fifth is refused with a clear error.
        with pytest.raises(meshbus.ConnectionLost, match="full"):
            await meshbus.connect(a.address, server="cap5")
        # An operator still reaches the full broker itself, and is not counted.
        data = await stat(a, detail=False)
        assert (data["name"], data["connectors"]) == (a.name, 2)
        assert [link["role"] for link in data["links"]].count("operator") == 1
        async with await meshbus.connect(a.address, server="op", operator=True) as op:
            with pytest.raises(meshbus.RegistrationError, match="operator"):
                await op.register()
    finally:
        for conn in conns:
            await conn.close()
        await stop_all(brokers)


# -- meshbus mesh up ---------------------------------------------------------------------------


async def test_mesh_up_starts_a_working_mesh_and_ctrl_c_stops_it(tmp_path):
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshbus",
        "mesh",
        "up",
        "-n",
        "3",
        "--base-port",
        "0",
        "--data-dir",
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode().strip()
        addresses = line.split(",")
        assert len(addresses) == 3, line
        async with await meshbus.connect(addresses[0], server="up") as conn:
            data = await conn.stat(detail=False)
            assert len(data["peers"]) == 2
            assert sorted(conn.brokers) == sorted(addresses)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mesh-1", "mesh-2", "mesh-3"]
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err.decode()
        # The brokers' own stderr: stopping one by one, with peers up, is clean.
        assert "Traceback" not in err.decode()
        assert "peer broker lost" not in err.decode(), "a drain is not a crash"
        for address in addresses:
            host, port = address.rsplit(":", 1)
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(host, int(port))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_mesh_up_killed_with_kill_9_takes_its_brokers_with_it(tmp_path):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshbus", "mesh", "up", "-n", "2", "--base-port", "0",
        "--data-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode().strip()
        addresses = line.split(",")
        assert len(addresses) == 2, line
        process.kill()
        await process.wait()

        async def all_gone() -> bool:
            for address in addresses:
                host, port = address.rsplit(":", 1)
                try:
                    _, writer = await asyncio.open_connection(host, int(port))
                except OSError:
                    continue
                writer.close()
                return False
            return True

        await wait_until(all_gone, "the brokers of a killed mesh up to stop", timeout=5)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        kill_processes_naming(str(tmp_path))  # its brokers, should they outlive it


def kill_processes_naming(text: str) -> None:
    """kill -9 of every process whose command line has ``text`` in it."""
    found = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.slow  # 4000 services, so that moving them takes a while: ~13 s
async def test_a_move_that_comes_while_the_services_are_still_moving_is_carried_out() -> None:
    """B drains and moves its connector to C (A is nearly full, C has room); C is told to
    drain while the connector is still registering its services there. C's MOVE comes on
    a link that is not the connector's yet: it is carried out once that link takes over,
    so C empties and exits at once instead of waiting out its 30 s grace."""
    a = await start_broker("--max-connectors", "2")
    b, c = await asyncio.gather(
        start_broker("--seed", a.address), start_broker("--seed", a.address, "--drain-grace", "30")
    )
    brokers = [a, b, c]
    # Keepalives off or long: 4000 services on the move keep this process and the
    # brokers busy for seconds, which is not what this test is about.
    filler = await meshbus.connect(a.address, server="filler", failover=False, keepalive=0)
    conn = await meshbus.connect(b.address, server="mover", keepalive=5)
    watch_c = await meshbus.connect(c.address, server="watch", operator=True, keepalive=0)
    try:
        # Enough services that bringing them to C takes a while (~10^4 requests).
        services = list(await asyncio.gather(*(conn.register() for _ in range(4000))))
        for group in ("multicast:movers", "multicast:others"):
            await asyncio.gather(*(s.join(group) for s in services))
        drain_b = await meshbus.connect(b.address, server="op", operator=True, keepalive=0)
        await drain_b.drain_broker(grace=30)
        await drain_b.close()
        for _ in range(5000):  # the connector is on C, restoring: drain C now
            if (await watch_c.stat(detail=False))["connectors"]:
                break
            await asyncio.sleep(0.001)
        assert conn.moves == 0, "the first move finished before C was drained"
        await watch_c.drain_broker(grace=30)
        assert await asyncio.wait_for(c.process.wait(), 10) == 0
        assert await asyncio.wait_for(b.process.wait(), 10) == 0
        assert (conn.broker_name, conn.moves) == (a.name, 2)
        # Every service is still there, on A (a late ADD from C had undone them all).
        assert (await filler.stat(detail=False))["services"] == len(services)
        sender = await filler.register()
        await sender.send(services[-1].address, b"still here")
        await assert_next_is(services[-1], b"still here")
    finally:
        for link in (filler, conn, watch_c):
            await link.close()
        await stop_all(brokers)
