"""The routing table: who owns each unicast address, who is in each group.

A plain data structure with no I/O. ``L`` is whatever the broker uses for a
link (anything hashable); the table never looks inside it, except through
``is_remote``, which tells a peer broker's link from a local connector's.

Every broker holds the whole mesh's table. A remote service is owned by the
link to the broker it is attached to, so one lookup gives the next hop either
way, and a route is never more than one broker-to-broker hop long.

Group sends go to *links*, not members: a link that carries several members of
a group gets one copy and its connector fans it out, which is the same rule the
mesh applies between brokers (one copy per peer broker). The sender is a member
like any other, but a send does not come back to it unless it asks (``echo``):
so its own link is skipped when the sender is the only member there.

Anycast prefers a local member; only when there is none does it pick a peer
broker, at random weighted by the number of members behind it, and that broker
then picks one of its own members (``route_anycast_local``).

Each address remembers the *session* of the connector that registered it. A
connector keeps its session across failover and moves, so a registration of an
address by the session that already owns it is a takeover (``take_over``), not
a conflict.

``version`` changes on every mutation; the broker's hot path caches routing
decisions per frame header and drops the cache when the version moves.

Python dicts never shrink when entries are deleted: a connector that registered
200,000 services and left would leave tables sized for them behind. So the table
counts deletions, and once they outnumber what is left (and ``COMPACT_AFTER``),
copies its dicts into right-sized ones -- amortised O(1) per deletion
(``_maybe_compact``). Kept as they are: a group's own member dicts (freed with the
group when its last member leaves) and where each server name's next dynamic id
is: ``_next_seq`` for the names with ids of this broker's slot in use, and, for the
``FREED_NAMES`` names whose last such id went most recently, ``_freed_seq`` -- so a
name that comes back goes on round the ids where it was (a late frame for a gone
service is not handed to a new one at once), while a client that uses ever new
names cannot grow the table without bound.

What the collector sees. CPython's cyclic garbage collector walks every object it
tracks on each full collection, and with a large table those collections stalled the
broker's loop (60-80 ms at 100,000 groups). Containers that hold only bytes and ints
are not tracked, so the per-service and per-group containers are kept to those: a
member's groups are the keys of a dict of bytes to None (not a set), and a group's
dicts name links by a number (``_number``, given to a link while its services are in
groups), not by the link. What is left tracked is one object per group and, for
groups that were routed to, the tuples of links the hot path reads.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from meshbus.address import CAST_ANYCAST, CAST_MULTICAST, CAST_UNICAST, dynamic_instance
from meshbus.protocol.control import OP_ADD, OP_JOIN, RouteOp, owner_of

L = TypeVar("L", bound=Hashable)


class RoutingError(Exception):
    """A routing-table change was refused; ``str()`` is meant for the user."""


class AddressTaken(RoutingError):
    pass


class NotOwned(RoutingError):
    pass


def _exhausted() -> RoutingError:
    return RoutingError(
        "all 65536 dynamic instance ids of this server name are in use on this broker; "
        "unregister some or use another server name"
    )


# Deletions before the dicts are rebuilt right-sized, at the least (see the docstring).
COMPACT_AFTER = 4096
# Server names with no dynamic id in use whose next id is still remembered.
FREED_NAMES = 4096


def _never_remote(link: object) -> bool:
    return False


class _Group(Generic[L]):
    """One group's members, and the caches the hot path reads.

    The dicts hold link *numbers* (``RoutingTable._number``), not links: a dict of bytes
    and ints is not tracked by the cyclic garbage collector, where one of links is. With
    links in them, 100,000 groups were 700,000 tracked objects and every full collection
    stalled the loop 60-80 ms (see "What the collector sees" in the module docstring)."""

    __slots__ = (
        "links",
        "local_addresses",
        "local_links",
        "local_member_links",
        "members",
        "peer_weights",
        "peers",
        "per_link",
        "stale",
    )

    def __init__(self) -> None:
        self.members: dict[bytes, int] = {}  # member -> the number of its link
        self.per_link: dict[int, int] = {}  # link number -> members behind that link
        # Caches rebuilt on change: the hot path reads these, never the dicts above.
        self.links: tuple[L, ...] = ()
        self.local_links: tuple[L, ...] = ()
        # The local members, and at the same index the link of each.
        self.local_addresses: tuple[bytes, ...] = ()
        self.local_member_links: tuple[L, ...] = ()
        self.peers: tuple[L, ...] = ()
        self.peer_weights: tuple[int, ...] = ()  # cumulative member counts, for bisect
        # Changed since the caches were built: they are rebuilt at the next lookup, not at
        # each change, so N members joining one group cost O(N), not O(N^2) (a connector
        # bringing thousands of members back after failover, or a peer's snapshot).
        self.stale = False

    def rebuild(self, link_of: dict[int, L], is_remote: Callable[[L], bool]) -> None:
        self.stale = False
        links = tuple(link_of[number] for number in self.per_link)
        peers = tuple(link for link in links if is_remote(link))
        local = [
            (member, link_of[number])
            for member, number in self.members.items()
            if not is_remote(link_of[number])
        ]
        member_links = tuple(link for _, link in local)
        # Equal tuples share one object: fewer objects for the collector to walk.
        self.links = links
        self.local_links = links if not peers else tuple(x for x in links if not is_remote(x))
        self.local_addresses = tuple(member for member, _ in local)
        self.local_member_links = links if member_links == links else member_links
        self.peers = peers
        self.peer_weights = tuple(
            itertools.accumulate(
                count for number, count in self.per_link.items() if is_remote(link_of[number])
            )
        )


class RoutingTable(Generic[L]):
    def __init__(
        self,
        slot: int = 1,
        rng: random.Random | None = None,
        is_remote: Callable[[L], bool] = _never_remote,
    ) -> None:
        self.slot = slot  # 0 while the broker has none yet (joining): no dynamic ids
        self.version = 0
        self._is_remote = is_remote
        self._owner: dict[bytes, L] = {}
        self._session: dict[bytes, bytes] = {}
        self._epoch: dict[bytes, int] = {}  # the epoch of the link it came through, if > 0
        self._by_link: dict[L, set[bytes]] = {}
        self._groups: dict[bytes, _Group[L]] = {}
        # member -> the groups it is in, as the keys of a dict: a dict of bytes to None is
        # not tracked by the cyclic GC, where a set per service made every full collection
        # walk the whole table (20 ms and more at 65,000 services).
        self._joined: dict[bytes, dict[bytes, None]] = {}
        self._memberships = 0
        self._link_memberships: Counter[L] = Counter()  # memberships per link (the limits)
        # A number for each link with services in groups, for the groups' dicts (_Group).
        self._number: dict[L, int] = {}
        self._link_of: dict[int, L] = {}
        self._numbers = itertools.count(1)
        self._deleted = 0  # deletions since the dicts were last rebuilt
        self._next_seq: dict[bytes, int] = {}  # server name -> next dynamic sequence
        self._freed_seq: OrderedDict[bytes, int] = OrderedDict()  # names with none in use
        # Dynamic ids in the table per (server name, slot): a full server name is refused
        # at once instead of after a scan of all 65536 ids.
        self._dynamic_used: Counter[bytes] = Counter()
        self._rng = rng or random.Random()

    # -- changes ---------------------------------------------------------

    def touch(self) -> None:
        """Something the routing decisions depend on changed outside this table (the NATS
        interest in a group's name: meshbus.broker.nats.bridge): the cached ones go."""
        self.version += 1

    def add_service(self, address: bytes, link: L, session: bytes = b"", epoch: int = 0) -> None:
        """Register ``address`` (16-byte unicast) on ``link``; AddressTaken if owned already.
        ``epoch``: of the connector link it was registered through (``epoch_of``)."""
        if address in self._owner:
            raise AddressTaken("address is already registered")
        self._owner[address] = link
        if session:
            self._session[address] = session
        if epoch:
            self._epoch[address] = epoch
        self._by_link.setdefault(link, set()).add(address)
        if address[12:14] != b"\x00\x00":  # instance >= 65536: a dynamic id
            self._dynamic_used[address[1:14]] += 1
        self.version += 1

    def take_over(self, address: bytes, link: L, session: bytes = b"", epoch: int = 0) -> L | None:
        """Give ``address`` to ``link``, whoever owns it now; returns the previous owner.

        The previous owner's registration goes with its group memberships: the new
        owner's connector joins its groups again, through its new broker."""
        previous = self._owner.get(address)
        if previous is not None:
            self.remove_service(address, previous)
        self.add_service(address, link, session, epoch)
        return previous

    def allocate_dynamic(
        self, server: bytes, link: L, session: bytes = b"", epoch: int = 0
    ) -> bytes:
        """Register and return a fresh dynamic unicast address for ``server`` (11 padded bytes).

        Ids are ``slot * 65536 + sequence`` (see ``meshbus.address.dynamic_instance``),
        handed out round-robin per server name, skipping ids still in use -- also ids
        of this slot that a connector took along to another broker.
        """
        if not self.slot:
            raise RoutingError("this broker has no dynamic-id slot yet (it is joining the mesh)")
        if self._dynamic_used[server + self.slot.to_bytes(2, "big")] > 0xFFFF:
            raise _exhausted()
        start = self._next_seq.get(server)
        if start is None:
            start = self._freed_seq.pop(server, 0)
        for step in range(0x10000):
            seq = (start + step) & 0xFFFF
            address = (
                bytes((CAST_UNICAST,))
                + server
                + dynamic_instance(self.slot, seq).to_bytes(4, "big")
            )
            if address not in self._owner:
                self._next_seq[server] = (seq + 1) & 0xFFFF
                self.add_service(address, link, session, epoch)
                return address
        raise _exhausted()

    def remove_service(self, address: bytes, link: L) -> None:
        """Unregister ``address`` and leave all its groups; NotOwned if ``link`` does not own it."""
        if self._owner.get(address) != link:
            raise NotOwned("address is not registered by this link")
        for group in self._joined.pop(address, ()):
            self._drop_membership(address, group)
        del self._owner[address]
        self._session.pop(address, None)
        self._epoch.pop(address, None)
        if address[12:14] != b"\x00\x00":
            name = address[1:14]
            left = self._dynamic_used[name] - 1
            if left:
                self._dynamic_used[name] = left
            else:
                del self._dynamic_used[name]
                if name[-2:] == self.slot.to_bytes(2, "big"):
                    self._forget_name(name[:-2])
        owned = self._by_link[link]
        owned.discard(address)
        if not owned:
            del self._by_link[link]
        self.version += 1
        self._deleted += 1
        self._maybe_compact()

    def _forget_name(self, server: bytes) -> None:
        """``server`` has no dynamic id of this slot left: its next id moves to the
        bounded memory of freed names, the oldest of which goes past ``FREED_NAMES``."""
        seq = self._next_seq.pop(server, None)
        if seq is None:
            return
        freed = self._freed_seq
        freed[server] = seq
        if len(freed) > FREED_NAMES:
            freed.popitem(last=False)

    def join(self, member: bytes, group: bytes) -> None:
        link = self._owner.get(member)
        if link is None:
            raise NotOwned("the member address is not registered")
        if group[0] not in (CAST_MULTICAST, CAST_ANYCAST):
            raise RoutingError("only multicast and anycast addresses can be joined")
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group()
        elif member in g.members:
            return
        number = self._number.get(link)
        if number is None:
            number = self._number[link] = next(self._numbers)
            self._link_of[number] = link
        g.members[member] = number
        g.per_link[number] = g.per_link.get(number, 0) + 1
        g.stale = True
        self._joined.setdefault(member, {})[group] = None
        self._memberships += 1
        self._link_memberships[link] += 1
        self.version += 1

    def leave(self, member: bytes, group: bytes) -> None:
        """Leave ``group``; leaving a group one is not in is a no-op, as in NATS unsubscribe."""
        g = self._groups.get(group)
        if g is None or member not in g.members:
            return
        joined = self._joined[member]
        del joined[group]
        if not joined:
            del self._joined[member]
        self._drop_membership(member, group)

    def _drop_membership(self, member: bytes, group: bytes) -> None:
        """The group's side of ``member`` leaving ``group`` (the member's own list of groups
        is the caller's to change)."""
        g = self._groups[group]
        number = g.members.pop(member)
        left = g.per_link[number] - 1
        if left:
            g.per_link[number] = left
        else:
            del g.per_link[number]
        link = self._link_of[number]
        if g.members:
            g.stale = True
        else:
            del self._groups[group]
        self._memberships -= 1
        count = self._link_memberships[link] - 1
        if count:
            self._link_memberships[link] = count
        else:
            del self._link_memberships[link]
            del self._number[link], self._link_of[number]
        self.version += 1
        self._deleted += 1
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Rebuild the dicts right-sized once deletions outnumber the entries left."""
        deleted = self._deleted
        if deleted < COMPACT_AFTER or deleted < len(self._owner) + self._memberships:
            return
        self._deleted = 0
        self._owner = dict(self._owner)
        self._session = dict(self._session)
        self._epoch = dict(self._epoch)
        self._by_link = dict(self._by_link)
        self._groups = dict(self._groups)
        self._joined = dict(self._joined)
        self._link_memberships = Counter(self._link_memberships)
        self._dynamic_used = Counter(self._dynamic_used)
        self._next_seq = dict(self._next_seq)

    def remove_link(self, link: L, limit: int | None = None) -> list[bytes]:
        """Drop the services of ``link`` (a connector or a peer broker went away): all of
        them, or any ``limit`` of them; returns their addresses. All of them go in address
        order, so that what follows (REMOVEs, LEFT) is the same every run."""
        owned = self._by_link.get(link, ())
        if limit is None or len(owned) <= limit:
            gone = sorted(owned)
        else:
            gone = list(itertools.islice(owned, limit))
        for address in gone:
            self.remove_service(address, link)
        return gone

    # -- lookups (the hot path) -------------------------------------------

    def owner(self, address: bytes) -> L | None:
        return self._owner.get(address)

    def session_of(self, address: bytes) -> bytes:
        """The session that registered ``address``; b"" if unknown or not registered."""
        return self._session.get(address, b"")

    def speaks_for(self, link: L, session: bytes, address: bytes) -> bool:
        """Whether ``link``, of connector session ``session``, may send as ``address``: it
        registered it, or its session did (a connector moving to another broker keeps
        sending on its old link after its new broker has taken its addresses)."""
        return self._owner.get(address) is link or (
            bool(session) and self._session.get(address) == session
        )

    def epoch_of(self, address: bytes) -> int:
        """How many links the owning session had opened before the one it registered
        ``address`` through: of two registrations by one session, the later has more."""
        return self._epoch.get(address, 0)

    def owned_by(self, link: L) -> frozenset[bytes]:
        return frozenset(self._by_link.get(link, ()))

    def owned_count(self, link: L) -> int:
        """len(owned_by(link)) without the copy: stat asks this for every link."""
        return len(self._by_link.get(link, ()))

    def memberships_of(self, link: L) -> int:
        """Group memberships of every service of ``link``, counted once per (member, group)."""
        return self._link_memberships.get(link, 0)

    def is_member(self, member: bytes, group: bytes) -> bool:
        return group in self._joined.get(member, ())

    def group_count_of(self, member: bytes) -> int:
        """How many groups ``member`` is in."""
        return len(self._joined.get(member, ()))

    def route_unicast(self, dst: bytes) -> L | None:
        return self._owner.get(dst)

    def delivers_to(self, link: L, dst: bytes) -> bool:
        """Whether a frame to ``dst`` can reach ``link``'s connector: ``dst`` is one of its
        services, or a group one of them is in."""
        if dst and dst[0] in (CAST_MULTICAST, CAST_ANYCAST):
            g = self._fresh(dst)
            return g is not None and link in g.local_links
        return self._owner.get(dst) is link

    def _fresh(self, group: bytes) -> _Group[L] | None:
        """The group, its caches up to date."""
        g = self._groups.get(group)
        if g is not None and g.stale:
            g.rebuild(self._link_of, self._is_remote)
        return g

    def route_multicast(self, group: bytes, src: bytes, src_link: L, echo: bool) -> tuple[L, ...]:
        """Links that get one copy of a multicast from ``src`` (on ``src_link``):
        local links with members, and each peer broker with members once."""
        g = self._fresh(group)
        if g is None:
            return ()
        if echo or g.per_link.get(self._number.get(src_link, 0)) != 1 or src not in g.members:
            return g.links
        return tuple(link for link in g.links if link != src_link)

    def route_multicast_local(self, group: bytes) -> tuple[L, ...]:
        """Local links with members: where a multicast that came from a peer broker goes."""
        g = self._fresh(group)
        return () if g is None else g.local_links

    def route_anycast(self, group: bytes, src: bytes, echo: bool) -> L | None:
        """The link of one member: a local one chosen uniformly at random when there is
        one (the sender only if ``echo``), otherwise a peer broker chosen at random
        weighted by its member count."""
        g = self._fresh(group)
        if g is None:
            return None
        local = self._pick_local(g, src, echo)
        if local is not None or not g.peers:
            return local
        weights = g.peer_weights
        return g.peers[bisect.bisect_right(weights, self._rng.randrange(weights[-1]))]

    def route_anycast_local(self, group: bytes, src: bytes, echo: bool) -> L | None:
        """One local member's link: where an anycast that came from a peer broker goes."""
        g = self._fresh(group)
        return None if g is None else self._pick_local(g, src, echo)

    def _pick_local(self, g: _Group[L], src: bytes, echo: bool) -> L | None:
        addresses = g.local_addresses
        if not addresses:
            return None
        links = g.local_member_links
        if not echo and src in g.members:
            if len(addresses) == 1:
                return None if addresses[0] == src else links[0]
            while True:
                pick = self._rng.randrange(len(addresses))
                if addresses[pick] != src:
                    return links[pick]
        return links[self._rng.randrange(len(links))]

    # -- introspection ------------------------------------------------------

    def services(self) -> Iterator[tuple[bytes, L]]:
        return iter(self._owner.items())

    def groups(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        for group, g in self._groups.items():
            yield group, tuple(g.members)

    def members(self, group: bytes) -> list[bytes]:
        """Every member of ``group`` in the mesh."""
        g = self._groups.get(group)
        return [] if g is None else list(g.members)

    def is_remote_member(self, member: bytes) -> bool:
        link = self._owner.get(member)
        return link is None or self._is_remote(link)

    def pick(self, choices: list[bytes]) -> bytes:
        return choices[self._rng.randrange(len(choices))]

    def groups_of(self, member: bytes) -> frozenset[bytes]:
        return frozenset(self._joined.get(member, ()))

    def local_addresses(self) -> list[bytes]:
        """This broker's own services now: a copy, as the table may change while a peer
        is sent them (``local_ops``)."""
        is_remote = self._is_remote
        return [a for a, link in self._owner.items() if not is_remote(link)]

    def local_ops(self, address: bytes) -> list[RouteOp]:
        """``address`` as it stands now, as route operations -- its ADD, then a JOIN per
        group -- or none once it is not this broker's own any more."""
        link = self._owner.get(address)
        if link is None or self._is_remote(link):
            return []
        owner = owner_of(self._session.get(address, b""), self._epoch.get(address, 0))
        ops: list[RouteOp] = [(OP_ADD, address, owner)]
        ops.extend((OP_JOIN, address, group) for group in self._joined.get(address, ()))
        return ops

    @property
    def service_count(self) -> int:
        return len(self._owner)

    @property
    def group_count(self) -> int:
        return len(self._groups)

    @property
    def route_count(self) -> int:
        """Entries in the table: one per unicast address, one per group membership."""
        return len(self._owner) + self._memberships
