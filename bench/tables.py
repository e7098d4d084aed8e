"""Micro-benchmarks of the broker's plain data structures, in process (no I/O).

They show what one routing decision or one pending-table round trip costs on
this machine at a given table size, the numbers behind the hot path's budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from meshbus.address import Multicast, Unicast
from meshbus.broker.core.pending import PendingTable
from meshbus.broker.core.routing import RoutingTable


@dataclass
class OpResult:
    name: str
    ops: int
    seconds: float

    @property
    def ns_per_op(self) -> float:
        return self.seconds / self.ops * 1e9


def _time(name: str, ops: int, body: Callable[[], None]) -> OpResult:
    start = time.perf_counter()
    body()
    return OpResult(name, ops, time.perf_counter() - start)


def measure_tables(services: int, links: int, ops: int) -> list[OpResult]:
    """Time route_unicast, route_multicast and a pending add+resolve on tables holding
    ``services`` services spread over ``links`` links, every service in one topic."""
    routing: RoutingTable[int] = RoutingTable()
    addresses = [Unicast("svc", 1 + i).to_bytes() for i in range(services)]
    topic = Multicast("topic").to_bytes()
    for i, address in enumerate(addresses):
        routing.add_service(address, i % links)
        routing.join(address, topic)
    pending: PendingTable[int] = PendingTable()
    keys = [addresses[i % services] for i in range(ops)]
    src = addresses[0]

    def unicast() -> None:
        route = routing.route_unicast
        for dst in keys:
            route(dst)

    def multicast() -> None:
        route = routing.route_multicast
        for _ in range(ops):
            route(topic, src, 0, False)

    def pending_round_trip() -> None:
        add, resolve = pending.add, pending.resolve
        for msg_id, requester in enumerate(keys):
            add(requester, msg_id, 0, 1e18, topic)
            resolve(requester, msg_id)

    return [
        _time("route_unicast", ops, unicast),
        _time("route_multicast", ops, multicast),
        _time("pending add+resolve", ops, pending_round_trip),
    ]
