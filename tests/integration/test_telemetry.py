"""Broker telemetry on a real 2-broker mesh: records in telemetry.<broker> with the
traffic that went through, and every hop of traced sends in traces.<broker>."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

import meshbus
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import TraceReport
from meshbus.protocol.layout import ControlType
from tests.conftest import BrokerProcess, start_broker, start_mesh, stop_all
from tests.integration.helpers import Collector, RawLink, wait_until

INTERVAL = 0.2


@pytest.fixture
async def traced_mesh() -> AsyncIterator[list[BrokerProcess]]:
    """Two brokers recording telemetry every 0.2 s, connectors tracing every send."""
    brokers = await start_mesh(2, "--telemetry-interval", str(INTERVAL), "--trace-sample", "1")
    try:
        yield brokers
    finally:
        assert await stop_all(brokers) == [0, 0]


async def records(conn: meshbus.Connector, stream: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while page := await conn.streams.fetch(stream, len(out) + 1, 1000):
        out += [json.loads(m.payload) for m in page]
    return out


async def test_brokers_record_telemetry_and_every_hop_of_traced_sends(
    traced_mesh: list[BrokerProcess],
) -> None:
    a, b = traced_mesh
    sender_conn = await meshbus.connect(a.address, server="tsend", failover=False)
    receiver_conn = await meshbus.connect(b.address, server="trecv", failover=False)
    try:
        sender, local_receiver = await sender_conn.register(), await sender_conn.register()
        remote_receiver = await receiver_conn.register()
        collectors = [Collector(local_receiver), Collector(remote_receiver)]
        for i in range(20):
            await sender.send(remote_receiver.address, b"cross %d" % i)
            await sender.send(local_receiver.address, b"same %d" % i)
        for collector in collectors:
            await collector.wait_for(20)
        assert all(
            m.payload.startswith((b"cross", b"same")) for c in collectors for m in c.messages
        )

        names = {s["name"]: s["broker"] for s in await sender_conn.streams.list()}
        assert names == {
            f"telemetry.{a.name}": a.name,
            f"traces.{a.name}": a.name,
            f"telemetry.{b.name}": b.name,
            f"traces.{b.name}": b.name,
        }

        async def all_hops_stored() -> bool:
            hops = await records(sender_conn, f"traces.{a.name}")
            hops += await records(sender_conn, f"traces.{b.name}")
            return len(hops) == 40 * 3  # entry, exit, received per message

        await wait_until(all_hops_stored, "120 trace records", timeout=10)
        hops = await records(sender_conn, f"traces.{a.name}")
        hops += await records(sender_conn, f"traces.{b.name}")
        by_message: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for hop in hops:
            by_message.setdefault((hop["src"], hop["msg_id"]), {})[hop["hop"]] = hop
        assert len(by_message) == 40
        paths = {"same": 0, "cross": 0}
        for message in by_message.values():
            entry, exit_, received = message["entry"], message["exit"], message["received"]
            assert entry["broker"] == a.name  # the sender's broker
            assert exit_["broker"] == (
                a.name if exit_["dst"] == str(local_receiver.address) else b.name
            )
            assert received["broker"] == exit_["broker"]  # reported to the receiver's broker
            assert received["sent_at"] <= entry["at"] <= exit_["at"] <= received["at"]
            paths["same" if entry["broker"] == exit_["broker"] else "cross"] += 1
        assert paths == {"same": 20, "cross": 20}

        async def two_records_since() -> bool:
            return len(await records(sender_conn, f"telemetry.{a.name}")) >= 2

        await wait_until(two_records_since, "two telemetry records", timeout=10)
        telemetry = await records(sender_conn, f"telemetry.{a.name}")
        last = telemetry[-1]
        assert last["broker"] == a.name
        assert last["connectors"] == 1
        assert last["counters"]["msgs_in"] >= 40
        assert [t["at"] for t in telemetry] == sorted(t["at"] for t in telemetry)
        kinds = {link["kind"] for link in last["links"]}
        assert kinds == {"connector", "peer"}
        connector = next(link for link in last["links"] if link["kind"] == "connector")
        assert connector["name"] == "tsend"
        assert connector["msgs_in"] >= 40
        # How a saw the mesh: b with b's connector, and the joins -- its own, then b's.
        assert last["peers"] == [
            {"name": b.name, "address": b.address, "connectors": 1, "draining": False}
        ]
        seen = [(e["kind"], e["broker"]) for t in telemetry for e in t["events"]]
        assert seen == [("join", a.name), ("join", b.name)]
    finally:
        await sender_conn.close()
        await receiver_conn.close()


async def test_without_telemetry_nothing_is_traced_or_stored(mesh2: list[BrokerProcess]) -> None:
    a, _ = mesh2
    async with await meshbus.connect(a.address, server="quiet") as conn:
        assert conn._parts.sampler.every == 0
        assert await conn.streams.list() == []


async def test_a_trace_report_counts_only_for_an_address_of_the_reporting_link() -> None:
    """TRACE names the address that received a traced frame: a connector may report only
    its own, not put hops into the trace of another service's traffic."""
    broker = await start_broker("--telemetry-interval", str(INTERVAL), "--trace-sample", "1")
    raw = await RawLink.open(broker.address)
    try:
        async with await meshbus.connect(broker.address, server="victim") as conn:
            victim = await conn.register()
            await raw.hello()
            own = await raw.register("liar")
            for msg_id, dst in ((666, victim.address.to_bytes()), (777, own)):
                report = TraceReport(src=own, msg_id=msg_id, dst=dst, sent_at=1.0)
                await raw.send(encode_control(ControlType.TRACE, report, 0))
            await raw.ping()

            stream = f"traces.{broker.name}"

            async def own_hop_stored() -> bool:
                return any(hop["msg_id"] == 777 for hop in await records(conn, stream))

            await wait_until(own_hop_stored, "the hop of its own address", timeout=10)
            hops = await records(conn, stream)
            assert [hop["msg_id"] for hop in hops if hop["hop"] == "received"] == [777]
    finally:
        await raw.close()
        assert await broker.stop() == 0
