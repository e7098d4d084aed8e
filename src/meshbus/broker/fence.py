"""Fencing: what a broker does when it finds it stalled past the heartbeat budget.

Its peers took it for dead meanwhile, and may have moved its message groups on. Until
it is linked again to every broker it lost -- or for two budgets at most, so that one
whose peers are gone for good does not refuse for ever -- it decides nothing for the
mesh: ``Guarantees`` binds no group while ``fenced()`` (docs/mesh.md, "Fencing").
A stall is found by the loop-lag probe (``Broker._measure_lag``) or by a peer's bytes
read after a silence past the budget (``PeerInfo.hear``, a STALLED close).

Its counterpart for a cut link is ``OutOfReach``: a broker that lost a peer another
peer still reaches decides nothing for the groups that peer may hold. And for a cut
that leaves a broker no way to any majority, ``minority``: under ``--partition-handling
pause-minority`` such a broker takes no connectors (docs/mesh.md, "Partitions").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from meshbus.broker.redial import RedialTable

log = logging.getLogger("meshbus.broker")


class Fence:
    def __init__(self, clock: Callable[[], float], budget: float, redials: RedialTable) -> None:
        """``budget``: seconds of silence after which a peer is dead; ``redials``: the
        brokers this one is dialling again (those it lost)."""
        self.budget = budget
        self.stalls = 0  # times this broker found it had stalled
        self._clock = clock
        self._redials = redials
        self._stalled_at = 0.0  # when it last found it had (0: never)

    def stalled(self) -> None:
        if not self.fenced():
            self.stalls += 1
            log.warning("this broker stalled past its heartbeat budget; re-linking")
        self._stalled_at = self._clock()

    def fenced(self) -> bool:
        if not self._stalled_at:
            return False
        if not self._redials or self._clock() - self._stalled_at > 2 * self.budget:
            self._stalled_at = 0.0
            return False
        return True


class OutOfReach:
    """Brokers this one is not linked to that one of its peers is: alive behind a cut
    link (a partial partition), not gone. Each peer's broker list (gossip, with every
    heartbeat) names the brokers it is linked to.

    While one is out of reach this broker decides nothing for it (docs/mesh.md, "One
    group, one member"): it counts it when it picks a group's home, and moves no group
    away from a member it cannot see -- the member may be on it, processing. A sighting
    lasts ``ttl`` seconds: a peer that has not yet noticed a crash names the dead broker
    for up to a heartbeat budget, and then a crashed broker's groups move as before."""

    def __init__(self, clock: Callable[[], float], ttl: float) -> None:
        self._clock = clock
        self._ttl = ttl
        self._seen: dict[str, float] = {}  # broker -> when a peer last named it

    def seen(self, name: str) -> None:
        self._seen[name] = self._clock()

    def forget(self, name: str) -> None:
        """Linked to it again, or it left the mesh."""
        self._seen.pop(name, None)

    def names(self) -> list[str]:
        now = self._clock()
        for name in [n for n, at in self._seen.items() if now - at > self._ttl]:
            del self._seen[name]
        return sorted(self._seen)


def minority(name: str, linked: int, lost: list[str]) -> str:
    """Why broker ``name`` is in a minority -- linked to ``linked`` peers, with the brokers
    ``lost`` (gone without a goodbye, dialled again) -- or "" if it is not. A broker counts
    itself: it is in a minority when it and its peers are no more than half of all the
    brokers it knows. Half is not enough, as in RabbitMQ's pause_minority: of two halves
    that cannot tell which is alive, neither may go on alone."""
    if not lost:
        return ""
    known = 1 + linked + len(lost)
    if 2 * (1 + linked) > known:
        return ""
    return (
        f"broker {name} is cut off from most of the mesh (linked to {linked} of the "
        f"{known - 1} other brokers it knows; lost: {', '.join(sorted(lost))}); "
        "connect to another broker"
    )
