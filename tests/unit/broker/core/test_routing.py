"""The routing table on its own: plain strings stand in for links."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshbus.address import (
    Address,
    Anycast,
    Multicast,
    Unicast,
    dynamic_instance,
    server_name_bytes,
)
from meshbus.broker.core.routing import (
    COMPACT_AFTER,
    AddressTaken,
    NotOwned,
    RoutingError,
    RoutingTable,
)
from meshbus.protocol.control import OP_JOIN

A1 = Unicast("game01", 1).to_bytes()
A2 = Unicast("game01", 2).to_bytes()
B1 = Unicast("game02", 1).to_bytes()
B2 = Unicast("game02", 2).to_bytes()
C1 = Unicast("game03", 1).to_bytes()
TOPIC = Multicast("chat").to_bytes()
POOL = Anycast("login").to_bytes()


def table(**kwargs: object) -> RoutingTable[str]:
    return RoutingTable(**kwargs)  # type: ignore[arg-type]


# -- services -------------------------------------------------------------------------


def test_add_and_look_up() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(A2, "a")
    rt.add_service(B1, "b")
    assert rt.owner(A1) == "a"
    assert rt.route_unicast(B1) == "b"
    assert rt.route_unicast(C1) is None
    assert rt.owned_by("a") == frozenset({A1, A2})
    assert rt.owned_by("nobody") == frozenset()
    assert rt.service_count == 3
    assert dict(rt.services()) == {A1: "a", A2: "a", B1: "b"}


def test_delivers_to_a_links_own_services_and_its_groups_only() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(B1, "b")
    rt.join(A1, TOPIC)
    rt.join(B1, POOL)
    reaches = {
        (link, name): rt.delivers_to(link, dst)
        for link in ("a", "b")
        for name, dst in (("A1", A1), ("B1", B1), ("C1", C1), ("topic", TOPIC), ("pool", POOL))
    }
    assert {key for key, yes in reaches.items() if yes} == {
        ("a", "A1"),
        ("a", "topic"),
        ("b", "B1"),
        ("b", "pool"),
    }


def test_address_taken() -> None:
    rt = table()
    rt.add_service(A1, "a")
    with pytest.raises(AddressTaken):
        rt.add_service(A1, "b")
    with pytest.raises(AddressTaken):
        rt.add_service(A1, "a")
    assert rt.owner(A1) == "a"
    assert rt.service_count == 1
    assert issubclass(AddressTaken, RoutingError)


def test_remove_service() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(A2, "a")
    rt.remove_service(A1, "a")
    assert rt.owner(A1) is None
    assert rt.owned_by("a") == frozenset({A2})
    assert rt.service_count == 1
    # The address is free again.
    rt.add_service(A1, "b")
    assert rt.owner(A1) == "b"


def test_remove_service_not_owned() -> None:
    rt = table()
    rt.add_service(A1, "a")
    with pytest.raises(NotOwned):
        rt.remove_service(A1, "b")
    with pytest.raises(NotOwned):
        rt.remove_service(B1, "a")
    assert rt.owner(A1) == "a"
    assert issubclass(NotOwned, RoutingError)


def test_remove_service_leaves_its_groups() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(B1, "b")
    rt.join(A1, TOPIC)
    rt.join(A1, POOL)
    rt.join(B1, TOPIC)
    rt.remove_service(A1, "a")
    assert rt.groups_of(A1) == frozenset()
    assert dict(rt.groups()) == {TOPIC: (B1,)}
    assert rt.route_multicast(TOPIC, C1, "c", echo=False) == ("b",)
    assert rt.route_anycast(POOL, C1, echo=False) is None


# -- dynamic ids --------------------------------------------------------------------------

SERVER = server_name_bytes("game01")


def _instance(address: bytes) -> int:
    return int.from_bytes(address[12:16], "big")


def test_allocate_dynamic_is_slot_partitioned() -> None:
    rt = table(slot=3)
    first = rt.allocate_dynamic(SERVER, "a")
    assert first == b"\x01" + SERVER + dynamic_instance(3, 0).to_bytes(4, "big")
    assert _instance(first) == 3 * 65536
    decoded = Address.from_bytes(first)
    assert isinstance(decoded, Unicast)
    assert decoded.server == "game01"
    assert not decoded.is_fixed
    assert rt.owner(first) == "a"


def test_allocate_dynamic_gives_unique_ids_at_or_above_65536() -> None:
    rt = table(slot=1)
    got = [rt.allocate_dynamic(SERVER, "a") for _ in range(500)]
    assert len(set(got)) == 500
    instances = [_instance(a) for a in got]
    assert min(instances) >= 65536
    assert instances == list(range(65536, 65536 + 500))  # round-robin sequence
    assert rt.service_count == 500


def test_allocate_dynamic_skips_ids_in_use() -> None:
    rt = table(slot=2)
    for seq in (0, 1, 3):
        rt.add_service(Unicast("game01", dynamic_instance(2, seq)).to_bytes(), "other")
    a = rt.allocate_dynamic(SERVER, "a")
    b = rt.allocate_dynamic(SERVER, "a")
    c = rt.allocate_dynamic(SERVER, "a")
    assert [_instance(x) - 2 * 65536 for x in (a, b, c)] == [2, 4, 5]


def test_allocate_dynamic_does_not_reuse_a_freed_id_at_once() -> None:
    rt = table()
    a = rt.allocate_dynamic(SERVER, "a")
    rt.remove_service(a, "a")
    b = rt.allocate_dynamic(SERVER, "a")
    assert b != a
    assert _instance(b) == _instance(a) + 1


def test_allocate_dynamic_sequences_are_per_server_name() -> None:
    rt = table()
    a = rt.allocate_dynamic(SERVER, "a")
    b = rt.allocate_dynamic(server_name_bytes("game02"), "a")
    assert _instance(a) == _instance(b) == 65536
    assert a != b


def test_allocate_dynamic_exhaustion() -> None:
    rt = table(slot=5)
    every = {rt.allocate_dynamic(SERVER, "a") for _ in range(65536)}
    assert len(every) == 65536
    assert {_instance(a) for a in every} == set(range(5 * 65536, 6 * 65536))
    version = rt.version
    with pytest.raises(RoutingError, match="in use") as info:
        rt.allocate_dynamic(SERVER, "a")
    assert not isinstance(info.value, AddressTaken)
    assert rt.version == version
    # One freed id is found again, wherever it sits in the sequence.
    freed = Unicast("game01", dynamic_instance(5, 12345)).to_bytes()
    rt.remove_service(freed, "a")
    assert rt.allocate_dynamic(SERVER, "b") == freed
    assert rt.owner(freed) == "b"
    # Another server name still has all its ids.
    assert _instance(rt.allocate_dynamic(server_name_bytes("x"), "a")) == 5 * 65536


# -- groups ----------------------------------------------------------------------------------


def test_join_and_leave() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.join(A1, TOPIC)
    rt.join(A1, POOL)
    assert rt.groups_of(A1) == frozenset({TOPIC, POOL})
    assert rt.group_count == 2
    rt.leave(A1, TOPIC)
    assert rt.groups_of(A1) == frozenset({POOL})
    assert rt.group_count == 1
    assert rt.route_multicast(TOPIC, B1, "b", echo=False) == ()


def test_many_joins_rebuild_a_groups_caches_once_at_the_next_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connector bringing thousands of members back (failover, a peer's snapshot)
    must cost O(N), not a rebuild of the whole group per member: that stalled brokers
    past their heartbeat budget."""
    from meshbus.broker.core import routing

    rebuilds = Counter[int]()
    real = routing._Group.rebuild

    def counted(self: routing._Group[str], link_of: object, is_remote: object) -> None:
        rebuilds[id(self)] += 1
        real(self, link_of, is_remote)  # type: ignore[arg-type]

    monkeypatch.setattr(routing._Group, "rebuild", counted)
    rt = table()
    members = [Unicast("svc", i).to_bytes() for i in range(1, 1001)]
    for i, member in enumerate(members):
        rt.add_service(member, f"link{i % 7}")
        rt.join(member, TOPIC)
    assert sum(rebuilds.values()) == 0
    assert len(rt.route_multicast(TOPIC, B1, "b", echo=False)) == 7
    for member in members[:500]:
        rt.leave(member, TOPIC)
    assert len(rt.route_multicast_local(TOPIC)) == 7
    assert rt.route_anycast(TOPIC, B1, echo=False) is not None
    assert sum(rebuilds.values()) == 2


def test_join_requires_a_registered_member() -> None:
    rt = table()
    with pytest.raises(NotOwned):
        rt.join(A1, TOPIC)
    assert rt.group_count == 0


def test_join_requires_a_group_address() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(B1, "b")
    with pytest.raises(RoutingError):
        rt.join(A1, B1)
    assert rt.group_count == 0


def test_join_twice_is_a_no_op() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.join(A1, TOPIC)
    version = rt.version
    rt.join(A1, TOPIC)
    assert rt.version == version
    assert dict(rt.groups()) == {TOPIC: (A1,)}


def test_leave_unknown_is_a_no_op() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(B1, "b")
    rt.join(B1, TOPIC)
    version = rt.version
    rt.leave(A1, TOPIC)  # not a member
    rt.leave(A1, POOL)  # no such group
    rt.leave(C1, TOPIC)  # not even registered
    assert rt.version == version
    assert dict(rt.groups()) == {TOPIC: (B1,)}


# -- multicast -----------------------------------------------------------------------------------


def _topic_on(rt: RoutingTable[str], members: dict[bytes, str]) -> None:
    for address, link in members.items():
        rt.add_service(address, link)
        rt.join(address, TOPIC)


def test_multicast_one_entry_per_link() -> None:
    rt = table()
    _topic_on(rt, {A1: "a", A2: "a", B1: "b", B2: "b", C1: "c"})
    links = rt.route_multicast(TOPIC, Unicast("x", 1).to_bytes(), "x", echo=False)
    assert sorted(links) == ["a", "b", "c"]


def test_multicast_skips_the_senders_link_when_it_is_the_only_member_there() -> None:
    rt = table()
    _topic_on(rt, {A1: "a", B1: "b", B2: "b"})
    assert rt.route_multicast(TOPIC, A1, "a", echo=False) == ("b",)


def test_multicast_echo_includes_the_senders_link() -> None:
    rt = table()
    _topic_on(rt, {A1: "a", B1: "b"})
    assert sorted(rt.route_multicast(TOPIC, A1, "a", echo=True)) == ["a", "b"]


def test_multicast_includes_the_senders_link_when_another_member_is_there() -> None:
    rt = table()
    _topic_on(rt, {A1: "a", A2: "a", B1: "b"})
    assert sorted(rt.route_multicast(TOPIC, A1, "a", echo=False)) == ["a", "b"]


def test_multicast_from_a_non_member_reaches_members_on_its_link() -> None:
    rt = table()
    _topic_on(rt, {A1: "a", B1: "b"})
    rt.add_service(A2, "a")  # registered on "a", not a member
    assert sorted(rt.route_multicast(TOPIC, A2, "a", echo=False)) == ["a", "b"]


def test_multicast_sole_member_sends_to_nobody() -> None:
    rt = table()
    _topic_on(rt, {A1: "a"})
    assert rt.route_multicast(TOPIC, A1, "a", echo=False) == ()
    assert rt.route_multicast(TOPIC, A1, "a", echo=True) == ("a",)


def test_multicast_unknown_group() -> None:
    rt = table()
    assert rt.route_multicast(TOPIC, A1, "a", echo=True) == ()


# -- anycast ---------------------------------------------------------------------------------------


def _pool_on(rt: RoutingTable[str], members: dict[bytes, str]) -> None:
    for address, link in members.items():
        rt.add_service(address, link)
        rt.join(address, POOL)


def test_anycast_unknown_group() -> None:
    assert table().route_anycast(POOL, A1, echo=False) is None


def test_anycast_sender_alone_gets_none_unless_echo() -> None:
    rt = table(rng=random.Random(1))
    _pool_on(rt, {A1: "a"})
    assert rt.route_anycast(POOL, A1, echo=False) is None
    assert rt.route_anycast(POOL, A1, echo=True) == "a"
    # Somebody else reaches the lone member.
    assert rt.route_anycast(POOL, B1, echo=False) == "a"


def test_anycast_excludes_the_sender() -> None:
    rt = table(rng=random.Random(2))
    _pool_on(rt, {A1: "a", B1: "b", C1: "c"})
    seen = Counter(rt.route_anycast(POOL, A1, echo=False) for _ in range(3000))
    assert set(seen) == {"b", "c"}
    assert 1200 < seen["b"] < 1800
    assert 1200 < seen["c"] < 1800


def test_anycast_echo_may_pick_the_sender() -> None:
    rt = table(rng=random.Random(3))
    _pool_on(rt, {A1: "a", B1: "b"})
    seen = Counter(rt.route_anycast(POOL, A1, echo=True) for _ in range(2000))
    assert set(seen) == {"a", "b"}
    assert 800 < seen["a"] < 1200


def test_anycast_is_uniform_over_members_not_links() -> None:
    rt = table(rng=random.Random(4))
    # Three members on "a", one on "b": "a" carries three quarters of the picks.
    _pool_on(rt, {A1: "a", A2: "a", C1: "a", B1: "b"})
    sender = Unicast("x", 1).to_bytes()
    seen = Counter(rt.route_anycast(POOL, sender, echo=False) for _ in range(4000))
    assert 2700 < seen["a"] < 3300
    assert 700 < seen["b"] < 1300


def test_anycast_excludes_the_sender_but_not_its_link() -> None:
    rt = table(rng=random.Random(5))
    _pool_on(rt, {A1: "a", A2: "a"})
    assert {rt.route_anycast(POOL, A1, echo=False) for _ in range(50)} == {"a"}


# -- links and versions ------------------------------------------------------------


def test_remove_link_drops_services_and_memberships() -> None:
    rt = table()
    _topic_on(rt, {A1: "a", A2: "a", B1: "b"})
    rt.join(A1, POOL)
    gone = rt.remove_link("a")
    assert gone == sorted([A1, A2])
    assert rt.owner(A1) is None
    assert rt.owner(A2) is None
    assert rt.owned_by("a") == frozenset()
    assert rt.groups_of(A1) == frozenset()
    assert dict(rt.groups()) == {TOPIC: (B1,)}
    assert rt.group_count == 1
    assert rt.route_multicast(TOPIC, C1, "c", echo=False) == ("b",)
    assert rt.route_anycast(POOL, C1, echo=False) is None
    assert rt.owner(B1) == "b"


def test_remove_unknown_link() -> None:
    rt = table()
    rt.add_service(A1, "a")
    version = rt.version
    assert rt.remove_link("zzz") == []
    assert rt.version == version


def test_version_increases_on_every_mutation() -> None:
    rt = table()
    versions = [rt.version]

    def step() -> None:
        assert rt.version > versions[-1]
        versions.append(rt.version)

    rt.add_service(A1, "a")
    step()
    rt.add_service(B1, "b")
    step()
    rt.allocate_dynamic(SERVER, "a")
    step()
    rt.join(A1, TOPIC)
    step()
    rt.join(B1, TOPIC)
    step()
    rt.leave(B1, TOPIC)
    step()
    rt.join(A1, POOL)
    step()
    rt.remove_service(A1, "a")
    step()
    rt.remove_link("b")
    step()
    rt.remove_link("a")  # still holds the dynamic address
    step()
    assert rt.service_count == 0
    assert rt.group_count == 0


# -- a mesh: peer links own remote services ------------------------------------------------
# Links named "peer-..." stand for peer brokers; the rest are local connectors.


def mesh_table(seed: int = 0) -> RoutingTable[str]:
    return RoutingTable(
        slot=1, rng=random.Random(seed), is_remote=lambda link: link.startswith("peer")
    )


def test_multicast_sends_one_copy_per_peer_and_local_only_from_peers() -> None:
    rt = mesh_table()
    for i, link in enumerate(["a", "peer-b", "peer-b", "peer-c"]):
        member = Unicast("m", i + 1).to_bytes()
        rt.add_service(member, link)
        rt.join(member, TOPIC)
    assert sorted(rt.route_multicast(TOPIC, C1, "x", echo=False)) == ["a", "peer-b", "peer-c"]
    assert rt.route_multicast_local(TOPIC) == ("a",)
    assert rt.route_multicast_local(POOL) == ()


def test_anycast_prefers_local_then_weights_peers_by_member_count() -> None:
    rt = mesh_table(seed=7)
    members = [("peer-b", 1), ("peer-c", 3)]
    n = 0
    for link, count in members:
        for _ in range(count):
            n += 1
            rt.add_service(Unicast("m", n).to_bytes(), link)
            rt.join(Unicast("m", n).to_bytes(), POOL)
    picks = Counter(rt.route_anycast(POOL, C1, echo=False) for _ in range(4000))
    assert set(picks) == {"peer-b", "peer-c"}
    assert 0.7 < picks["peer-c"] / 4000 < 0.8  # 3 of 4 members, within ~5 sigma
    assert rt.route_anycast_local(POOL, C1, echo=False) is None  # no local member
    rt.add_service(A1, "a")
    rt.join(A1, POOL)
    assert {rt.route_anycast(POOL, C1, echo=False) for _ in range(200)} == {"a"}
    assert rt.route_anycast_local(POOL, C1, echo=False) == "a"
    # The sender is the only local member: it does not get its own message, a peer does.
    assert rt.route_anycast(POOL, A1, echo=False) in ("peer-b", "peer-c")
    assert rt.route_anycast(POOL, A1, echo=True) == "a"


def test_take_over_moves_an_address_and_drops_its_memberships() -> None:
    rt = mesh_table()
    rt.add_service(A1, "a", session=b"s1")
    rt.join(A1, TOPIC)
    assert rt.session_of(A1) == b"s1"
    assert rt.take_over(A1, "peer-b", b"s1") == "a"
    assert rt.owner(A1) == "peer-b"
    assert rt.owned_by("a") == frozenset()
    assert rt.groups_of(A1) == frozenset(), "the connector joins again through its new broker"
    assert rt.take_over(B1, "a") is None
    assert rt.session_of(B1) == b""


def test_local_ops_list_a_local_service_then_its_memberships() -> None:
    from meshbus.protocol.control import OP_ADD, OP_JOIN, owner_of, split_owner

    rt = mesh_table()
    rt.add_service(A1, "a", session=b"s", epoch=3)
    rt.add_service(B1, "peer-b")
    rt.join(A1, TOPIC)
    rt.join(B1, TOPIC)
    assert rt.local_addresses() == [A1]
    assert rt.local_ops(A1) == [(OP_ADD, A1, owner_of(b"s", 3)), (OP_JOIN, A1, TOPIC)]
    assert rt.local_ops(B1) == []  # a peer's
    assert split_owner(owner_of(b"s", 3)) == (b"s", 3)
    assert rt.route_count == 4  # two addresses, two memberships


def test_no_dynamic_ids_without_a_slot() -> None:
    rt = table(slot=0)
    with pytest.raises(RoutingError, match="joining"):
        rt.allocate_dynamic(SERVER, "a")


def test_the_dicts_shrink_back_after_a_big_link_leaves() -> None:
    """Python dicts keep their size on delete: the table rebuilds them once deletions
    outnumber what is left, so a connector's 40,000 services do not stay in memory (what
    is left is at most sized for ``COMPACT_AFTER`` entries)."""
    import sys

    t: RoutingTable[str] = RoutingTable(slot=1)
    t.allocate_dynamic(b"keep".ljust(11, b"\x00"), "small")
    names = ("_owner", "_groups", "_joined")
    for i in range(40_000):
        address = t.allocate_dynamic(b"s%d".ljust(11, b"\x00") % (i % 7), "big", b"session")
        if i < 20_000:
            t.join(address, Multicast(f"g{i}").to_bytes())
    peak = {name: sys.getsizeof(getattr(t, name)) for name in names}
    bound = sys.getsizeof({i: i for i in range(COMPACT_AFTER)})
    t.remove_link("big")
    assert t.service_count == 1
    assert t.group_count == 0
    for name in names:
        size = sys.getsizeof(getattr(t, name))
        assert size <= bound, (name, size, bound)
        assert size * 8 <= peak[name], (name, size, peak[name])
    assert set(t._dynamic_used) == {b"keep".ljust(11, b"\x00") + b"\x00\x01"}


def test_the_collector_tracks_one_object_per_group_not_one_per_membership() -> None:
    """Full collections walk every tracked object: a table whose services and groups each
    added tracked containers stalled the broker's loop 60-80 ms at 100,000 groups (the
    module docstring, "What the collector sees")."""
    import gc

    rt = table()
    members = [Unicast("svc", i).to_bytes() for i in range(1, 2001)]
    for i, member in enumerate(members):
        rt.add_service(member, f"link{i % 3}")
    groups = [Multicast(f"g{i}").to_bytes() for i in range(1000)]
    gc.collect()
    before = len(gc.get_objects())
    for i, group in enumerate(groups):
        rt.join(members[i], group)
        rt.join(members[i + 1000], group)
        rt.join(members[i], TOPIC)  # one big group too
        rt.route_multicast(group, members[i], "link0", echo=True)  # its caches built
    gc.collect()
    grown = len(gc.get_objects()) - before
    # One object per group. (The links here are strings, which the collector does not
    # track, so neither are the tuples of them; a broker's Link objects add one shared
    # tuple per group that was routed to.) Sets and link-keyed dicts made it 3,000.
    assert grown <= len(groups) + 10, grown


def test_a_client_using_ever_new_server_names_does_not_grow_the_table() -> None:
    """Each server name's next dynamic id is remembered while it has ids in use and for
    the FREED_NAMES names freed last; beyond that, a name is forgotten (it starts again
    at its first id), so new names cannot grow the table without bound."""
    from meshbus.broker.core import routing

    rt = table()
    kept = server_name_bytes("kept")
    first = rt.allocate_dynamic(kept, "link")
    rt.remove_service(first, "link")
    again = rt.allocate_dynamic(kept, "link")
    assert again != first, "a name freed recently goes on round its ids"
    rt.remove_service(again, "link")
    for i in range(routing.FREED_NAMES + 500):
        rt.remove_service(rt.allocate_dynamic(server_name_bytes(f"n{i}"), "link"), "link")
    remembered = len(rt._next_seq) + len(rt._freed_seq)
    assert remembered <= routing.FREED_NAMES, remembered
    assert rt.allocate_dynamic(kept, "link") == first, "forgotten: it starts over"


# -- what an entry costs (the module docstring, "What an entry costs") ----------------


def test_one_holder_per_link_session_and_epoch_not_per_address() -> None:
    rt = table()
    addresses = [Unicast("svc", i).to_bytes() for i in range(1, 101)]
    for i, address in enumerate(addresses):
        # As a peer's ADDs arrive: each session a new bytes object.
        rt.add_service(address, "peer", bytes(b"session%d" % (i % 2)), 3 + i % 2)
    assert len(rt._holders) == 2
    assert rt.session_of(addresses[1]) == b"session1"
    assert rt.epoch_of(addresses[1]) == 4
    assert rt.session_of(addresses[2]) == b"session0"
    assert rt.epoch_of(addresses[2]) == 3
    for address in addresses[1::2]:
        rt.remove_service(address, "peer")
    assert len(rt._holders) == 1, "a holder goes with its last address"
    rt.take_over(addresses[0], "other", b"session0", 5)
    assert rt.owner(addresses[0]) == "other"
    assert rt.epoch_of(addresses[0]) == 5
    assert rt.session_of(addresses[2]) == b"session0"
    assert rt.epoch_of(addresses[2]) == 3
    assert len(rt._holders) == 2


def test_a_links_list_of_addresses_is_rebuilt_once_mostly_removed() -> None:
    rt = table()
    addresses = [Unicast("svc", i).to_bytes() for i in range(1, 1001)]
    for address in addresses:
        rt.add_service(address, "a")
    for address in addresses[100:]:
        rt.remove_service(address, "a")
    assert rt.owned_count("a") == 100
    assert rt.owned_by("a") == frozenset(addresses[:100])
    assert len(rt._by_link["a"].addresses) <= 2 * 100 + 64


def test_an_address_registered_again_on_its_link_is_owned_and_withdrawn_once() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.add_service(A2, "a")
    rt.remove_service(A1, "a")
    rt.add_service(A1, "a")  # now twice in the link's list
    assert rt.owned_count("a") == 2
    assert rt.owned_by("a") == frozenset({A1, A2})
    assert rt.remove_link("a") == sorted([A1, A2])
    assert rt.owned_count("a") == 0
    assert rt.service_count == 0


def test_a_link_withdrawn_in_steps_gives_each_live_address_once() -> None:
    rt = table()
    addresses = [Unicast("svc", i).to_bytes() for i in range(1, 301)]
    for address in addresses:
        rt.add_service(address, "a")
    for address in addresses[::3]:  # removed, some registered again, some moved away
        rt.remove_service(address, "a")
    for address in addresses[::6]:
        rt.add_service(address, "a")
    rt.take_over(addresses[1], "b")
    live = rt.owned_by("a")
    gone: list[bytes] = []
    while rt.owned_count("a"):
        step = rt.remove_link("a", 7)
        assert 0 < len(step) <= 7
        gone += step
    assert len(gone) == len(set(gone)) == len(live)
    assert set(gone) == live
    assert rt.owner(addresses[1]) == "b"


def test_a_member_of_one_group_refers_to_the_groups_own_address() -> None:
    rt = table()
    rt.add_service(A1, "a")
    rt.join(A1, bytes(TOPIC))
    assert rt._joined[A1] is rt._groups[TOPIC].address
    rt.join(A1, bytes(POOL))
    assert rt._joined[A1] == {TOPIC: None, POOL: None}
    assert rt.is_member(A1, TOPIC)
    assert rt.is_member(A1, POOL)
    assert rt.group_count_of(A1) == 2
    rt.leave(A1, TOPIC)
    assert rt._joined[A1] is rt._groups[POOL].address
    assert not rt.is_member(A1, TOPIC)
    assert rt.is_member(A1, POOL)
    assert rt.groups_of(A1) == frozenset({POOL})
    assert rt.group_count_of(A1) == 1
    assert rt.local_ops(A1)[1:] == [(OP_JOIN, A1, POOL)]
    rt.leave(A1, POOL)
    assert A1 not in rt._joined
    assert rt.group_count_of(A1) == 0
    assert not rt.is_member(A1, POOL)


def test_bytes_per_route_and_per_membership() -> None:
    """What the table allocates per entry, counted by tracemalloc (the size asked for,
    before the allocator rounds it up): a peer's routes, each with its address object
    and a session as decoded per ADD, then each of them joined to one group, each join
    with a member address of its own as decoded from the JOIN. Here 87 and 108 bytes; 278
    and 332 before the holders, the links' lists and the members in one group alone."""
    import tracemalloc

    count = 20_000
    rt = table(is_remote=lambda link: True)
    raw = [Unicast(f"svc{i % 20}", 65536 + i).to_bytes() for i in range(count)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, address in enumerate(raw):
            rt.add_service(bytes(bytearray(address)), "peer", bytes(b"s%d" % (i % 20)), 1)
        routes = tracemalloc.get_traced_memory()[0]
        for address in raw:
            rt.join(bytes(bytearray(address)), bytes(TOPIC))
        rt.route_multicast_local(TOPIC)
        joined = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_route = (routes - before) / count
    per_membership = (joined - routes) / count
    assert per_route <= 120, per_route
    assert per_membership <= 160, per_membership


def test_a_multicast_builds_no_caches_of_members_an_anycast_does() -> None:
    """A multicast goes to links: routing one over a group of 100,000 must not pass over
    its members (that pass took 60 ms, a stall of the loop, at the first send after the
    joins). Only an anycast's pick needs the local members."""
    rt = table(is_remote=lambda link: link.startswith("peer"))
    members = [Unicast("svc", i).to_bytes() for i in range(1, 101)]
    for i, member in enumerate(members):
        rt.add_service(member, ("a", "b", "peer1")[i % 3])
        rt.join(member, TOPIC)
    assert set(rt.route_multicast(TOPIC, A1, "x", echo=False)) == {"a", "b", "peer1"}
    group = rt._groups[TOPIC]
    assert group.local_addresses == ()
    assert group.members_stale
    assert rt.route_anycast(TOPIC, A1, echo=False) in {"a", "b"}
    assert len(group.local_addresses) == 67
    assert not group.members_stale
    rt.leave(members[0], TOPIC)  # on "a"
    assert rt.route_multicast_local(TOPIC) == ("a", "b")
    assert group.members_stale
    assert rt.route_anycast_local(TOPIC, A1, echo=False) in {"a", "b"}
    assert len(group.local_addresses) == 66


def test_local_addresses_are_the_local_links_live_ones_each_once() -> None:
    rt = table(is_remote=lambda link: link.startswith("peer"))
    rt.add_service(A1, "a")
    rt.add_service(A2, "a")
    rt.add_service(B1, "peer1")
    rt.add_service(B2, "b")
    rt.remove_service(A1, "a")
    rt.add_service(A1, "a")  # twice in a's list now
    rt.take_over(A2, "peer1")
    assert sorted(rt.local_addresses()) == sorted([A1, B2])
