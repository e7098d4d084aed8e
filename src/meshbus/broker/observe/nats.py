"""What ``meshbus stat`` (and so ``/metrics`` and ``meshbus top``) shows of NATS clients:
the listener's clients and subscriptions, their traffic, slow consumers and errors by
kind, each client's own figures, and the mesh's NATS traffic -- read from the parts,
never changed here (docs/nats.md, "What stat and /metrics show").

The mesh's figures are kept on every broker, with a NATS listener or not: a broker
without one still hands meshbus multicasts to the NATS clients of its peers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshbus.broker.nats.bridge import BridgeStats
from meshbus.broker.nats.connection import NatsCloseReason, NatsError
from meshbus.broker.nats.listener import NatsListener, NatsTraffic
from meshbus.broker.nats.peers import PeerMessageStats
from meshbus.broker.nats.router import NatsRouter
from meshbus.broker.nats.services import ServiceSubjects

# The closes that are errors (all but the client's own and the broker's stop): with the
# -ERRs that leave a connection open, the kinds of ``errors``, every one listed.
_ERROR_CLOSES = tuple(
    r
    for r in NatsCloseReason
    if r not in (NatsCloseReason.CLIENT_CLOSED, NatsCloseReason.SERVER_SHUTDOWN)
)
ERROR_KINDS = tuple(k.value for k in (*_ERROR_CLOSES, *NatsError))


class NatsView:
    def __init__(
        self,
        *,
        listener: NatsListener | None,
        router: NatsRouter,
        peer_stats: PeerMessageStats,
        bridge_stats: BridgeStats,
        services: ServiceSubjects,
    ) -> None:
        """``listener`` is None without --nats-listen; the rest is the mesh's NATS
        traffic: the router's, the messages to peers, the bridge's, meshbus services'
        on subjects."""
        self._listener = listener
        self._router = router
        self._peer_stats = peer_stats
        self._bridge_stats = bridge_stats
        self._services = services

    def snapshot(self) -> dict[str, Any]:
        """The ``nats`` part of ``meshbus stat``."""
        listener = self._listener
        router = self._router
        traffic = listener.traffic() if listener is not None else NatsTraffic()
        closed = listener.closed if listener is not None else {}
        conns = list(listener.connections.values()) if listener is not None else []
        errors = dict.fromkeys(ERROR_KINDS, 0)
        for reason in _ERROR_CLOSES:
            errors[reason.value] = closed.get(reason, 0)
        for kind, count in traffic.errors.items():
            errors[kind.value] = count
        return {
            "listen": listener.address if listener is not None else "",
            "connect_urls": listener.connect_urls if listener is not None else [],
            "lame_duck": listener.lame_duck_mode if listener is not None else False,
            "clients": len(conns),
            "subscriptions": sum(len(conn.subs) for conn in conns),
            "msgs_in": traffic.msgs_in,
            "bytes_in": traffic.bytes_in,
            "msgs_out": traffic.msgs_out,
            "bytes_out": traffic.bytes_out,
            "slow_consumers": closed.get(NatsCloseReason.SLOW_CONSUMER, 0),
            "errors": errors,
            "closed": {
                reason.value: count
                for reason, count in sorted(closed.items(), key=lambda item: item[0].value)
            },
            # Across the mesh: messages to and from peer brokers, the no responders
            # answered here, the bridge to meshbus's services, and services on subjects.
            "mesh": {
                "msgs_to_peers": self._peer_stats.msgs_out,
                "frames_to_peers": self._peer_stats.frames_out,
                "too_large_for_peers": self._peer_stats.too_large,
                "msgs_from_peers": router.from_peers,
                "dropped_from_peers": router.dropped_from_peers,
                "no_responders": router.no_responders,
            }
            | {f"bridge_{k}": v for k, v in dataclasses.asdict(self._bridge_stats).items()}
            | {f"services_{k}": v for k, v in dataclasses.asdict(self._services.stats).items()},
            # Meshbus services' subject subscriptions here (docs/nats.md).
            "service_subscriptions": self._services.subscriptions,
            "connections": [
                {
                    "id": conn.client_id,
                    "remote": conn.remote,
                    "name": conn.options.name,
                    "lang": conn.options.lang,
                    "user": conn.user.name if conn.user is not None else None,
                    "subscriptions": len(conn.subs),
                    "msgs_in": conn.msgs_in,
                    "bytes_in": conn.bytes_in,
                    "msgs_out": conn.msgs_out,
                    "bytes_out": conn.bytes_out,
                    "pending_bytes": (
                        conn.transport.get_write_buffer_size() if conn.transport else 0
                    ),
                }
                for conn in conns
            ],
        }
