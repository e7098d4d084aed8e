"""The broker's message-group table: binding, keeping, moving, ending, expiring."""

from __future__ import annotations

from meshbus.broker.mesh.groups import GroupTable, home_of

POOL = b"\x03pool" + bytes(11)
A, B, C = (b"\x01" + bytes(14) + bytes([i]) for i in (1, 2, 3))
S1, S2 = b"sender-1", b"sender-2"


def key(name: str) -> tuple[bytes, bytes]:
    return (POOL, name.encode())


def test_new_groups_go_to_members_that_hold_none_first() -> None:
    table = GroupTable()
    held = {table.bind(key(f"g{i}"), [A, B, C], b"", 0, 0.0).member for i in range(3)}  # type: ignore[union-attr]
    assert held == {A, B, C}
    assert [table.holds(m) for m in (A, B, C)] == [1, 1, 1]


def test_a_binding_stays_while_its_member_is_there_or_missing_within_the_grace() -> None:
    table = GroupTable(grace=2.0)
    first = table.bind(key("g"), [A], b"", 0, 0.0)
    assert first is not None
    assert first.member == A
    again = table.bind(key("g"), [B, A], A, 0, 1.0)  # reported unreachable, but still a member
    assert again is not None
    assert again.member == A
    missing = table.bind(key("g"), [B], A, 0, 2.0)  # gone since now: within the grace
    assert missing is not None
    assert missing.member == A
    assert not missing.moved
    moved = table.bind(key("g"), [B], A, 0, 4.5)
    assert moved is not None
    assert moved.member == B
    assert moved.moved
    assert table.reassigned == 1
    assert table.bind(key("none"), [], b"", 0, 5.0) is None


def test_a_group_lingers_after_its_last_sender_ends_it_then_expires() -> None:
    table = GroupTable(default_expiry=300.0, grace=2.0)
    bound = table.bind(key("g"), [A, B], b"", 0, 0.0)
    assert bound is not None
    bound.senders |= {S1, S2}
    table.end(key("g"), S1, 1.0)
    assert table.expire(100.0) == []
    assert len(table) == 1
    table.end(key("g"), S2, 100.0)
    assert table.expire(101.0) == []  # lingering
    late = table.bind(key("g"), [A, B], b"", 0, 101.5)  # a late sender finds the member
    assert late is not None
    assert late.member == bound.member
    assert table.expire(104.0) == []  # revived: the idle expiry again
    late.senders.add(S1)
    table.end(key("g"), S1, 104.0)
    assert table.expire(106.5) == [key("g")]
    assert len(table) == 0
    assert table.holds(bound.member) == 0


def test_an_unknown_sender_does_not_end_a_group() -> None:
    table = GroupTable(grace=2.0)
    bound = table.bind(key("g"), [A], b"", 0, 0.0)
    assert bound is not None
    bound.senders.add(S1)
    table.end(key("g"), S2, 1.0)
    assert table.expire(10.0) == []


def test_every_broker_names_the_same_home_whatever_order_it_lists_them() -> None:
    names = ["broker-a", "broker-b", "broker-c", "broker-d"]
    for group in (b"g1", b"order-17", b"x" * 40):
        assert home_of(group, names) == home_of(group, list(reversed(names)))
    homes = {home_of(b"g%d" % i, names) for i in range(100)}
    assert homes == set(names)  # spread over every broker
