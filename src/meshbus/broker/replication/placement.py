"""Where a replicated stream's replicas go: rendezvous hashing of its name over the
ready brokers, spread over their zones (--zone). Pure functions: every broker computes
the same from the same list, and adding a broker moves only the streams it now wins.

The meta group's leader places each stream it adds (``spread``) and commits the result;
no broker computes a placement of its own after that. ``replacement_order`` is the
order in which a stream's leader picks a broker to replace a lost replica
(meshbus.broker.replication.members).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence


def placement(stream: str, brokers: Sequence[str], replicas: int) -> list[str]:
    """Rendezvous hashing: the ``replicas`` brokers with the highest hash of (broker,
    stream), sorted by name."""
    return sorted(placement_order(stream, brokers)[:replicas])


def placement_order(stream: str, brokers: Sequence[str]) -> list[str]:
    """``brokers`` by their hash with ``stream``, highest first: the first R are its
    replicas, the next ones those that take the place of a lost one."""

    def weight(broker: str) -> bytes:
        return hashlib.blake2b(f"{broker}\x00{stream}".encode(), digest_size=8).digest()

    return sorted(brokers, key=weight, reverse=True)


def spread(stream: str, zones: Mapping[str, str], replicas: int) -> list[str]:
    """The ``replicas`` brokers of ``zones`` (broker -> its zone, "" for none) that hold
    ``stream``, sorted by name: in placement order, the first broker of each zone not
    used yet, then -- when there are fewer zones than replicas -- the next brokers in
    placement order whatever their zone. Brokers without a zone count as one zone, so
    with no zones at all this is ``placement``."""
    order = placement_order(stream, list(zones))
    chosen: list[str] = []
    used: set[str] = set()
    for broker in order:
        if zones[broker] not in used:
            used.add(zones[broker])
            chosen.append(broker)
    chosen = chosen[:replicas]
    for broker in order:
        if len(chosen) == replicas:
            break
        if broker not in chosen:
            chosen.append(broker)
    return sorted(chosen)


def replacement_order(stream: str, zones: Mapping[str, str], members: Collection[str]) -> list[str]:
    """The brokers of ``zones`` (the ready ones, broker -> zone) in the order a lost
    replica of ``stream`` is replaced: those of a zone no member among them is in
    first, each part in placement order -- so a replacement keeps the replicas spread
    over the zones as ``spread`` placed them, where it can."""
    held = {zones[m] for m in members if m in zones}
    order = placement_order(stream, list(zones))
    return sorted(order, key=lambda broker: zones[broker] in held)  # stable
