"""Load-balancing and link rules of the mesh: pure functions, the same on every broker.

Every broker evaluates these on the same inputs and so reaches the same answer
without another round of messages: which of two duplicate links survives, how
many connectors each broker hands to a newcomer, where a refused connector is
sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


def incoming_link_wins(me: str, dialler: str) -> bool:
    """Of two links between brokers ``me`` and ``dialler``, the one dialled by the smaller
    name survives (the seed's fixed rule; here names, which the mesh keeps unique).

    True if the link that ``dialler`` dialled to ``me`` is the one to keep."""
    return dialler < me


def quotas(counts: Mapping[str, int], newcomer: str) -> dict[str, int]:
    """Connectors each broker should hold after ``newcomer`` joined: as even as whole
    connectors allow. The remainder goes to the existing brokers in name order and
    the newcomer comes last, so the newcomer is never asked to take more than its share.
    """
    order = [*sorted(name for name in counts if name != newcomer), newcomer]
    base, extra = divmod(sum(counts.values()), len(order))
    return {name: base + (1 if i < extra else 0) for i, name in enumerate(order)}


def excess(counts: Mapping[str, int], newcomer: str, me: str) -> int:
    """How many of its connectors ``me`` moves to ``newcomer`` (the seed's join step:
    its connectors minus its share). With every broker at or above its share before
    the join, the spread afterwards is at most one connector."""
    if me == newcomer or me not in counts:
        return 0
    return max(0, counts[me] - quotas(counts, newcomer)[me])


class Candidate(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def connectors(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    @property
    def draining(self) -> bool: ...


def redirect_target(brokers: Iterable[Candidate], exclude: str) -> str:
    """The address of the least loaded broker that takes connectors now (ready, not
    draining, below capacity), other than ``exclude``; "" if there is none."""
    best: Candidate | None = None
    for broker in brokers:
        if broker.name == exclude or not broker.ready or broker.draining:
            continue
        if broker.connectors >= broker.capacity:
            continue
        if best is None or (broker.connectors, broker.name) < (best.connectors, best.name):
            best = broker
    return best.address if best is not None else ""


def spread_moves(count: int, brokers: Iterable[Candidate], exclude: str) -> list[str]:
    """Addresses for ``count`` connectors leaving ``exclude`` (a drain): each goes to the
    least loaded broker at that point that still has room (to the least loaded one when
    none has), so they spread evenly. Load, not room: a capacity raised for a while
    after a crash must not pull every connector to one broker."""
    targets = [b for b in brokers if b.name != exclude and b.ready and not b.draining]
    load = {b.address: b.connectors for b in targets}
    capacity = {b.address: b.capacity for b in targets}
    name = {b.address: b.name for b in targets}
    moves: list[str] = []
    for _ in range(count):
        if not load:
            break
        with_room = [a for a in load if load[a] < capacity[a]] or list(load)
        address = min(with_room, key=lambda a: (load[a], name[a]))
        moves.append(address)
        load[address] += 1
    return moves
