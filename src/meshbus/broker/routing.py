"""The routing table: who owns each unicast address, who is in each group.

A plain data structure with no I/O. ``L`` is whatever the broker uses for a
link (anything hashable); the table never looks inside it.

Group sends go to *links*, not members: a link that carries several members of
a group gets one copy and its connector fans it out, which is the same rule the
mesh applies between brokers (one copy per peer broker). The sender is a member
like any other, but a send does not come back to it unless it asks (``echo``):
so its own link is skipped when the sender is the only member there.

``version`` changes on every mutation; the broker's hot path caches routing
decisions per frame header and drops the cache when the version moves.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from meshbus.address import CAST_ANYCAST, CAST_MULTICAST, CAST_UNICAST, dynamic_instance

L = TypeVar("L", bound=Hashable)


class RoutingError(Exception):
    """A routing-table change was refused; ``str()`` is meant for the user."""


class AddressTaken(RoutingError):
    pass


class NotOwned(RoutingError):
    pass


@dataclass
class _Group(Generic[L]):
    members: dict[bytes, L] = field(default_factory=dict)
    per_link: dict[L, int] = field(default_factory=dict)
    # Caches rebuilt on change: the hot path reads these, never the dicts above.
    links: tuple[L, ...] = ()
    member_list: tuple[tuple[bytes, L], ...] = ()

    def rebuild(self) -> None:
        self.links = tuple(self.per_link)
        self.member_list = tuple(self.members.items())


class RoutingTable(Generic[L]):
    def __init__(self, slot: int = 1, rng: random.Random | None = None) -> None:
        self.slot = slot
        self.version = 0
        self._owner: dict[bytes, L] = {}
        self._by_link: dict[L, set[bytes]] = {}
        self._groups: dict[bytes, _Group[L]] = {}
        self._joined: dict[bytes, set[bytes]] = {}  # member -> groups it is in
        self._next_seq: dict[bytes, int] = {}  # server name -> next dynamic sequence
        self._rng = rng or random.Random()

    # -- changes ---------------------------------------------------------

    def add_service(self, address: bytes, link: L) -> None:
        """Register ``address`` (16-byte unicast) on ``link``; AddressTaken if owned already."""
        if address in self._owner:
            raise AddressTaken("address is already registered")
        self._owner[address] = link
        self._by_link.setdefault(link, set()).add(address)
        self.version += 1

    def allocate_dynamic(self, server: bytes, link: L) -> bytes:
        """Register and return a fresh dynamic unicast address for ``server`` (11 padded bytes).

        Ids are ``slot * 65536 + sequence`` (see ``meshbus.address.dynamic_instance``),
        handed out round-robin per server name, skipping ids still in use.
        """
        start = self._next_seq.get(server, 0)
        for step in range(0x10000):
            seq = (start + step) & 0xFFFF
            address = (
                bytes((CAST_UNICAST,))
                + server
                + dynamic_instance(self.slot, seq).to_bytes(4, "big")
            )
            if address not in self._owner:
                self._next_seq[server] = (seq + 1) & 0xFFFF
                self.add_service(address, link)
                return address
        raise RoutingError(
            "all 65536 dynamic instance ids of this server name are in use on this broker"
        )

    def remove_service(self, address: bytes, link: L) -> None:
        """Unregister ``address`` and leave all its groups; NotOwned if ``link`` does not own it."""
        if self._owner.get(address) != link:
            raise NotOwned("address is not registered by this link")
        for group in list(self._joined.get(address, ())):
            self.leave(address, group)
        del self._owner[address]
        owned = self._by_link[link]
        owned.discard(address)
        if not owned:
            del self._by_link[link]
        self.version += 1

    def join(self, member: bytes, group: bytes) -> None:
        link = self._owner.get(member)
        if link is None:
            raise NotOwned("the member address is not registered")
        if group[0] not in (CAST_MULTICAST, CAST_ANYCAST):
            raise RoutingError("only multicast and anycast addresses can be joined")
        g = self._groups.setdefault(group, _Group())
        if member in g.members:
            return
        g.members[member] = link
        g.per_link[link] = g.per_link.get(link, 0) + 1
        g.rebuild()
        self._joined.setdefault(member, set()).add(group)
        self.version += 1

    def leave(self, member: bytes, group: bytes) -> None:
        """Leave ``group``; leaving a group one is not in is a no-op, as in NATS unsubscribe."""
        g = self._groups.get(group)
        if g is None or member not in g.members:
            return
        link = g.members.pop(member)
        left = g.per_link[link] - 1
        if left:
            g.per_link[link] = left
        else:
            del g.per_link[link]
        if g.members:
            g.rebuild()
        else:
            del self._groups[group]
        joined = self._joined[member]
        joined.discard(group)
        if not joined:
            del self._joined[member]
        self.version += 1

    def remove_link(self, link: L) -> list[bytes]:
        """Drop every service of ``link`` (a connector went away); returns their addresses."""
        gone = sorted(self._by_link.get(link, ()))
        for address in gone:
            self.remove_service(address, link)
        return gone

    # -- lookups (the hot path) -------------------------------------------

    def owner(self, address: bytes) -> L | None:
        return self._owner.get(address)

    def owned_by(self, link: L) -> frozenset[bytes]:
        return frozenset(self._by_link.get(link, ()))

    def route_unicast(self, dst: bytes) -> L | None:
        return self._owner.get(dst)

    def route_multicast(self, group: bytes, src: bytes, src_link: L, echo: bool) -> tuple[L, ...]:
        """Links that get one copy of a multicast from ``src`` (on ``src_link``)."""
        g = self._groups.get(group)
        if g is None:
            return ()
        if echo or g.per_link.get(src_link) != 1 or src not in g.members:
            return g.links
        return tuple(link for link in g.links if link != src_link)

    def route_anycast(self, group: bytes, src: bytes, echo: bool) -> L | None:
        """The link of one member chosen uniformly at random (the sender only if ``echo``)."""
        g = self._groups.get(group)
        if g is None:
            return None
        members = g.member_list
        if not echo and src in g.members:
            if len(members) == 1:
                return None
            while True:
                address, link = members[self._rng.randrange(len(members))]
                if address != src:
                    return link
        return members[self._rng.randrange(len(members))][1]

    # -- introspection ------------------------------------------------------

    def services(self) -> Iterator[tuple[bytes, L]]:
        return iter(self._owner.items())

    def groups(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        for group, g in self._groups.items():
            yield group, tuple(g.members)

    def groups_of(self, member: bytes) -> frozenset[bytes]:
        return frozenset(self._joined.get(member, ()))

    @property
    def service_count(self) -> int:
        return len(self._owner)

    @property
    def group_count(self) -> int:
        return len(self._groups)
