"""Moving connectors to other brokers: a newcomer's share of them (the seed patent's
join step) and all of them on a drain, each with a MOVE frame; and knowing which
are still on their way.

A connector told to MOVE reconnects to the target and then leaves this broker. One
still here ``_MOVE_TIMEOUT`` later did not make it (the target refused it, say): it
stays, and may be moved again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from meshbus.broker.balance import excess, spread_moves
from meshbus.broker.link import Link
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import Move
from meshbus.protocol.layout import ControlType

if TYPE_CHECKING:
    from meshbus.broker.mesh import Mesh

log = logging.getLogger("meshbus.broker")

_MOVE_TIMEOUT = 10.0


class Moves:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._all_moved = asyncio.Event()  # set when the last connector told to move has left

    def moving(self, connector: Link) -> bool:
        """Told to MOVE and not gone yet (nor given up on)."""
        sent = connector.move_sent
        return sent > 0 and self.mesh.broker.clock() - sent < _MOVE_TIMEOUT

    def move(self, connector: Link, address: str, reason: str) -> None:
        connector.move_sent = self.mesh.broker.clock()
        self.mesh.stats.moves_sent += 1
        connector.send(encode_control(ControlType.MOVE, Move(address=address, reason=reason)))

    def connector_left(self) -> None:
        if not any(self.moving(c) for c in self.mesh.broker.connectors):
            self._all_moved.set()

    def share_with(self, newcomer: Link, counts: dict[str, int]) -> None:
        """A broker joined with these connector counts: move it our excess, the newest
        connectors first (the ones that have been here least)."""
        mesh = self.mesh
        count = excess(counts, newcomer.name, mesh.name)
        movable = [c for c in mesh.broker.connectors if not self.moving(c)]
        for connector in sorted(movable, key=lambda c: -c.link_id)[:count]:
            self.move(connector, newcomer.listen, f"rebalance: {newcomer.name} joined")
        if count:
            log.info("rebalancing", extra={"to": newcomer.name, "connectors": count})

    async def move_all(self, grace: float) -> None:
        """Spread every connector over the other brokers, by their room; wait until they
        have left or ``grace`` seconds passed."""
        mesh = self.mesh
        connectors = sorted(mesh.broker.connectors, key=lambda c: c.link_id)
        targets = spread_moves(len(connectors), mesh.brokers(), exclude=mesh.name)
        for connector, address in zip(connectors, targets, strict=False):
            self.move(connector, address, f"broker {mesh.name} is draining")
        if not targets:
            return
        self._all_moved.clear()
        try:
            await asyncio.wait_for(self._all_moved.wait(), grace)
        except TimeoutError:
            pass
        log.info("drained", extra={"moved": len(targets), "left": len(mesh.broker.connectors)})
