"""What every broker computes alike for a replicated stream: its replicas and its
member address."""

from __future__ import annotations

from meshbus.address import CAST_UNICAST, DYNAMIC_INSTANCE_MIN, Address, Unicast
from meshbus.broker.replication.streams import member_address, member_session, placement

BROKERS = [f"broker-{i}" for i in range(8)]


def test_placement_is_the_same_whatever_the_order_of_the_brokers() -> None:
    for stream in ("orders", "ledger", "results"):
        chosen = placement(stream, BROKERS, 3)
        assert chosen == sorted(chosen)
        assert len(set(chosen)) == 3
        assert placement(stream, list(reversed(BROKERS)), 3) == chosen
        assert set(chosen) <= set(placement(stream, BROKERS, 5))


def test_a_new_broker_moves_only_the_streams_it_wins() -> None:
    streams = [f"s{i}" for i in range(200)]
    grown = [*BROKERS, "broker-new"]
    moved = 0
    for stream in streams:
        before, after = set(placement(stream, BROKERS, 3)), set(placement(stream, grown, 3))
        if before != after:
            moved += 1
            assert after - before == {"broker-new"}  # the newcomer took one place
            assert len(before - after) == 1
    assert 0 < moved < len(streams) // 2  # about 3 in 9, not a reshuffle


def test_the_member_address_is_a_unicast_no_broker_allocates() -> None:
    raw = member_address("orders")
    assert raw == member_address("orders") != member_address("ledger")
    address = Address.from_bytes(raw)
    assert isinstance(address, Unicast)
    assert raw[0] == CAST_UNICAST
    assert address.server == "rstream"
    assert address.instance >= DYNAMIC_INSTANCE_MIN  # no connector registers it as fixed
    assert member_session("orders") != member_session("ledger")
    assert len(member_session("orders")) <= 64  # a session's wire limit (MAX_SESSION)
