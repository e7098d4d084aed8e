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

What an entry costs. A broker holds every route and membership of the mesh, so the
per-entry cost is what a million of them cost. Each address is its 16-byte bytes object
(64 bytes with the allocator's rounding) and one dict entry per index that names it
(40-70 bytes each, by how full the dict is). So a route is one entry in ``_owner``,
whose value is a ``_Holder`` shared by every address registered through one link by one
session at one epoch (there are as many holders as connectors, not as routes), and 8
bytes in its link's list (``_Owned``) -- not a set, a session bytes object and two more
dicts per address. A membership is one entry in its group's ``members`` and one in
``_joined``, whose value is the group's own address while the member is in one group
(a dict of groups only from the second one on). Measured: docs/architecture.md.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Iterator
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


class _Holder(Generic[L]):
    """Who holds an address: its link, and the session and epoch it was registered with.
    One object for every address with the same three, counted by ``uses``."""

    __slots__ = ("epoch", "link", "session", "uses")

    def __init__(self, link: L, session: bytes, epoch: int) -> None:
        self.link = link
        self.session = session
        self.epoch = epoch
        self.uses = 0


class _Owned:
    """The addresses of one link, for taking them all out when it closes.

    A list, 8 bytes an address, where a set took 30-50: a removed address stays in it
    until the list is rebuilt, once it holds more than twice the live ones (``count``),
    so the rebuilds cost O(1) per removal. An address removed and registered again on
    the same link can be in it twice; the readers keep the live ones, once."""

    __slots__ = ("addresses", "count")

    def __init__(self) -> None:
        self.addresses: list[bytes] = []
        self.count = 0


class _Group(Generic[L]):
    """One group's members, and the caches the hot path reads.

    The dicts hold link *numbers* (``RoutingTable._number``), not links: a dict of bytes
    and ints is not tracked by the cyclic garbage collector, where one of links is. With
    links in them, 100,000 groups were 700,000 tracked objects and every full collection
    stalled the loop 60-80 ms (see "What the collector sees" in the module docstring)."""

    __slots__ = (
        "address",
        "links",
        "local_addresses",
        "local_links",
        "local_member_links",
        "members",
        "members_stale",
        "peer_weights",
        "peers",
        "per_link",
        "stale",
    )

    def __init__(self, address: bytes) -> None:
        # The group's address: the one object every member in this group alone refers
        # to (``RoutingTable._joined``), not a copy each.
        self.address = address
        self.members: dict[bytes, int] = {}  # member -> the number of its link
        self.per_link: dict[int, int] = {}  # link number -> members behind that link
        # Caches rebuilt on change: the hot path reads these, never the dicts above.
        self.links: tuple[L, ...] = ()
        self.local_links: tuple[L, ...] = ()
        # The local members, and at the same index the link of each: for anycast alone,
        # and built apart (``rebuild_members``), so that a multicast group of 100,000
        # never pays a pass over its members (60 ms at 100,000) nor 16 bytes a member.
        self.local_addresses: tuple[bytes, ...] = ()
        self.local_member_links: tuple[L, ...] = ()
        self.peers: tuple[L, ...] = ()
        self.peer_weights: tuple[int, ...] = ()  # cumulative member counts, for bisect
        # Changed since the caches were built: they are rebuilt at the next lookup, not at
        # each change, so N members joining one group cost O(N), not O(N^2) (a connector
        # bringing thousands of members back after failover, or a peer's snapshot).
        self.stale = False
        self.members_stale = False

    def rebuild(self, link_of: dict[int, L], is_remote: Callable[[L], bool]) -> None:
        """The caches of links: O(links), whatever the number of members."""
        self.stale = False
        links = tuple(link_of[number] for number in self.per_link)
        peers = tuple(link for link in links if is_remote(link))
        # Equal tuples share one object: fewer objects for the collector to walk.
        self.links = links
        self.local_links = links if not peers else tuple(x for x in links if not is_remote(x))
        self.peers = peers
        self.peer_weights = tuple(
            itertools.accumulate(
                count for number, count in self.per_link.items() if is_remote(link_of[number])
            )
        )

    def rebuild_members(self, link_of: dict[int, L], is_remote: Callable[[L], bool]) -> None:
        """The caches of local members (anycast's pick), after ``rebuild``."""
        self.members_stale = False
        local = {n for n in self.per_link if not is_remote(link_of[n])}
        if len(local) == len(self.per_link):
            pairs = list(self.members.items())
        else:
            pairs = [(member, n) for member, n in self.members.items() if n in local]
        self.local_addresses = tuple(member for member, _ in pairs)
        member_links = tuple(link_of[n] for _, n in pairs)
        self.local_member_links = self.links if member_links == self.links else member_links


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
        self._owner: dict[bytes, _Holder[L]] = {}
        # The holders in use, by what they hold: (link, session, epoch).
        self._holders: dict[tuple[L, bytes, int], _Holder[L]] = {}
        self._by_link: dict[L, _Owned] = {}
        self._groups: dict[bytes, _Group[L]] = {}
        # member -> the group it is in, or from its second group on the groups as the keys
        # of a dict: a dict of bytes to None is not tracked by the cyclic GC, where a set
        # per service made every full collection walk the whole table (20 ms and more at
        # 65,000 services); and most members are in one group, where a dict of one costs
        # 200 bytes.
        self._joined: dict[bytes, bytes | dict[bytes, None]] = {}
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
        holder = self._holders.get((link, session, epoch))
        if holder is None:
            holder = self._holders[link, session, epoch] = _Holder(link, session, epoch)
        holder.uses += 1
        self._owner[address] = holder
        owned = self._by_link.get(link)
        if owned is None:
            owned = self._by_link[link] = _Owned()
        owned.addresses.append(address)
        owned.count += 1
        if address[12:14] != b"\x00\x00":  # instance >= 65536: a dynamic id
            self._dynamic_used[address[1:14]] += 1
        self.version += 1

    def take_over(self, address: bytes, link: L, session: bytes = b"", epoch: int = 0) -> L | None:
        """Give ``address`` to ``link``, whoever owns it now; returns the previous owner.

        The previous owner's registration goes with its group memberships: the new
        owner's connector joins its groups again, through its new broker."""
        previous = self._owner.get(address)
        if previous is not None:
            self.remove_service(address, previous.link)
        self.add_service(address, link, session, epoch)
        return None if previous is None else previous.link

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
        holder = self._owner.get(address)
        if holder is None or holder.link != link:
            raise NotOwned("address is not registered by this link")
        for group in _group_keys(self._joined.pop(address, None)):
            self._drop_membership(address, group)
        del self._owner[address]
        holder.uses -= 1
        if not holder.uses:
            del self._holders[holder.link, holder.session, holder.epoch]
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
        owned.count -= 1
        if not owned.count:
            del self._by_link[link]
        elif len(owned.addresses) > 2 * owned.count + 64:
            owned.addresses = self._live(owned, link)
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
        holder = self._owner.get(member)
        if holder is None:
            raise NotOwned("the member address is not registered")
        link = holder.link
        if group[0] not in (CAST_MULTICAST, CAST_ANYCAST):
            raise RoutingError("only multicast and anycast addresses can be joined")
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(group)
        elif member in g.members:
            return
        number = self._number.get(link)
        if number is None:
            number = self._number[link] = next(self._numbers)
            self._link_of[number] = link
        g.members[member] = number
        g.per_link[number] = g.per_link.get(number, 0) + 1
        g.stale = g.members_stale = True
        joined = self._joined.get(member)
        if joined is None:
            self._joined[member] = g.address
        elif isinstance(joined, bytes):
            self._joined[member] = {joined: None, g.address: None}
        else:
            joined[g.address] = None
        self._memberships += 1
        self._link_memberships[link] += 1
        self.version += 1

    def leave(self, member: bytes, group: bytes) -> None:
        """Leave ``group``; leaving a group one is not in is a no-op, as in NATS unsubscribe."""
        g = self._groups.get(group)
        if g is None or member not in g.members:
            return
        joined = self._joined[member]
        if isinstance(joined, bytes):
            del self._joined[member]
        else:
            del joined[group]
            if len(joined) == 1:
                self._joined[member] = next(iter(joined))
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
            g.stale = g.members_stale = True
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
        owned = self._by_link.get(link)
        if owned is None:
            return []
        if limit is None or owned.count <= limit:
            gone = sorted(self._live(owned, link))
            for address in gone:
                self.remove_service(address, link)
            return gone
        # From the end of the list: a step costs what it takes out, however long the list.
        addresses, owner = owned.addresses, self._owner
        gone = []
        while len(gone) < limit:
            address = addresses.pop()
            holder = owner.get(address)
            if holder is not None and holder.link == link:
                self.remove_service(address, link)
                gone.append(address)
        return gone

    def _live(self, owned: _Owned, link: L) -> list[bytes]:
        """The addresses in ``owned`` that ``link`` still holds, each once."""
        if len(owned.addresses) == owned.count:  # none removed nor twice: a plain copy
            return list(owned.addresses)
        owner = self._owner
        return [
            address
            for address in dict.fromkeys(owned.addresses)
            if (holder := owner.get(address)) is not None and holder.link == link
        ]

    # -- lookups (the hot path) -------------------------------------------

    def owner(self, address: bytes) -> L | None:
        holder = self._owner.get(address)
        return None if holder is None else holder.link

    def session_of(self, address: bytes) -> bytes:
        """The session that registered ``address``; b"" if unknown or not registered."""
        holder = self._owner.get(address)
        return b"" if holder is None else holder.session

    def speaks_for(self, link: L, session: bytes, address: bytes) -> bool:
        """Whether ``link``, of connector session ``session``, may send as ``address``: it
        registered it, or its session did (a connector moving to another broker keeps
        sending on its old link after its new broker has taken its addresses)."""
        holder = self._owner.get(address)
        return holder is not None and (
            holder.link is link or (bool(session) and holder.session == session)
        )

    def epoch_of(self, address: bytes) -> int:
        """How many links the owning session had opened before the one it registered
        ``address`` through: of two registrations by one session, the later has more."""
        holder = self._owner.get(address)
        return 0 if holder is None else holder.epoch

    def owned_by(self, link: L) -> frozenset[bytes]:
        owned = self._by_link.get(link)
        return frozenset() if owned is None else frozenset(self._live(owned, link))

    def owned_count(self, link: L) -> int:
        """len(owned_by(link)) without the copy: stat asks this for every link."""
        owned = self._by_link.get(link)
        return 0 if owned is None else owned.count

    def memberships_of(self, link: L) -> int:
        """Group memberships of every service of ``link``, counted once per (member, group)."""
        return self._link_memberships.get(link, 0)

    def is_member(self, member: bytes, group: bytes) -> bool:
        joined = self._joined.get(member)
        return (
            joined == group if isinstance(joined, bytes) else joined is not None and group in joined
        )

    def group_count_of(self, member: bytes) -> int:
        """How many groups ``member`` is in."""
        joined = self._joined.get(member)
        return 1 if isinstance(joined, bytes) else 0 if joined is None else len(joined)

    def route_unicast(self, dst: bytes) -> L | None:
        holder = self._owner.get(dst)
        return None if holder is None else holder.link

    def delivers_to(self, link: L, dst: bytes) -> bool:
        """Whether a frame to ``dst`` can reach ``link``'s connector: ``dst`` is one of its
        services, or a group one of them is in."""
        if dst and dst[0] in (CAST_MULTICAST, CAST_ANYCAST):
            g = self._fresh(dst)
            return g is not None and link in g.local_links
        holder = self._owner.get(dst)
        return holder is not None and holder.link is link

    def _fresh(self, group: bytes) -> _Group[L] | None:
        """The group, its caches up to date."""
        g = self._groups.get(group)
        if g is not None and g.stale:
            g.rebuild(self._link_of, self._is_remote)
        return g

    def _fresh_members(self, group: bytes) -> _Group[L] | None:
        """The group, its caches and those of its local members up to date."""
        g = self._fresh(group)
        if g is not None and g.members_stale:
            g.rebuild_members(self._link_of, self._is_remote)
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
        g = self._fresh_members(group)
        if g is None:
            return None
        local = self._pick_local(g, src, echo)
        if local is not None or not g.peers:
            return local
        weights = g.peer_weights
        return g.peers[bisect.bisect_right(weights, self._rng.randrange(weights[-1]))]

    def route_anycast_local(self, group: bytes, src: bytes, echo: bool) -> L | None:
        """One local member's link: where an anycast that came from a peer broker goes."""
        g = self._fresh_members(group)
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
        for address, holder in self._owner.items():
            yield address, holder.link

    def groups(self) -> Iterator[tuple[bytes, tuple[bytes, ...]]]:
        for group, g in self._groups.items():
            yield group, tuple(g.members)

    def members(self, group: bytes) -> list[bytes]:
        """Every member of ``group`` in the mesh."""
        g = self._groups.get(group)
        return [] if g is None else list(g.members)

    def is_remote_member(self, member: bytes) -> bool:
        holder = self._owner.get(member)
        return holder is None or self._is_remote(holder.link)

    def pick(self, choices: list[bytes]) -> bytes:
        return choices[self._rng.randrange(len(choices))]

    def groups_of(self, member: bytes) -> frozenset[bytes]:
        return frozenset(_group_keys(self._joined.get(member)))

    def groups_of_servers(self, link: L, servers: Container[bytes]) -> set[bytes]:
        """The groups that the addresses of ``link`` with a server name in ``servers``
        are in. One pass over the link's addresses: a few ms at 100,000."""
        owned = self._by_link.get(link)
        if owned is None:
            return set()
        joined = self._joined
        groups: set[bytes] = set()
        for address in [a for a in self._live(owned, link) if a[1:12] in servers]:
            groups.update(_group_keys(joined.get(address)))
        return groups

    def local_addresses(self) -> list[bytes]:
        """This broker's own services now: a copy, as the table may change while a peer
        is sent them (``local_ops``)."""
        is_remote = self._is_remote
        # By link, not by address: what a joining peer costs is this broker's own
        # services, not a pass over the mesh's (100 ms at 1,000,000 routes).
        return [
            address
            for link, owned in self._by_link.items()
            if not is_remote(link)
            for address in self._live(owned, link)
        ]

    def local_ops(self, address: bytes) -> list[RouteOp]:
        """``address`` as it stands now, as route operations -- its ADD, then a JOIN per
        group -- or none once it is not this broker's own any more."""
        holder = self._owner.get(address)
        if holder is None or self._is_remote(holder.link):
            return []
        ops: list[RouteOp] = [(OP_ADD, address, owner_of(holder.session, holder.epoch))]
        ops.extend((OP_JOIN, address, group) for group in _group_keys(self._joined.get(address)))
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


def _group_keys(joined: bytes | dict[bytes, None] | None) -> Iterable[bytes]:
    """The groups of a member, from its entry in ``RoutingTable._joined``."""
    if joined is None:
        return ()
    return (joined,) if isinstance(joined, bytes) else joined
