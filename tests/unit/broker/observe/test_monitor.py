"""The monitoring endpoint (meshbus.broker.observe.monitor): the exposition of the broker's
counters from a fake source, and the tiny HTTP server's answers and bounds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshbus.auth import TokenHash
from meshbus.broker.observe.lag import LoopLag
from meshbus.broker.observe.monitor import (
    DROP_REASONS,
    BrokerCollector,
    MonitorLimits,
    MonitorServer,
    StreamReading,
    monitor_registry,
)

# Real sockets and timers, not meshbus.testing's simulated loop (tests/unit/conftest.py).
pytestmark = pytest.mark.real_loop


def fake_stat() -> dict[str, Any]:
    """What StatView.brief returns, reduced to what the collector reads."""
    counters: dict[str, Any] = {
        "msgs_in": 101,
        "msgs_out": 102,
        "requests": 7,
        "timeouts": 3,
        "late_responses": 1,
        "refused_control": 2,
        "pending": 4,
        "links_accepted": 9,
        "links_closed": {"bye": 5, "stalled": 1},
        "config_reloads": 6,
        "config_reloads_failed": 8,
    }
    for number, key in enumerate(DROP_REASONS, start=11):
        counters[key] = number
    return {
        "name": "b1",
        "ready": True,
        "draining": False,
        "uptime_s": 12.5,
        "connectors": 3,
        "services": 14,
        "routes": 20,
        "route_services": 15,
        "route_groups": 5,
        "peers": ["b2", "b3"],
        "capacity": 50,
        "max_connectors": 50,
        "groups_bound": 2,
        "handshaking": 7,
        "handshaking_sources": 3,
        "users": {
            "alice": {
                "connections": {"used": 2, "quota": 64},
                "stream_bytes": {"used": 0, "quota": None},
            }
        },
        "streams": {
            "stored": 40,
            "dropped": 41,
            "raft": {
                "syncs": 12,
                "sync_seconds": 0.25,
                "compactions": 7,
                "snapshots_installed": 1,
                "streams": {
                    "ledger": {  # led here
                        "leader": "b1",
                        "term": 3,
                        "commit_lag": 2,
                        "leader_changes": 2,
                        "log_entries": 300,
                        "replicas": [
                            {"broker": "b1", "state": "leader", "lag": 0},
                            {"broker": "b2", "state": "follower", "lag": 2},
                            {"broker": "b3", "state": "silent", "lag": 9},
                        ],
                    },
                    "audit": {  # led elsewhere: no replica states here
                        "leader": "b2",
                        "term": 1,
                        "commit_lag": 0,
                        "leader_changes": 1,
                        "log_entries": 5,
                        "replicas": [],
                    },
                },
            },
        },
        "mesh_counters": {"peers_lost": 1, "stalls": 0, "route_ops_in": 30},
        "counters": counters,
        "links": [
            {
                "id": 4,
                "name": "game",
                "role": "connector",
                "msgs_in": 31,
                "msgs_out": 32,
                "bytes_in": 3100,
                "bytes_out": 3200,
            },
            {
                "id": 5,
                "name": "meshbus-cli",
                "role": "operator",
                "msgs_in": 0,
                "msgs_out": 0,
                "bytes_in": 70,
                "bytes_out": 900,
            },
        ],
        "peer_links": [
            {
                "name": "b2",
                "link_id": 2,
                "msgs_in": 51,
                "msgs_out": 52,
                "bytes_in": 5100,
                "bytes_out": 5200,
                "rtt_ms": 0.25,
            },
            {  # linked, its round trip not timed yet
                "name": "b3",
                "link_id": 3,
                "msgs_in": 0,
                "msgs_out": 0,
                "bytes_in": 0,
                "bytes_out": 0,
                "rtt_ms": None,
            },
        ],
        "nats": {
            "clients": 2,
            "subscriptions": 3,
            "msgs_in": 61,
            "bytes_in": 6100,
            "msgs_out": 62,
            "bytes_out": 6200,
            "slow_consumers": 1,
            "errors": {"slow-consumer": 1, "invalid-subject": 2, "stale-connection": 0},
            "closed": {"slow-consumer": 1, "client-closed": 4},
            "mesh": {"msgs_to_peers": 70, "no_responders": 5},
        },
    }


def samples(lag: LoopLag | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    collector = BrokerCollector(
        stat=fake_stat,
        traffic_bytes=lambda: (1000, 2000),
        lag=lag or LoopLag(),
        streams=lambda: [StreamReading("orders", 5, 500), StreamReading("audit", 6, 600)],
    )
    text = generate_latest(monitor_registry(collector)).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_counter_is_exposed_with_its_value_and_broker_label() -> None:
    got = samples()
    b = (("broker", "b1"),)
    assert got[("meshbus_messages_in_total", b)] == 101
    assert got[("meshbus_messages_out_total", b)] == 102
    assert got[("meshbus_bytes_in_total", b)] == 1000
    assert got[("meshbus_bytes_out_total", b)] == 2000
    assert got[("meshbus_requests_total", b)] == 7
    assert got[("meshbus_timeouts_total", b)] == 3
    assert got[("meshbus_pending_requests", b)] == 4
    assert got[("meshbus_routes", b)] == 20
    assert got[("meshbus_connectors", b)] == 3
    assert got[("meshbus_services", b)] == 14
    assert got[("meshbus_peers", b)] == 2
    assert got[("meshbus_groups_bound", b)] == 2
    assert got[("meshbus_handshaking", b)] == 7
    assert got[("meshbus_handshaking_sources", b)] == 3
    assert got[("meshbus_ready", b)] == 1
    assert got[("meshbus_draining", b)] == 0
    assert got[("meshbus_stream_captured_total", b)] == 40
    assert got[("meshbus_links_closed_total", (("broker", "b1"), ("reason", "bye")))] == 5
    assert got[("meshbus_mesh_events_total", (("broker", "b1"), ("event", "peers_lost")))] == 1
    assert got[("meshbus_stream_messages", (("broker", "b1"), ("stream", "orders")))] == 5
    assert got[("meshbus_stream_bytes", (("broker", "b1"), ("stream", "audit")))] == 600


def test_the_nats_clients_traffic_and_errors_by_kind() -> None:
    got = samples()
    b = (("broker", "b1"),)
    assert got[("meshbus_nats_clients", b)] == 2
    assert got[("meshbus_nats_subscriptions", b)] == 3
    assert got[("meshbus_nats_messages_in_total", b)] == 61
    assert got[("meshbus_nats_bytes_in_total", b)] == 6100
    assert got[("meshbus_nats_messages_out_total", b)] == 62
    assert got[("meshbus_nats_bytes_out_total", b)] == 6200
    assert got[("meshbus_nats_slow_consumers_total", b)] == 1

    def by(label: str, value: str) -> tuple[tuple[str, str], ...]:
        return (("broker", "b1"), (label, value))

    assert got[("meshbus_nats_errors_total", by("kind", "invalid-subject"))] == 2
    assert got[("meshbus_nats_errors_total", by("kind", "stale-connection"))] == 0
    assert got[("meshbus_nats_closed_total", by("reason", "client-closed"))] == 4
    assert got[("meshbus_nats_mesh_events_total", by("event", "no_responders"))] == 5


def test_every_open_link_has_its_traffic_with_its_kind_name_and_id() -> None:
    got = samples()

    def link(kind: str, name: str, number: int) -> tuple[tuple[str, str], ...]:
        return (("broker", "b1"), ("id", str(number)), ("kind", kind), ("name", name))

    game, cli, peer = (
        link("connector", "game", 4),
        link("operator", "meshbus-cli", 5),
        link("peer", "b2", 2),
    )
    assert got[("meshbus_link_messages_in_total", game)] == 31
    assert got[("meshbus_link_messages_out_total", game)] == 32
    assert got[("meshbus_link_bytes_in_total", game)] == 3100
    assert got[("meshbus_link_bytes_out_total", game)] == 3200
    assert got[("meshbus_link_bytes_out_total", cli)] == 900
    assert got[("meshbus_link_messages_in_total", peer)] == 51
    assert got[("meshbus_link_bytes_out_total", peer)] == 5200
    series = {labels for name, labels in got if name == "meshbus_link_messages_in_total"}
    assert series == {game, cli, peer, link("peer", "b3", 3)}


def test_each_configured_users_usage_and_quotas_are_gauges() -> None:
    got = samples()

    def labels(quota: str) -> tuple[tuple[str, str], ...]:
        return (("broker", "b1"), ("quota", quota), ("user", "alice"))

    assert got[("meshbus_user_usage", labels("connections"))] == 2
    assert got[("meshbus_user_quota", labels("connections"))] == 64
    assert got[("meshbus_user_usage", labels("stream_bytes"))] == 0
    assert ("meshbus_user_quota", labels("stream_bytes")) not in got, "no quota, no series"


def test_a_peers_heartbeat_round_trip_is_a_gauge_once_timed() -> None:
    got = samples()
    assert got[("meshbus_peer_rtt_seconds", (("broker", "b1"), ("peer", "b2")))] == 0.00025
    assert ("meshbus_peer_rtt_seconds", (("broker", "b1"), ("peer", "b3"))) not in got


def test_every_drop_counter_has_its_reason_label() -> None:
    got = samples()
    for number, reason in enumerate(DROP_REASONS.values(), start=11):
        assert got[("meshbus_dropped_total", (("broker", "b1"), ("reason", reason)))] == number
    assert got[("meshbus_dropped_total", (("broker", "b1"), ("reason", "stream_capture")))] == 41


def test_loop_lag_is_a_histogram_of_the_probe_buckets() -> None:
    lag = LoopLag()
    for _ in range(3):
        lag.record(0.0004, 0.0004)  # the 1 ms bucket
    lag.record(0.015, 0.001)  # the 20 ms bucket
    lag.record(30.0, 0.0)  # past every bound
    got = samples(lag)
    b = "broker", "b1"

    def bucket(le: str) -> float:
        return got[("meshbus_loop_lag_seconds_bucket", (b, ("le", le)))]

    assert bucket("0.001") == 3
    assert bucket("0.01") == 3
    assert bucket("0.02") == 4
    assert bucket("10.0") == 4
    assert bucket("+Inf") == 5
    assert got[("meshbus_loop_lag_seconds_count", (b,))] == 5
    assert got[("meshbus_loop_lag_seconds_sum", (b,))] == pytest.approx(30.0162)
    assert got[("meshbus_loop_lag_max_seconds", (b,))] == pytest.approx(30.0)
    assert got[("meshbus_loop_lag_max_own_seconds", (b,))] == pytest.approx(0.001)


def test_the_process_collector_gives_rss_and_open_files() -> None:
    got = samples()
    assert got[("process_resident_memory_bytes", ())] > 0
    assert got[("process_open_fds", ())] > 0


# -- the HTTP server ------------------------------------------------------------------

TOKEN = "s3cret-token"


class State:
    value = "ready"


@pytest.fixture
async def server() -> AsyncIterator[tuple[MonitorServer, State]]:
    collector = BrokerCollector(
        stat=fake_stat, traffic_bytes=lambda: (0, 0), lag=LoopLag(), streams=list
    )
    state = State()
    monitor = MonitorServer(
        registry=monitor_registry(collector, process=False),
        health=lambda: state.value,
        varz=fake_stat,
        token=TokenHash.of(TOKEN),
        limits=MonitorLimits(max_request=1024, max_headers=4, max_connections=2, read_timeout=1),
    )
    await monitor.start("127.0.0.1", 0)
    yield monitor, state
    await monitor.stop()


async def exchange(address: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request``; the status and body of the answer, read until the server closes."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: the server closed
    writer.close()
    await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def get(path: str, *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: x", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_healthz_is_ok_when_ready_and_503_with_the_state_otherwise(
    server: tuple[MonitorServer, State],
) -> None:
    monitor, state = server
    assert await exchange(monitor.address, get("/healthz")) == (200, b"ok\n")
    for value in ("joining", "draining"):
        state.value = value
        assert await exchange(monitor.address, get("/healthz")) == (503, f"{value}\n".encode())


async def test_metrics_and_varz_need_the_token(server: tuple[MonitorServer, State]) -> None:
    monitor, _ = server
    assert (await exchange(monitor.address, get("/metrics")))[0] == 401
    wrong = get("/metrics", "Authorization: Bearer nope")
    assert (await exchange(monitor.address, wrong))[0] == 401
    good = f"Authorization: Bearer {TOKEN}"
    for _ in range(2):  # the second is checked against the remembered token
        status, body = await exchange(monitor.address, get("/metrics", good))
        assert status == 200
        assert b'meshbus_messages_in_total{broker="b1"} 101.0' in body
    status, body = await exchange(monitor.address, get("/varz?x=1", good))
    assert status == 200
    assert b'"msgs_in":101' in body


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"garbage\r\n\r\n",
        b"GET /healthz\r\n\r\n",
        get("/healthz", "no-colon-here"),
        get("/healthz", *(f"X-{i}: y" for i in range(5))),  # past max_headers (4 + Host)
        get("/healthz", "X-Big: " + "y" * 2000),  # past max_request
        b"GET /healthz HTTP/1.1\r\nHost: \xff\r\n\r\n",
    ],
)
async def test_a_bad_request_gets_400_and_the_connection_closes(
    server: tuple[MonitorServer, State], request_bytes: bytes
) -> None:
    monitor, _ = server
    status, body = await exchange(monitor.address, request_bytes)
    assert (status, body) == (400, b"bad request\n")


async def test_only_get_is_served_and_unknown_paths_are_404(
    server: tuple[MonitorServer, State],
) -> None:
    monitor, _ = server
    post = b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    assert (await exchange(monitor.address, post))[0] == 405
    assert (await exchange(monitor.address, get("/nope")))[0] == 404


async def test_connections_past_the_limit_get_503_and_idle_ones_are_closed(
    server: tuple[MonitorServer, State],
) -> None:
    monitor, _ = server
    host, port = monitor.address.rsplit(":", 1)
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
    await asyncio.sleep(0.1)
    # Answered at once, before it sends anything.
    reader, writer = await asyncio.open_connection(host, int(port))
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert answer.endswith(b"too many monitor connections\n")
    # The idle ones are closed after read_timeout (1 s), and the slots are free again.
    for reader, writer in idle:
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await writer.wait_closed()
    assert await exchange(monitor.address, get("/healthz")) == (200, b"ok\n")


def test_replicated_streams_commit_lag_leaders_and_fsync_time() -> None:
    got = samples()
    b = (("broker", "b1"),)
    ledger = (("broker", "b1"), ("stream", "ledger"))
    audit = (("broker", "b1"), ("stream", "audit"))
    assert got[("meshbus_raft_sync_seconds_count", b)] == 12
    assert got[("meshbus_raft_sync_seconds_sum", b)] == 0.25
    assert got[("meshbus_raft_commit_lag", ledger)] == 2
    assert got[("meshbus_raft_leader", ledger)] == 1
    assert got[("meshbus_raft_leader", audit)] == 0
    assert got[("meshbus_raft_leader_changes_total", audit)] == 1
    assert got[("meshbus_raft_log_entries", ledger)] == 300
    assert got[("meshbus_raft_compactions_total", b)] == 7
    assert got[("meshbus_raft_snapshots_installed_total", b)] == 1
    lags = {
        dict(labels)["replica"]: value
        for (metric, labels), value in got.items()
        if metric == "meshbus_raft_replica_lag"
    }
    assert lags == {"b1": 0, "b2": 2, "b3": 9}
