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
from collections.abc import Callable, Iterable
from typing import Protocol

from meshbus.broker.core.link import Link
from meshbus.broker.core.registry import LinkRegistry
from meshbus.broker.mesh.balance import Candidate, excess, spread_moves
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import Move
from meshbus.protocol.layout import ControlType

log = logging.getLogger("meshbus.broker")

_MOVE_TIMEOUT = 10.0


class MoveCounter(Protocol):
    moves_sent: int


class Moves:
    def __init__(self, clock: Callable[[], float], links: LinkRegistry, stats: MoveCounter) -> None:
        self._clock = clock
        self._links = links
        self._stats = stats
        self._all_moved = asyncio.Event()  # set when the last connector told to move has left

    def moving(self, connector: Link) -> bool:
        """Told to MOVE and not gone yet (nor given up on)."""
        sent = connector.move_sent
        return sent > 0 and self._clock() - sent < _MOVE_TIMEOUT

    def move(self, connector: Link, address: str, reason: str) -> None:
        connector.move_sent = self._clock()
        self._stats.moves_sent += 1
        connector.send(encode_control(ControlType.MOVE, Move(address=address, reason=reason)))

    def connector_left(self) -> None:
        if not any(self.moving(c) for c in self._links.connectors):
            self._all_moved.set()

    def share_with(self, newcomer: Link, counts: dict[str, int], me: str) -> None:
        """A broker joined with these connector counts: move it our excess, the newest
        connectors first (the ones that have been here least)."""
        assert newcomer.peer is not None
        count = excess(counts, newcomer.name, me)
        movable = [c for c in self._links.connectors if not self.moving(c)]
        for connector in sorted(movable, key=lambda c: -c.link_id)[:count]:
            self.move(connector, newcomer.peer.listen, f"rebalance: {newcomer.name} joined")
        if count:
            log.info("rebalancing", extra={"to": newcomer.name, "connectors": count})

    async def move_all(self, me: str, brokers: Iterable[Candidate], grace: float) -> None:
        """Spread every connector over ``brokers`` but this one (``me``), by their room;
        wait until they have left or ``grace`` seconds passed."""
        connectors = sorted(self._links.connectors, key=lambda c: c.link_id)
        targets = spread_moves(len(connectors), brokers, exclude=me)
        for connector, address in zip(connectors, targets, strict=False):
            self.move(connector, address, f"broker {me} is draining")
        if not targets:
            return
        self._all_moved.clear()
        try:
            await asyncio.wait_for(self._all_moved.wait(), grace)
        except TimeoutError:
            pass
        log.info("drained", extra={"moved": len(targets), "left": len(self._links.connectors)})
