"""The broker daemon: owns the links, the routing and pending tables, and the timers.

Everything here runs on one event loop thread and never awaits inside frame
handling, so a routing change made by a control frame is visible to the very
next frame of the same read -- that is what keeps a REGISTER followed by a send
from the new address in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from meshbus.address import describe_address
from meshbus.broker.control import ControlHandler
from meshbus.broker.link import CloseReason, Link, LinkState
from meshbus.broker.pending import PendingTable
from meshbus.broker.process import ready_line
from meshbus.broker.routing import RoutingTable
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import Bye, DeliveryFailure
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, ControlType

log = logging.getLogger("meshbus.broker")


@dataclass
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 7400
    name: str = ""  # empty: broker-PORT, with the port actually bound
    slot: int = 1
    max_frame: int = DEFAULT_MAX_FRAME
    # A link whose unsent output passes this is a slow consumer and is closed (as NATS does):
    # the alternative, buffering without bound, lets one stuck client take the broker down.
    max_pending_bytes: int = 64 * 1024 * 1024
    # Used when a request carries no timeout of its own.
    default_request_timeout: float = 30.0
    # How often pending requests are checked for expiry: a TIMEOUT is at most this late.
    sweep_interval: float = 0.01


@dataclass
class BrokerStats:
    requests: int = 0
    timeouts: int = 0
    late_responses: int = 0
    dropped_no_route: int = 0
    dropped_too_large: int = 0
    links_accepted: int = 0
    # Traffic of links that have closed; open links keep their own counts.
    closed_msgs_in: int = 0
    closed_msgs_out: int = 0
    links_closed: Counter[str] = field(default_factory=Counter)


class Broker:
    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.routing: RoutingTable[Link] = RoutingTable(slot=self.config.slot)
        self.pending: PendingTable[Link] = PendingTable()
        self.stats = BrokerStats()
        self.control = ControlHandler(self)
        self.links: dict[int, Link] = {}
        # Frames routed during one read, per destination link; written at the end of the read.
        self.outbox: dict[Link, list[memoryview | bytes]] = {}
        self.started_at = time.time()
        self._next_link_id = 1
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._clock = time.monotonic
        self.address = ""

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self._server = await loop.create_server(
            self._new_link, self.config.host, self.config.port, reuse_address=True, backlog=1024
        )
        sock = self._server.sockets[0]
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        if not self.config.name:
            self.config.name = f"broker-{port}"
        self._sweeper = asyncio.create_task(self._sweep_pending(), name="pending-sweeper")

    async def stop(self) -> None:
        """Close every link with a BYE and stop listening."""
        if self._server is not None:
            self._server.close()
        for link in list(self.links.values()):
            link.send(encode_control(ControlType.BYE, Bye(reason="broker shutting down")))
            link.close(CloseReason.BROKER_SHUTDOWN)
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self._server is not None:
            await self._server.wait_closed()

    def _new_link(self) -> Link:
        link = Link(self, self._next_link_id)
        self._next_link_id += 1
        return link

    def link_opened(self, link: Link) -> None:
        self.links[link.link_id] = link
        self.stats.links_accepted += 1

    def link_closed(self, link: Link, reason: CloseReason) -> None:
        self.links.pop(link.link_id, None)
        self.stats.links_closed[reason.value] += 1
        self.stats.closed_msgs_in += link.msgs_in
        self.stats.closed_msgs_out += link.msgs_out
        gone = self.routing.remove_link(link)
        self.pending.drop_link(link)
        self.outbox.pop(link, None)
        log.debug(
            "link closed",
            extra={"link": link.link_id, "reason": reason.value, "services": len(gone)},
        )

    # -- output ----------------------------------------------------------------

    def deliver(self, link: Link, frame: memoryview | bytes) -> bool:
        """Queue a frame for ``link``; written when the current read is done.

        False (and counted) when the frame is larger than the link accepts: forwarding
        it would break the receiver's framing and cost it its link."""
        if len(frame) > link.max_frame:
            self.stats.dropped_too_large += 1
            return False
        self.queue(link, frame, 1)
        return True

    def queue(self, link: Link, frames: memoryview | bytes, count: int) -> None:
        """Queue ``count`` frames (one contiguous slice) for ``link`` without checks."""
        link.msgs_out += count
        parts = self.outbox.get(link)
        if parts is None:
            self.outbox[link] = [frames]
        else:
            parts.append(frames)

    def reply(self, link: Link, type_: ControlType, body: Any, correlation: int = 0) -> None:
        parts = self.outbox.setdefault(link, [])
        parts.append(encode_control(type_, body, correlation))

    def flush_outbox(self) -> None:
        """Write each link's frames of this read in one call, in the order they were routed."""
        if not self.outbox:
            return
        batches = list(self.outbox.items())
        self.outbox.clear()
        for link, parts in batches:
            if link.state is LinkState.CLOSED or link.transport is None:
                continue
            data = b"".join(parts)
            link.transport.write(data)
            link.bytes_out += len(data)

    def no_route(self, link: Link, msg_id: int, src: bytes, dst: bytes, reason: str = "") -> None:
        self.reply(
            link,
            ControlType.NO_ROUTE,
            DeliveryFailure(msg_id=msg_id, src=src, dst=dst, reason=reason),
        )

    # -- requests -------------------------------------------------------------

    def deadline(self, timeout_ms: int) -> float:
        timeout = timeout_ms / 1000 if timeout_ms else self.config.default_request_timeout
        return self._clock() + timeout

    async def _sweep_pending(self) -> None:
        """Expire pending requests. A fixed tick rather than a timer per request: one wake-up
        every ``sweep_interval`` costs nothing per request, and bounds how late a TIMEOUT
        can be to one interval."""
        interval = self.config.sweep_interval
        while True:
            await asyncio.sleep(interval)
            for entry in self.pending.expire(self._clock()):
                self.stats.timeouts += 1
                if entry.link.state is LinkState.OPEN:
                    entry.link.send(
                        encode_control(
                            ControlType.TIMEOUT,
                            DeliveryFailure(
                                msg_id=entry.msg_id, src=entry.requester, dst=entry.dst
                            ),
                        )
                    )

    # -- introspection ----------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """What ``meshbus stat`` shows: links, services, groups and counters."""
        links = [
            {
                "id": link.link_id,
                "peer": link.peer,
                "name": link.name,
                "state": link.state.value,
                "services": sorted(describe_address(a) for a in self.routing.owned_by(link)),
                "msgs_in": link.msgs_in,
                "msgs_out": link.msgs_out,
                "bytes_in": link.bytes_in,
                "bytes_out": link.bytes_out,
            }
            for link in self.links.values()
        ]
        groups = {
            describe_address(group): sorted(describe_address(m) for m in members)
            for group, members in self.routing.groups()
        }
        s = self.stats
        return {
            "broker": self.config.name,
            "address": self.address,
            "uptime_s": round(time.time() - self.started_at, 3),
            "links": links,
            "services": sorted(describe_address(a) for a, _ in self.routing.services()),
            "groups": groups,
            "counters": {
                "msgs_in": s.closed_msgs_in + sum(link.msgs_in for link in self.links.values()),
                "msgs_out": s.closed_msgs_out + sum(link.msgs_out for link in self.links.values()),
                "requests": s.requests,
                "pending": len(self.pending),
                "timeouts": s.timeouts,
                "late_responses": s.late_responses,
                "dropped_no_route": s.dropped_no_route,
                "dropped_too_large": s.dropped_too_large,
                "links_accepted": s.links_accepted,
                "links_closed": dict(s.links_closed),
            },
        }


async def serve(config: BrokerConfig) -> None:
    """Run a broker until SIGINT or SIGTERM; print the ready line once it accepts links."""
    import signal
    import sys

    broker = Broker(config)
    await broker.start()
    # Handlers first: a script may signal the broker the moment it reads the ready line.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # The one line scripts and tests wait for; it carries the real port when --listen used 0.
    sys.stdout.write(ready_line(config.name, broker.address) + "\n")
    sys.stdout.flush()
    await stop.wait()
    log.info("stopping", extra={"broker": config.name})
    await broker.stop()
