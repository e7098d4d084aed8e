"""Monitoring over HTTP (``meshbus broker --monitor HOST:PORT``): ``/metrics`` for
Prometheus, ``/healthz`` for a load balancer or an orchestrator, ``/varz`` for a person.

Nothing here runs per message. ``BrokerCollector`` reads the counters the broker keeps
anyway (the ones ``meshbus stat`` shows) when a scrape asks, and ``MonitorServer``
answers on the broker's own event loop: a tiny HTTP/1.1 server for GET only, one
request per connection, with every resource a client could make it hold bounded --
the request's size, its header count, the time to send it, and the connections open
at once. A bad request gets 400 and the connection closes. The metrics are listed in
docs/operations.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from meshbus.auth import TokenHash
from meshbus.broker.observe.lag import BOUNDS_MS, LoopLag

log = logging.getLogger("meshbus.broker.observe.monitor")

# The drop counters of ``meshbus stat`` (TrafficStats, and the stream captures) by the
# ``reason`` label they get.
DROP_REASONS = {
    "dropped_no_route": "no_route",
    "dropped_too_large": "too_large",
    "dropped_bad_hop": "bad_hop",
    "dropped_revoked": "revoked",
    "dropped_wrong_responder": "wrong_responder",
    "dropped_denied": "denied",
}


# (metric, help, key of stat's "counters"): the cumulative counters.
_COUNTERS = (
    ("meshbus_messages_in", "Data frames read from links.", "msgs_in"),
    ("meshbus_messages_out", "Data frames written to links.", "msgs_out"),
    ("meshbus_requests", "Requests forwarded.", "requests"),
    ("meshbus_timeouts", "Requests that timed out.", "timeouts"),
    ("meshbus_late_responses", "Responses after their request ended.", "late_responses"),
    ("meshbus_refused_control", "Control frames refused.", "refused_control"),
    ("meshbus_links_accepted", "Connections accepted.", "links_accepted"),
    ("meshbus_config_reloads", "Config reloads applied.", "config_reloads"),
    ("meshbus_config_reloads_failed", "Config reloads refused.", "config_reloads_failed"),
)
# (metric, help, key of stat's top level): the levels of the moment.
_GAUGES = (
    ("meshbus_uptime_seconds", "Seconds since the broker started.", "uptime_s"),
    ("meshbus_connectors", "Connectors linked.", "connectors"),
    ("meshbus_services", "Services its connectors registered.", "services"),
    ("meshbus_routes", "Addresses in the routing table.", "routes"),
    ("meshbus_route_services", "Services in the routing table.", "route_services"),
    ("meshbus_route_groups", "Groups in the routing table.", "route_groups"),
    ("meshbus_capacity", "Connectors it takes now.", "capacity"),
    ("meshbus_max_connectors", "Connectors it takes at most (--max-connectors).", "max_connectors"),
    ("meshbus_groups_bound", "Message-group bindings.", "groups_bound"),
    (
        "meshbus_handshaking",
        "Connections in their handshake: TLS, HELLO, sign-in (--max-handshaking).",
        "handshaking",
    ),
    (
        "meshbus_handshaking_sources",
        "Addresses (an IPv6 /64) with connections in their handshake.",
        "handshaking_sources",
    ),
)


@dataclass(frozen=True)
class StreamReading:
    """One hosted stream as the store holds it now."""

    name: str
    messages: int
    bytes: int


class BrokerCollector(Collector):
    """The broker's counters as Prometheus metrics, read at scrape time.

    ``stat`` is what ``meshbus stat --json`` shows (``StatView.brief``); ``traffic_bytes``
    the bytes read and written over every link since the start; ``lag`` the loop-lag
    probe; ``streams`` the hosted streams' sizes. Every metric has the label ``broker``."""

    def __init__(
        self,
        *,
        stat: Callable[[], dict[str, Any]],
        traffic_bytes: Callable[[], tuple[int, int]],
        lag: LoopLag,
        streams: Callable[[], list[StreamReading]],
    ) -> None:
        self._stat = stat
        self._traffic_bytes = traffic_bytes
        self._lag = lag
        self._streams = streams

    def describe(self) -> Iterable[Metric]:
        # Nothing to check at registration: collect is called per scrape only.
        return []

    def collect(self) -> Iterator[Metric]:
        data = self._stat()
        name = str(data["name"])
        counters: dict[str, Any] = data["counters"]
        b = ["broker"]

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=b)
            family.add_metric([name], value)
            return family

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=b)
            family.add_metric([name], value)
            return family

        bytes_in, bytes_out = self._traffic_bytes()
        yield counter("meshbus_bytes_in", "Bytes read from links (all frames).", bytes_in)
        yield counter("meshbus_bytes_out", "Bytes written to links (all frames).", bytes_out)
        for metric, doc, key in _COUNTERS:
            yield counter(metric, doc, counters[key])
        dropped = CounterMetricFamily(
            "meshbus_dropped", "Frames not delivered, by reason.", labels=["broker", "reason"]
        )
        for key, reason in DROP_REASONS.items():
            dropped.add_metric([name, reason], counters[key])
        dropped.add_metric([name, "stream_capture"], data["streams"]["dropped"])
        yield dropped
        stored = data["streams"]["stored"]
        yield counter("meshbus_stream_captured", "Messages stored by hosted streams.", stored)
        closed = CounterMetricFamily(
            "meshbus_links_closed", "Links closed, by reason.", labels=["broker", "reason"]
        )
        for reason, count in sorted(counters["links_closed"].items()):
            closed.add_metric([name, reason], count)
        yield closed
        events = CounterMetricFamily(
            "meshbus_mesh_events", "Mesh and route-sync events.", labels=["broker", "event"]
        )
        for event, count in sorted(data["mesh_counters"].items()):
            events.add_metric([name, event], count)
        yield events
        yield from _per_link(name, data)
        yield from _per_user(name, data)
        yield from _nats(name, data["nats"])
        yield from _raft(name, data["streams"]["raft"])
        rtt = GaugeMetricFamily(
            "meshbus_peer_rtt_seconds",
            "Round trip to a peer broker, timed by the heartbeat LOADs.",
            labels=["broker", "peer"],
        )
        for peer in data["peer_links"]:
            if peer["rtt_ms"] is not None:
                rtt.add_metric([name, str(peer["name"])], peer["rtt_ms"] / 1000)
        yield rtt
        yield gauge("meshbus_ready", "1 when the broker takes connectors.", int(data["ready"]))
        yield gauge("meshbus_draining", "1 while the broker drains.", int(data["draining"]))
        yield gauge("meshbus_peers", "Peer brokers linked.", len(data["peers"]))
        yield gauge("meshbus_pending_requests", "Requests in flight.", counters["pending"])
        for metric, doc, key in _GAUGES:
            yield gauge(metric, doc, data[key])
        per_stream = ["broker", "stream"]
        messages = GaugeMetricFamily(
            "meshbus_stream_messages", "Messages a hosted stream holds.", labels=per_stream
        )
        size = GaugeMetricFamily(
            "meshbus_stream_bytes", "Payload bytes a hosted stream holds.", labels=per_stream
        )
        for stream in self._streams():
            messages.add_metric([name, stream.name], stream.messages)
            size.add_metric([name, stream.name], stream.bytes)
        yield messages
        yield size
        lag = self._lag
        yield gauge("meshbus_loop_lag_max_seconds", "Largest loop lag.", lag.max_ms / 1000)
        yield gauge(
            "meshbus_loop_lag_max_own_seconds",
            "Largest loop lag the loop's own CPU time explains.",
            lag.max_own_ms / 1000,
        )
        histogram = HistogramMetricFamily(
            "meshbus_loop_lag_seconds", "How late the loop woke, every 20 ms.", labels=b
        )
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*BOUNDS_MS, None), lag.counts(), strict=True):
            cumulative += count
            buckets.append((repr(bound / 1000) if bound is not None else "+Inf", cumulative))
        histogram.add_metric([name], buckets, lag.sum_ms / 1000)
        yield histogram


# (metric, help, key of each link's entry in stat): the per-link counters.
_LINK_COUNTERS = (
    ("meshbus_link_messages_in", "Data frames read from one link.", "msgs_in"),
    ("meshbus_link_messages_out", "Data frames written to one link.", "msgs_out"),
    ("meshbus_link_bytes_in", "Bytes read from one link.", "bytes_in"),
    ("meshbus_link_bytes_out", "Bytes written to one link.", "bytes_out"),
)


def _per_link(broker: str, data: dict[str, Any]) -> Iterator[Metric]:
    """The traffic of each open link: ``kind`` is connector, operator or peer, ``name``
    the connector's server name or the peer broker's, ``id`` the broker's number for the
    link (a connector's name need not be unique). One series per open link, so as many
    as --max-connectors, operator links and peers allow; a closed link's series ends and
    its traffic stays in the broker-wide totals."""
    links = [(link["role"], link["name"], link["id"], link) for link in data["links"]]
    links += [("peer", link["name"], link["link_id"], link) for link in data["peer_links"]]
    for metric, doc, key in _LINK_COUNTERS:
        family = CounterMetricFamily(metric, doc, labels=["broker", "kind", "name", "id"])
        for kind, link_name, number, link in links:
            family.add_metric([broker, kind, str(link_name), str(number)], link[key])
        yield family


def _per_user(broker: str, data: dict[str, Any]) -> Iterator[Metric]:
    """What each user of the config file holds on the broker, and its quotas
    ([users.quotas]), by ``quota``: one series per user and quota, so as many as the
    config file has users (a name a client makes up never becomes a label). A quota
    without a limit has no ``meshbus_user_quota`` series."""
    labels = ["broker", "user", "quota"]
    used = GaugeMetricFamily(
        "meshbus_user_usage", "What a user holds on the broker, by quota.", labels=labels
    )
    limit = GaugeMetricFamily(
        "meshbus_user_quota", "A user's quota on the broker ([users.quotas]).", labels=labels
    )
    for user, quotas in data["users"].items():
        for quota, figures in quotas.items():
            used.add_metric([broker, user, quota], figures["used"])
            if figures["quota"] is not None:
                limit.add_metric([broker, user, quota], figures["quota"])
    yield used
    yield limit


# (metric, help, key of stat's "nats"): the NATS clients' counters and levels.
_NATS_COUNTERS = (
    ("meshbus_nats_messages_in", "Messages NATS clients published here.", "msgs_in"),
    ("meshbus_nats_messages_out", "Messages delivered to NATS clients here.", "msgs_out"),
    ("meshbus_nats_bytes_in", "Bytes (headers and payload) NATS clients published.", "bytes_in"),
    ("meshbus_nats_bytes_out", "Bytes (headers and payload) delivered to NATS clients.",
     "bytes_out"),
    ("meshbus_nats_slow_consumers", "NATS clients closed as slow consumers.", "slow_consumers"),
)  # fmt: skip
_NATS_GAUGES = (
    ("meshbus_nats_clients", "NATS clients connected.", "clients"),
    ("meshbus_nats_subscriptions", "Subscriptions of the NATS clients connected.", "subscriptions"),
)


def _nats(broker: str, nats: dict[str, Any]) -> Iterator[Metric]:
    """The NATS listener (docs/nats.md): its clients, their traffic, errors by ``kind``
    and closes by ``reason`` -- both the broker's own names, so a fixed set of series --
    and the mesh's NATS traffic by ``event``. No series per client: a client names
    itself, and a name a client makes up never becomes a label."""
    for metric, doc, key in _NATS_COUNTERS:
        family = CounterMetricFamily(metric, doc, labels=["broker"])
        family.add_metric([broker], nats[key])
        yield family
    for metric, doc, key in _NATS_GAUGES:
        level = GaugeMetricFamily(metric, doc, labels=["broker"])
        level.add_metric([broker], nats[key])
        yield level
    for metric, doc, key, label in (
        ("meshbus_nats_errors", "-ERRs sent to NATS clients, by kind.", "errors", "kind"),
        ("meshbus_nats_closed", "NATS connections closed, by reason.", "closed", "reason"),
        ("meshbus_nats_mesh_events", "NATS messages across the mesh and the bridge.", "mesh",
         "event"),
    ):  # fmt: skip
        family = CounterMetricFamily(metric, doc, labels=["broker", label])
        for value, count in sorted(nats[key].items()):
            family.add_metric([broker, value], count)
        yield family


def _raft(broker: str, raft: dict[str, Any]) -> Iterator[Metric]:
    """Replicated streams (docs/raft.md): the Raft log's fsyncs and their time, its
    compactions and the snapshots installed here, and per stream what this replica sees
    -- its commit lag, the leaders it saw come, whether it leads, the entries its log
    holds since its snapshot, and on the leader how far behind each replica is."""
    syncs = SummaryMetricFamily(
        "meshbus_raft_sync_seconds",
        "Appending and fsyncing the Raft log, one sync a turn for every replicated stream.",
        labels=["broker"],
    )
    syncs.add_metric([broker], raft["syncs"], raft["sync_seconds"])
    yield syncs
    compactions = CounterMetricFamily(
        "meshbus_raft_compactions",
        "Compactions of the replicated streams' Raft logs here (a snapshot each).",
        labels=["broker"],
    )
    compactions.add_metric([broker], raft["compactions"])
    installed = CounterMetricFamily(
        "meshbus_raft_snapshots_installed",
        "Snapshots installed here, each after copying its stream from the leader.",
        labels=["broker"],
    )
    installed.add_metric([broker], raft["snapshots_installed"])
    yield from (compactions, installed)
    per_stream = ["broker", "stream"]
    lag = GaugeMetricFamily(
        "meshbus_raft_commit_lag",
        "Entries this replica holds beyond the commit index (on the leader: waiting for "
        "a majority).",
        labels=per_stream,
    )
    leads = GaugeMetricFamily(
        "meshbus_raft_leader", "1 when this broker leads the stream.", labels=per_stream
    )
    changes = CounterMetricFamily(
        "meshbus_raft_leader_changes", "New leaders this replica saw.", labels=per_stream
    )
    held = GaugeMetricFamily(
        "meshbus_raft_log_entries",
        "Entries of the stream's Raft log since its last snapshot, held in memory.",
        labels=per_stream,
    )
    behind = GaugeMetricFamily(
        "meshbus_raft_replica_lag",
        "On the leader: entries of its log a replica is not known to hold.",
        labels=[*per_stream, "replica"],
    )
    for stream, seen in sorted(raft["streams"].items()):
        lag.add_metric([broker, stream], seen["commit_lag"])
        leads.add_metric([broker, stream], int(seen["leader"] == broker))
        changes.add_metric([broker, stream], seen["leader_changes"])
        held.add_metric([broker, stream], seen["log_entries"])
        for replica in seen["replicas"]:
            behind.add_metric([broker, stream, replica["broker"]], replica["lag"])
    yield from (lag, leads, changes, held, behind)


def monitor_registry(collector: BrokerCollector, *, process: bool = True) -> CollectorRegistry:
    """A registry of the broker's metrics, and with ``process`` the process's own (RSS,
    CPU, open files: prometheus_client's ProcessCollector, from /proc)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if process:
        ProcessCollector(registry=registry)  # process_*: the names dashboards know
    return registry


@dataclass(frozen=True)
class MonitorLimits:
    max_request: int = 8192  # bytes of request line and headers
    max_headers: int = 32
    max_connections: int = 16  # open at once; past it a connection gets 503 and closes
    read_timeout: float = 5.0  # seconds to send the request


class _BadRequest(Exception):
    pass


class MonitorServer:
    """The HTTP endpoint. ``registry`` makes ``/metrics``; ``health`` says the broker's
    state ("ready", "joining", "draining"); ``varz`` is ``/varz``'s JSON. With ``token``
    (a TokenHash, as ``meshbus hash-token`` prints) ``/metrics`` and ``/varz`` need
    ``Authorization: Bearer TOKEN``; ``/healthz`` never does (it tells the state only)."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        health: Callable[[], str],
        varz: Callable[[], dict[str, Any]],
        token: TokenHash | None = None,
        limits: MonitorLimits | None = None,
    ) -> None:
        self._registry = registry
        self._health = health
        self._varz = varz
        self._token = token
        self._limits = limits or MonitorLimits()
        # SHA-256 of the token once scrypt has accepted it: later requests compare with
        # this in constant time, so a scrape every second costs no scrypt.
        self._accepted: bytes | None = None
        self._open = 0
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=self._limits.max_request, reuse_address=True
        )
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self._limits.max_connections:
            await _respond(writer, 503, b"too many monitor connections\n")
            return
        self._open += 1
        try:
            try:
                head = await asyncio.wait_for(
                    reader.readuntil(b"\r\n\r\n"), self._limits.read_timeout
                )
                method, path, headers = self._parse(head)
            except (_BadRequest, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
                await _respond(writer, 400, b"bad request\n")
                return
            except (TimeoutError, ConnectionError):
                return
            status, ctype, body = await self._answer(method, path, headers)
            await _respond(writer, status, body, ctype)
        except ConnectionError:
            pass
        finally:
            self._open -= 1
            writer.close()

    def _parse(self, head: bytes) -> tuple[str, str, dict[str, str]]:
        try:
            lines = head.decode("ascii").split("\r\n")
        except UnicodeDecodeError:
            raise _BadRequest from None
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest
        header_lines = [line for line in lines[1:] if line]
        if len(header_lines) > self._limits.max_headers:
            raise _BadRequest
        headers = {}
        for line in header_lines:
            key, sep, value = line.partition(":")
            if not sep or not key or key != key.strip():
                raise _BadRequest
            headers[key.lower()] = value.strip()
        return parts[0], parts[1].partition("?")[0], headers

    async def _answer(
        self, method: str, path: str, headers: dict[str, str]
    ) -> tuple[int, str, bytes]:
        text = "text/plain; charset=utf-8"
        if method != "GET":
            return 405, text, b"only GET is served\n"
        if path == "/healthz":
            state = self._health()
            return (200, text, b"ok\n") if state == "ready" else (503, text, f"{state}\n".encode())
        if path not in ("/metrics", "/varz"):
            return 404, text, b"not found: the paths are /metrics, /healthz and /varz\n"
        if self._token is not None and not await self._authorized(headers):
            return 401, text, b"unauthorized: send Authorization: Bearer TOKEN\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return 200, "application/json", msgspec.json.encode(self._varz()) + b"\n"

    async def _authorized(self, headers: dict[str, str]) -> bool:
        assert self._token is not None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.encode()).digest()
        if self._accepted is not None and hmac.compare_digest(digest, self._accepted):
            return True
        # scrypt takes about 10 ms: in a worker thread, which touches nothing but the hash.
        matches = await asyncio.get_running_loop().run_in_executor(None, self._token.matches, token)
        if matches:
            self._accepted = digest
        return matches


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


async def _respond(
    writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8"
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    try:
        await writer.drain()
    except ConnectionError:
        pass
    writer.close()
