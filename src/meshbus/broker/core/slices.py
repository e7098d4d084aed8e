"""Work that grows with its input, done a slice at a time so the event loop never stalls.

Everything a broker does runs on one loop (docs/architecture.md §4); a callback that
runs for 100 ms delays every link's frames and every heartbeat by as much. Work over a
whole table -- describing 200,000 addresses for ``stat``, say -- yields to the loop
whenever it has run for ``SLICE`` seconds.
"""

from __future__ import annotations

import asyncio
from time import perf_counter

from meshbus.address import describe_address

SLICE = 0.005  # seconds of work between two turns of the loop
_STEP = 500  # items between two looks at the clock


class Slices:
    """One piece of work's slices: ``described`` and the like yield to the loop once the
    current slice is used up, and start a new one after."""

    def __init__(self) -> None:
        self._deadline = perf_counter() + SLICE

    async def described(self, addresses: list[bytes]) -> list[str]:
        """``addresses`` as text, in their order."""
        out: list[str] = []
        for start in range(0, len(addresses), _STEP):
            out += [describe_address(a) for a in addresses[start : start + _STEP]]
            await self.turn()
        return out

    async def turn(self) -> None:
        """Yield to the loop if this slice is used up."""
        if perf_counter() > self._deadline:
            await asyncio.sleep(0)
            self._deadline = perf_counter() + SLICE
