"""Fencing: what a broker does when it finds it stalled past the heartbeat budget.

Its peers took it for dead meanwhile, and may have moved its message groups on. Until
it is linked again to every broker it lost -- or for two budgets at most, so that one
whose peers are gone for good does not refuse for ever -- it decides nothing for the
mesh: ``Guarantees`` binds no group while ``fenced()`` (docs/mesh.md, "Fencing").
A stall is found by the loop-lag probe (``Broker._measure_lag``) or by a peer's bytes
read after a silence past the budget (``PeerInfo.hear``, a STALLED close).

Its counterpart for a cut link is ``OutOfReach``: a broker that lost a peer another
peer still reaches decides nothing for the groups that peer may hold. And for a cut
that leaves a broker no way to any majority, ``MinorityRule``: under
``--partition-handling pause-minority`` such a broker takes no connectors (docs/mesh.md,
"Partitions").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from meshbus.broker.core.endpoint import CloseReason
from meshbus.broker.core.registry import LinkRegistry, Peers
from meshbus.broker.mesh.redial import RedialTable
from meshbus.protocol.layout import ErrorCode

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


class MinorityRule:
    """``--partition-handling pause-minority``: a broker cut off from most of the mesh --
    whose peers may move its members' groups on -- closes its connectors' links, so they
    fail over to a broker on the majority's side, and takes none until it is linked to
    most of the mesh again. The brokers it knows: its peers, and those it lost without a
    goodbye and still dials (``redials``)."""

    def __init__(
        self,
        *,
        name: Callable[[], str],
        enabled: bool,
        redials: RedialTable,
        peers: Peers,
        links: LinkRegistry,
    ) -> None:
        """``name`` gives this broker's name (known once it listens)."""
        self.pauses = 0  # times this broker closed its connectors' links, cut off
        self._name = name
        self._enabled = enabled
        self._redials = redials
        self._peers = peers
        self._links = links

    def refusal(self) -> str:
        """Why this broker takes no connectors now, or "" (the rule is off, or it is not
        cut off)."""
        if not self._enabled:
            return ""
        lost = [name for name in self._redials.names() if name not in self._peers]
        return minority(self._name(), len(self._peers), lost)

    def peer_lost(self) -> None:
        """A peer was lost without a goodbye: if that leaves this broker cut off, its
        connectors go."""
        why = self.refusal()
        if not why or not self._links.connectors:
            return
        self.pauses += 1
        log.warning(
            "cut off from most of the mesh; closing connectors' links", extra={"error": why}
        )
        for link in list(self._links.connectors):
            link.fail(ErrorCode.UNAVAILABLE, why, CloseReason.MINORITY)
