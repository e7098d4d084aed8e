"""``meshbus report`` end to end: real brokers, real streams, the command with its Spark
job, and the HTML and JSON it writes.

The command runs in this process (click's CliRunner, in a thread: the test's event loop
keeps serving the bus) and uses the suite's SparkSession, which ``local_spark`` started
exactly as the command starts its own -- a second JVM would add 20 s to the suite.

Until the brokers write telemetry themselves (``meshbus broker --telemetry-interval``),
``write_telemetry`` does it: it creates ``telemetry.<broker>`` and ``traces.<broker>`` on
each broker and publishes records as a broker would. The expected numbers are computed
here, in plain Python, from what the streams hold (``expected``), so switching to the
brokers' own telemetry means replacing ``write_telemetry`` (and dropping ``KNOWN``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from pyspark.sql import SparkSession

import meshbus
from meshbus.report.cli import report
from meshbus.report.job import _first_at
from tests.conftest import BrokerProcess

pytestmark = [pytest.mark.spark, pytest.mark.slow]


async def report_cli(*args: str) -> Result:
    """``meshbus report ARGS`` in a thread; no traceback, whatever the outcome."""
    result = await asyncio.to_thread(
        CliRunner().invoke, report, list(args), prog_name="meshbus report"
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


# -- the stand-in for the brokers' own telemetry ---------------------------------------------

# Per broker index: msgs_in, timeouts, dropped_no_route and connectors of six samples a
# second apart; broker 1 restarts before its fifth sample.
SAMPLES = {
    0: ([0, 100, 200, 300, 400, 500], [0] * 6, [0, 0, 2, 2, 5, 5], [2, 2, 3, 3, 3, 3]),
    1: ([0, 40, 80, 120, 10, 50], [0, 0, 1, 1, 0, 2], [0] * 6, [1, 1, 0, 0, 1, 1]),
}
KNOWN = {  # what the synthetic records make, worked out by hand
    "mean_msgs_in_per_s": [100.0, (40 * 3 + 10 + 40) / 5],
    "timeouts": [0, 3],
    "dropped_no_route": [5, 0],
    "connectors": [3, 1],
    "same_ms": [1, 3, 5, 7, 9, 11, 13, 15, 17, 19],
    "cross_ms": [12, 14, 16, 18, 20, 22, 24, 26, 28, 30],
}


async def publish(broker: BrokerProcess, stream: str, records: list[dict[str, Any]]) -> None:
    """``stream`` on ``broker`` with ``records`` as its JSON messages, stored when this returns."""
    async with await meshbus.connect(broker.address, server="telem") as conn:
        capture = f"multicast:{stream[:2]}.{broker.port}"  # group names are <= 15 bytes
        await conn.streams.add(stream, capture)
        publisher = await conn.register()
        for record in records:
            await publisher.send(capture, json.dumps(record).encode(), reliable=True)
        await conn.wait_acked(30)


async def write_telemetry(brokers: list[BrokerProcess]) -> None:
    """Six telemetry samples per broker ending now, and traces of 20 messages that enter
    the mesh at broker 0: odd ones received at broker 0 after i ms, even ones at broker 1
    after 10 + i ms."""
    now = time.time()
    for index, broker in enumerate(brokers):
        msgs_in, timeouts, no_route, connectors = SAMPLES[index]
        records = [
            {
                "broker": broker.name,
                "at": now - 6 + i,
                "interval": 1.0,
                "connectors": connectors[i],
                "services": 4,
                "routes": 9,
                "pending": 0,
                "counters": {
                    "msgs_in": msgs_in[i],
                    "msgs_out": 2 * msgs_in[i],
                    "requests": 0,
                    "timeouts": timeouts[i],
                    "late_responses": 0,
                    "dropped_no_route": no_route[i],
                    "dropped_too_large": 0,
                    "dropped_bad_hop": 0,
                },
                "links": [],
            }
            for i in range(6)
        ]
        await publish(broker, f"telemetry.{safe(broker.name)}", records)
    hops: dict[str, list[dict[str, Any]]] = {b.name: [] for b in brokers}
    entry = brokers[0].name
    for i in range(1, 21):
        sent = now - 5 + i / 10
        receiver = brokers[0].name if i % 2 else brokers[1].name
        received = sent + (i if i % 2 else 10 + i) / 1000
        msg = {"src": "game01:1", "msg_id": i, "dst": "multicast:chat", "sent_at": None}
        hops[entry].append({**msg, "hop": "entry", "broker": entry, "at": sent + 0.0001})
        hops[receiver].append({**msg, "hop": "exit", "broker": receiver, "at": received - 0.0001})
        hops[receiver].append(
            {**msg, "hop": "received", "broker": receiver, "at": received, "sent_at": sent}
        )
    for broker in brokers:
        await publish(broker, f"traces.{safe(broker.name)}", hops[broker.name])


# -- the oracle: the numbers from the streams, in plain Python ---------------------------------


async def read_records(address: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    async with await meshbus.connect(address, server="check", operator=True) as conn:
        found = {}
        for entry in await conn.streams.list():
            if str(entry["name"]).startswith(prefix):
                messages = await conn.streams.fetch(entry["name"], 1, 10_000)
                found[entry["name"]] = [json.loads(m.payload) for m in messages]
        return found


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    rank = fraction * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def expected(address: str) -> dict[str, Any]:
    per_broker: dict[str, dict[str, Any]] = {}
    for records in (await read_records(address, "telemetry.")).values():
        records.sort(key=lambda r: r["at"])
        totals = {"msgs_in": 0, "timeouts": 0, "dropped_no_route": 0}
        seconds = 0.0
        for prev, cur in itertools.pairwise(records):
            restart = any(cur["counters"][c] < prev["counters"][c] for c in cur["counters"])
            seconds += (
                min(cur["interval"], cur["at"] - prev["at"])
                if restart
                else (cur["at"] - prev["at"])
            )
            for counter in totals:
                now, before = cur["counters"][counter], prev["counters"][counter]
                totals[counter] += now if restart else now - before
        per_broker[records[0]["broker"]] = {
            "mean_msgs_in_per_s": totals["msgs_in"] / seconds,
            "timeouts": totals["timeouts"],
            "dropped_no_route": totals["dropped_no_route"],
            "connectors": records[-1]["connectors"],
        }
    hops = [h for records in (await read_records(address, "traces.")).values() for h in records]
    entries = {(h["src"], h["msg_id"]): h["broker"] for h in hops if h["hop"] == "entry"}
    paths: dict[str, list[float]] = {"same broker": [], "cross broker": []}
    for hop in hops:
        if hop["hop"] == "received" and hop["sent_at"] is not None:
            same = entries[(hop["src"], hop["msg_id"])] == hop["broker"]
            ms = (hop["at"] - hop["sent_at"]) * 1000
            paths["same broker" if same else "cross broker"].append(ms)
    return {"brokers": per_broker, "latency": paths}


# -- the tests -------------------------------------------------------------------------------


async def test_report_end_to_end(
    spark: SparkSession, mesh2: list[BrokerProcess], tmp_path: Path
) -> None:
    await write_telemetry(mesh2)
    out, data_file = tmp_path / "report.html", tmp_path / "report.json"
    addresses = ",".join(b.address for b in mesh2)
    result = await report_cli(
        "--brokers", addresses, "--out", str(out), "--json", str(data_file), "--since", "3600"
    )
    assert result.exit_code == 0, result.output
    assert "found 2 telemetry streams (12 records)" in result.stderr, result.stderr
    assert "wrote" in result.stderr

    page = out.read_text()
    assert page.count('<img src="data:image/png;base64,') == 4
    for heading in ("Brokers", "Throughput", "Latency", "Connectors", "Drops and timeouts"):
        assert f"<h2>{heading}</h2>" in page
    assert page.count("<table>") >= 6
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from elsewhere
    assert "<script" not in page

    data = json.loads(data_file.read_text())
    want = await expected(mesh2[0].address)
    names = [b.name for b in mesh2]
    summary = {s["broker"]: s for s in data["throughput"]["summary"]}
    totals = {t["broker"]: t for t in data["errors"]["totals"]}
    brokers = {b["broker"]: b for b in data["brokers"]}
    assert sorted(brokers) == sorted(names)
    for index, name in enumerate(names):
        oracle = want["brokers"][name]
        assert summary[name]["mean_msgs_in_per_s"] == pytest.approx(oracle["mean_msgs_in_per_s"])
        assert totals[name]["timeouts"] == oracle["timeouts"]
        assert totals[name]["dropped_no_route"] == oracle["dropped_no_route"]
        assert brokers[name]["connectors"] == oracle["connectors"]
        for key in ("mean_msgs_in_per_s", "timeouts", "dropped_no_route", "connectors"):
            assert oracle[key] == pytest.approx(KNOWN[key][index])
    assert brokers[names[1]]["restarts"] == 1

    stats = {p["path"]: p for p in data["latency"]["percentiles"]}
    for path, values in want["latency"].items():
        assert stats[path]["count"] == len(values)
        for key, fraction in (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99)):
            assert stats[path][key] == pytest.approx(percentile(values, fraction), abs=1e-3)
        assert stats[path]["max_ms"] == pytest.approx(max(values), abs=1e-3)
    assert sorted(want["latency"]["same broker"]) == pytest.approx(KNOWN["same_ms"], abs=1e-3)
    assert sorted(want["latency"]["cross broker"]) == pytest.approx(KNOWN["cross_ms"], abs=1e-3)


async def test_since_finds_the_first_message_stored_after(broker: BrokerProcess) -> None:
    async with await meshbus.connect(broker.address, server="pub") as conn:
        await conn.streams.add("telemetry.t", "multicast:tt")
        publisher = await conn.register()
        for i in range(7):
            await publisher.send_reliable("multicast:tt", b"%d" % i)
            await asyncio.sleep(0.02)
        stored = {m.seq: m.stored_at for m in await conn.streams.fetch("telemetry.t", 1, 10)}
        assert await _first_at(conn, "telemetry.t", stored[5]) == 5
        assert await _first_at(conn, "telemetry.t", stored[5] - 0.001) == 5
        assert await _first_at(conn, "telemetry.t", 0) == 1
        assert await _first_at(conn, "telemetry.t", stored[7] + 1) == 8


async def test_report_on_the_brokers_own_telemetry(spark: SparkSession, tmp_path: Path) -> None:
    """No stand-in: three brokers record telemetry and trace every send. The report counts
    exactly the sends of each path. Then one broker is killed (SIGKILL) and its two
    connectors fail over: the report lists it as unreachable, marks its crash, and counts
    the mesh's 4 connectors before the kill and after the failover."""
    from tests.conftest import start_mesh, stop_all
    from tests.integration.helpers import wait_until

    interval = 0.2
    started_at = time.time()
    brokers = await start_mesh(3, "--telemetry-interval", str(interval), "--trace-sample", "1")
    conns: list[meshbus.Connector] = []
    try:
        a, b, doomed = brokers
        sender_conn = await meshbus.connect(a.address, server="rsend", failover=False)
        receiver_conn = await meshbus.connect(b.address, server="rrecv", failover=False)
        movers = [await meshbus.connect(doomed.address, server=f"rmove{i}") for i in range(2)]
        conns = [sender_conn, receiver_conn, *movers]
        connected_at = time.time()
        sender, near = await sender_conn.register(), await sender_conn.register()
        far = await receiver_conn.register()
        for i in range(15):
            await sender.send(near.address, b"same %d" % i)
            await sender.send(far.address, b"cross %d" % i)
        for service in (near, far):
            for _ in range(15):
                await service.recv(timeout=5)

        async def hops() -> int:
            infos = [await sender_conn.streams.info(f"traces.{x.name}") for x in (a, b)]
            return sum(info.messages for info in infos)

        for _ in range(100):  # every hop stored: 30 sends x (entry, exit, received)
            if await hops() == 90:
                break
            await asyncio.sleep(0.1)
        assert await hops() == 90
        await asyncio.sleep(5 * interval)  # records of the mesh before the kill

        killed_before = time.time()
        doomed.process.kill()
        await doomed.process.wait()
        killed_after = time.time()

        async def failed_over() -> bool:
            return all(m.broker_address in (a.address, b.address) for m in movers)

        await wait_until(failed_over, "both connectors of the killed broker failing over")
        settled_at = time.time()
        await asyncio.sleep(6 * interval)  # records of the mesh after the failover
        closed_at = time.time()
    finally:
        for conn in conns:
            await conn.close()
    try:
        out, data_file = tmp_path / "report.html", tmp_path / "report.json"
        addresses = ",".join(x.address for x in brokers)  # the killed one among them
        result = await report_cli(
            "--brokers", addresses, "--out", str(out), "--json", str(data_file)
        )
        assert result.exit_code == 0, result.output
        assert f"{doomed.address} did not answer" in result.stderr
    finally:
        await stop_all(brokers)
    data = json.loads(data_file.read_text())
    assert sorted(x["broker"] for x in data["brokers"]) == sorted([a.name, b.name])
    paths = {p["path"]: p["count"] for p in data["latency"]["percentiles"]}
    assert (paths["same broker"], paths["cross broker"]) == (15, 15)
    summary = {s["broker"]: s for s in data["throughput"]["summary"]}
    assert summary[a.name]["mean_msgs_in_per_s"] > 0

    # The killed broker: gone, last seen alive by the others between its start and when
    # they found it dead (its link's EOF, read right after the kill).
    [gone] = data["unreachable"]
    assert (gone["broker"], gone["address"], gone["how"]) == (doomed.name, doomed.address, "crash")
    assert gone["seen_by"] == sorted([a.name, b.name])
    assert "Connection refused" in gone["no_answer"]
    assert killed_before <= gone["lost_at"] <= killed_after + 1.5  # the heartbeat budget
    # heard from at every heartbeat (0.5 s), listed in every record (0.2 s)
    assert started_at < killed_before - 1.0 <= gone["last_seen"] <= gone["lost_at"]
    crashes = [e for e in data["events"] if e["kind"] == "crash"]
    assert [(e["broker"], e["seen_by"]) for e in crashes] == [
        (doomed.name, sorted([a.name, b.name]))
    ]
    assert crashes[0]["at"] == pytest.approx(gone["lost_at"], abs=1.5)
    joined = {e["broker"] for e in data["events"] if e["kind"] == "join"}
    assert joined == {a.name, b.name, doomed.name}

    # 4 connectors all along: 2 on a and b, 2 on the killed broker (as a and b heard from
    # it) until its crash, then on a or b. While they fail over, fewer; never more.
    totals = [(t["at"], t["connectors"]) for t in data["connectors"]["totals"]]
    before = [n for at, n in totals if connected_at + 3 * interval <= at < killed_before]
    failing = [n for at, n in totals if killed_before <= at < settled_at + 3 * interval]
    after = [n for at, n in totals if settled_at + 3 * interval <= at < closed_at]
    assert set(before) == set(after) == {4}, totals
    assert min(len(before), len(after)) >= 2, totals
    assert all(n <= 4 for n in failing), totals

    page = out.read_text()
    assert page.count('<img src="data:image/png;base64,') == 4
    unreachable = page.split("<h2>Unreachable brokers</h2>")[1].split("<h2>")[0]
    assert f"<td>{doomed.name}</td><td>{doomed.address}</td>" in unreachable
    events = page.split("<h2>Mesh events</h2>")[1].split("<h2>")[0]
    assert f"<td>crash</td><td>{doomed.name}</td>" in events


async def test_report_signs_in_over_tls(spark: SparkSession, tmp_path: Path) -> None:
    """A broker with users and TLS: --creds and --tls-ca reach the discovery's connector
    and the Spark tasks' (certificates by trustme, the key by Credentials.generate)."""
    from tests.integration.helpers import start_secure_broker

    secure = await start_secure_broker(tmp_path, "ops", "--telemetry-interval", "0.2")
    broker, ca_file, creds = secure.process, secure.ca_file, secure.creds
    try:
        async with await meshbus.connect(
            broker.address, tls=str(ca_file), credentials=creds, operator=True
        ) as conn:
            for _ in range(100):  # a few telemetry records
                listed = {str(e["name"]) for e in await conn.streams.list()}
                stream = f"telemetry.{broker.name}"
                if stream in listed and (await conn.streams.info(stream)).messages >= 3:
                    break
                await asyncio.sleep(0.1)
        out, data_file = tmp_path / "report.html", tmp_path / "report.json"
        access = ("--creds", str(creds), "--tls-ca", str(ca_file))
        result = await report_cli(
            "--brokers", broker.address, *access, "--out", str(out), "--json", str(data_file)
        )
        assert result.exit_code == 0, result.output
    finally:
        assert await broker.stop() == 0
    data = json.loads(data_file.read_text())
    assert [x["broker"] for x in data["brokers"]] == [broker.name]
