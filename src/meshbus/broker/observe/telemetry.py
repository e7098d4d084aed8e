"""A broker's telemetry: its own counters and sampled message traces, in streams.

Every ``--telemetry-interval`` seconds the broker appends one JSON record to the
stream ``telemetry.<broker>`` it hosts: per-link message and byte counts and
queued bytes, route-table size, connectors, pending requests, and the cumulative
counters (timeouts, drops). Counters are cumulative since the broker started, so
a lost or late record loses no information; a restart shows as a reset.

A record also says how the broker saw the mesh: its peers, with the connectors each
last announced (their LOAD), and the mesh's events since the previous record (a
join, a drain, a goodbye, a crash: meshbus.broker.mesh.membership.MeshEvent). A broker's streams
die with it, so what its peers recorded is all a report has of a dead broker.

Traces: the broker tells its connectors in WELCOME to trace one send in
``1 / --trace-sample``. A traced frame carries the TRACE flag and, in its extension
block, the time its connector sent it. The broker records a hop when such a frame
enters the mesh from a connector ("entry") and when it goes out to a connector's
link ("exit"); the receiving connector reports the time it got it ("received",
with the send time) in a TRACE control frame. The records, one per hop, go to
``traces.<broker>`` at each interval. TRACE frames take the per-frame path, so
untraced traffic pays one flag test; payloads stay unread. ``meshbus report``
joins the hops by (source, message id) (docs/report.md).

Both streams are ordinary streams (fetch, the Spark source, ``meshbus stream``),
capture nothing, and keep an hour.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec

from meshbus.address import describe_address
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.endpoint import Endpoint, LinkRole
from meshbus.broker.core.link import Link
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.registry import LinkRegistry
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.mesh.membership import MeshEvent
from meshbus.broker.streams.host import StreamHost
from meshbus.protocol.control import BrokerInfo, TraceReport
from meshbus.storage.errors import StoreError
from meshbus.storage.store import NewMessage, StreamConfig

log = logging.getLogger("meshbus.broker")

RETENTION = 3600.0  # seconds of telemetry and traces each broker keeps
# Trace records waiting for the next interval; past this many they are stored at once.
_MAX_WAITING_HOPS = 10_000
_encode = msgspec.json.Encoder().encode
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def stream_names(broker: str) -> tuple[str, str]:
    """The telemetry and trace streams of the broker named ``broker``."""
    safe = _UNSAFE.sub("_", broker)[:50]
    return f"telemetry.{safe}", f"traces.{safe}"


class Telemetry:
    def __init__(
        self,
        *,
        config: BrokerConfig,
        streams: StreamHost,
        links: LinkRegistry,
        routing: RoutingTable[Endpoint],
        pending: PendingTable[Endpoint],
        counters: Callable[[], dict[str, int]],
        peers: Callable[[], list[BrokerInfo]],
    ) -> None:
        """``counters`` are the broker's cumulative traffic counters (``meshbus stat``);
        ``peers``, the brokers it is linked to as they last told it."""
        self._config = config
        self._streams = streams
        self._links = links
        self._routing = routing
        self._pending = pending
        self._counters = counters
        self._peers = peers
        self.interval = config.telemetry_interval
        # What WELCOME tells connectors: trace one send in this many (0: none).
        self.trace_every = (
            round(1 / config.trace_sample) if self.interval > 0 and config.trace_sample else 0
        )
        self.hops: list[bytes] = []
        self.events: list[dict[str, Any]] = []  # for the next record
        self.records = 0
        self._task: asyncio.Task[None] | None = None
        self._names = ("", "")

    def start(self) -> None:
        """Host the two streams and start recording (the broker is ready)."""
        if self.interval <= 0 or self._task is not None:
            return
        self._names = stream_names(self._config.name)
        streams = self._streams
        for name in self._names:
            try:
                streams.host_local(StreamConfig(name, (), max_age=RETENTION))
            except StoreError as exc:  # e.g. an operator made one of that name
                log.error("no telemetry stream", extra={"stream": name, "error": str(exc)})
        self._task = asyncio.get_running_loop().create_task(self._every_interval())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _every_interval(self) -> None:
        while True:
            # The first record at once: it is the baseline the first interval's traffic
            # is measured from (a record taken an interval late counts that traffic in
            # the baseline, and a report sees none of it).
            self.publish()
            await asyncio.sleep(self.interval)

    def publish(self) -> None:
        """Store a telemetry record and the waiting trace hops."""
        now = time.time()
        events, self.events = self.events, []
        self._append(self._names[0], [_encode(self.record(now, events))], now)
        self.records += 1
        self._flush_hops(now)

    def _flush_hops(self, now: float) -> None:
        hops, self.hops = self.hops, []
        if hops:
            self._append(self._names[1], hops, now)

    def _append(self, name: str, payloads: list[bytes], now: float) -> None:
        member = self._streams.members.get(name)
        if member is None:
            return  # deleted by an operator: recording goes on without it
        try:
            self._streams.store.append_batch(
                name, [NewMessage(member, member, p) for p in payloads], now
            )
        except StoreError as exc:
            log.error("could not store telemetry", extra={"stream": name, "error": str(exc)})

    def record(self, now: float, events: list[dict[str, Any]]) -> dict[str, Any]:
        connectors = self._links.connectors
        return {
            "broker": self._config.name,
            "at": now,
            "interval": self.interval,
            "connectors": len(connectors),
            "services": sum(self._routing.owned_count(link) for link in connectors),
            "routes": self._routing.route_count,
            "pending": len(self._pending),
            "counters": self._counters(),
            "links": [
                {
                    "id": link.link_id,
                    "kind": "peer" if link.is_peer else "connector",
                    "name": link.name,
                    "msgs_in": link.msgs_in,
                    "msgs_out": link.msgs_out,
                    "bytes_in": link.bytes_in,
                    "bytes_out": link.bytes_out,
                    "queued": link.queued_bytes(),
                }
                for link in self._links.links.values()
                if link.is_peer or link.role is LinkRole.CONNECTOR
            ],
            "peers": [
                {
                    "name": peer.name,
                    "address": peer.address,
                    "connectors": peer.connectors,
                    "draining": peer.draining,
                }
                for peer in self._peers()
            ],
            "events": events,
        }

    def mesh_event(self, event: MeshEvent) -> None:
        """A change of the mesh, for the next record; ``last_heard`` is the Unix time of
        a closed peer link's last frame."""
        if self.interval <= 0:
            return
        now = time.time()
        last_heard = None if event.silent_for is None else now - event.silent_for
        self.events.append(
            {
                "at": now,
                "kind": event.kind,
                "broker": event.broker,
                "reason": event.reason,
                "last_heard": last_heard,
            }
        )

    def on_trace(self, link: Link, correlation: int, body: TraceReport) -> None:
        """A connector got a traced frame: its hop, with the time it was sent. Only for
        an address of its own (a service of the link, or a group one of them is in): a
        report naming another would put a hop in the trace of someone else's traffic."""
        if not self._routing.delivers_to(link, body.dst):
            return
        self.hop("received", body.src, body.msg_id, body.dst, body.sent_at, at=body.received_at)

    def hop(
        self,
        hop: str,
        src: bytes,
        msg_id: int,
        dst: bytes,
        sent_at: float | None = None,
        at: float | None = None,
    ) -> None:
        """Record a traced frame passing here (see the module docstring)."""
        if not self.trace_every:
            return
        self.hops.append(
            _encode(
                {
                    "src": describe_address(src),
                    "msg_id": msg_id,
                    "dst": describe_address(dst),
                    "hop": hop,
                    "broker": self._config.name,
                    "at": at or time.time(),
                    "sent_at": sent_at,
                }
            )
        )
        if len(self.hops) >= _MAX_WAITING_HOPS:
            self._flush_hops(time.time())
