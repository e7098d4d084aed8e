"""NATS clients in the operator's view, read from real brokers with real clients
connected (docs/nats.md, "What stat and /metrics show"): ``meshbus stat --json``,
``meshbus top --once`` and the Prometheus ``/metrics`` of ``--monitor``, all three with
the same figures -- clients, subscriptions, messages and bytes in and out, the mesh's
NATS traffic, slow consumers and errors by kind."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.nats_py import flushed
from tests.conftest import stop_all
from tests.integration.helpers import free_port
from tests.integration.test_cli import run_cli
from tests.integration.test_monitor import http_get
from tests.integration.test_nats_listener import QUIET, RawNats, flood, slow_consumer
from tests.integration.test_nats_mesh import Inbox, NatsBroker, _start, client

SIZE = 100  # bytes of each message published


@pytest.fixture
async def watched() -> AsyncIterator[tuple[NatsBroker, NatsBroker, str]]:
    """Two brokers in one mesh; the first with its monitor (at the address returned)
    and 1 MiB of unsent output per client at most."""
    monitor = f"127.0.0.1:{free_port()}"
    first = await _start("--monitor", monitor, "--max-pending-bytes", str(1 << 20))
    brokers = [first]
    try:
        brokers.append(await _start("--seed", first.process.address))
        yield first, brokers[1], monitor
    finally:
        assert await stop_all([b.process for b in brokers]) == [0, 0]


async def stat(broker: NatsBroker) -> dict[str, Any]:
    """The ``nats`` part of ``meshbus stat --json``."""
    result = await run_cli("stat", "--broker", broker.process.address, "--json")
    assert result.code == 0, result.err
    nats: dict[str, Any] = json.loads(result.out)["nats"]
    return nats


def metrics(monitor: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = http_get(f"http://{monitor}/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "broker"))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name.startswith("meshbus_nats_")
    }


async def test_stat_top_and_metrics_show_the_nats_clients(
    watched: tuple[NatsBroker, NatsBroker, str],
) -> None:
    a, b, monitor = watched
    async with (
        client(a, name="feed") as publisher,
        client(a, name="reader") as reader,
        client(b, name="far") as far,
    ):
        near, remote = Inbox(), Inbox()
        await reader.subscribe("orders.*", cb=near.take)
        await reader.subscribe("audit", cb=near.take)
        await far.subscribe("orders.new", cb=remote.take)
        await flushed(reader, far)
        for _ in range(10):
            await publisher.publish("orders.new", b"x" * SIZE)
        await publisher.flush()
        await near.wait_for(10)
        await remote.wait_for(10)

        here = await stat(a)
        assert here["listen"] == a.netloc
        assert here["connect_urls"] == [a.netloc, b.netloc]
        assert (here["clients"], here["subscriptions"]) == (2, 2)
        assert (here["msgs_in"], here["bytes_in"]) == (10, 10 * SIZE)
        assert (here["msgs_out"], here["bytes_out"]) == (10, 10 * SIZE)
        assert here["mesh"]["msgs_to_peers"] == 10  # one copy for b's one subscription
        by_name = {c["name"]: c for c in here["connections"]}
        assert (by_name["feed"]["msgs_in"], by_name["feed"]["subscriptions"]) == (10, 0)
        assert (by_name["reader"]["msgs_out"], by_name["reader"]["subscriptions"]) == (10, 2)
        assert by_name["reader"]["lang"] == "python3"
        assert set(here["errors"].values()) == {0}
        there = await stat(b)
        assert (there["clients"], there["msgs_out"]) == (1, 10)
        assert there["mesh"]["msgs_from_peers"] == 10

        # An -ERR that leaves the connection open, then a slow consumer closed.
        raw = await RawNats.open(a.port, QUIET)
        await raw.send(b"SUB orders..new 1\r\n")
        assert await raw.line() == b"-ERR 'Invalid Subject'"
        await raw.pong()
        slow = await slow_consumer(a.port)
        await flood(publisher, slow)
        await slow.close()
        here = await stat(a)
        assert here["clients"] == 3  # feed, reader and raw: the slow one is gone
        assert here["slow_consumers"] == 1
        errors = {k: v for k, v in here["errors"].items() if v}
        assert errors == {"invalid-subject": 1, "slow-consumer": 1}
        assert here["closed"] == {"slow-consumer": 1}
        assert here["msgs_in"] == 10 + 160
        # What the slow one was given before it was closed stays counted.
        assert here["msgs_out"] > 10

        scraped = metrics(monitor)
        assert scraped[("meshbus_nats_clients", ())] == 3
        assert scraped[("meshbus_nats_subscriptions", ())] == 2
        assert scraped[("meshbus_nats_messages_in_total", ())] == here["msgs_in"]
        assert scraped[("meshbus_nats_bytes_in_total", ())] == here["bytes_in"]
        assert scraped[("meshbus_nats_messages_out_total", ())] == here["msgs_out"]
        assert scraped[("meshbus_nats_bytes_out_total", ())] == here["bytes_out"]
        assert scraped[("meshbus_nats_slow_consumers_total", ())] == 1
        assert scraped[("meshbus_nats_errors_total", (("kind", "invalid-subject"),))] == 1
        assert scraped[("meshbus_nats_errors_total", (("kind", "stale-connection"),))] == 0
        assert scraped[("meshbus_nats_closed_total", (("reason", "slow-consumer"),))] == 1
        event = (("event", "msgs_to_peers"),)
        assert scraped[("meshbus_nats_mesh_events_total", event)] == 10

        top = await run_cli("top", "--once", "--broker", a.process.address, "--interval", "0.2")
        assert top.code == 0, top.err
        header, *rows = top.out.splitlines()
        nats = header.split().index("NATS")
        clients = {row.split()[0]: row.split()[nats] for row in rows}
        assert clients[a.process.name] == "3"
        assert clients[b.process.name] == "1"
        assert clients["total"] == "4"
        await raw.close()
