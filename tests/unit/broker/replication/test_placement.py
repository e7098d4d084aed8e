"""Where a replicated stream's replicas go: the same on every broker, moved only by a
broker that wins a place, and spread over zones before two share one."""

from __future__ import annotations

from collections import Counter

from meshbus.broker.replication.placement import (
    placement,
    placement_order,
    replacement_order,
    spread,
)

BROKERS = [f"broker-{i}" for i in range(8)]
STREAMS = [f"s{i}" for i in range(200)]


def test_placement_is_the_same_whatever_the_order_of_the_brokers() -> None:
    for stream in ("orders", "ledger", "results"):
        chosen = placement(stream, BROKERS, 3)
        assert chosen == sorted(chosen)
        assert len(set(chosen)) == 3
        assert placement(stream, list(reversed(BROKERS)), 3) == chosen
        assert set(chosen) <= set(placement(stream, BROKERS, 5))


def test_a_new_broker_moves_only_the_streams_it_wins() -> None:
    grown = [*BROKERS, "broker-new"]
    moved = 0
    for stream in STREAMS:
        before, after = set(placement(stream, BROKERS, 3)), set(placement(stream, grown, 3))
        if before != after:
            moved += 1
            assert after - before == {"broker-new"}  # the newcomer took one place
            assert len(before - after) == 1
    assert 0 < moved < len(STREAMS) // 2  # about 3 in 9, not a reshuffle


def test_without_zones_spread_is_placement() -> None:
    for stream in STREAMS:
        assert spread(stream, dict.fromkeys(BROKERS, ""), 3) == placement(stream, BROKERS, 3)
        assert spread(stream, dict.fromkeys(BROKERS, "one"), 5) == placement(stream, BROKERS, 5)


def test_replicas_go_to_distinct_zones_while_there_are_enough() -> None:
    # three zones of unequal sizes: every stream has one replica in each
    zones = {b: "abc"[i % 3] if i < 6 else "a" for i, b in enumerate(BROKERS)}
    for stream in STREAMS:
        chosen = spread(stream, zones, 3)
        assert chosen == sorted(chosen)
        assert sorted(zones[b] for b in chosen) == ["a", "b", "c"], stream
        # the broker of each zone is that zone's first in the stream's order
        order = placement_order(stream, BROKERS)
        for broker in chosen:
            assert broker == next(b for b in order if zones[b] == zones[broker])


def test_with_fewer_zones_than_replicas_each_zone_is_used_before_one_twice() -> None:
    zones = {b: "ab"[i % 2] for i, b in enumerate(BROKERS)}
    for stream in STREAMS:
        chosen = spread(stream, zones, 5)
        assert len(set(chosen)) == 5
        counts = Counter(zones[b] for b in chosen)
        assert set(counts) == {"a", "b"}
        # the rest in placement order, whatever their zone
        order = placement_order(stream, BROKERS)
        firsts = {next(b for b in order if zones[b] == z) for z in "ab"}
        rest = [b for b in order if b not in firsts][:3]
        assert set(chosen) == firsts | set(rest)


def test_spread_is_the_same_whatever_the_order_of_the_brokers() -> None:
    zones = {b: "abc"[i % 3] for i, b in enumerate(BROKERS)}
    backwards = dict(reversed(list(zones.items())))
    for stream in STREAMS:
        assert spread(stream, zones, 3) == spread(stream, backwards, 3)


def test_the_only_broker_of_a_zone_holds_a_replica_of_every_stream() -> None:
    zones = {b: "c" if b == "broker-2" else "ab"[i % 2] for i, b in enumerate(BROKERS)}
    for stream in STREAMS:
        assert "broker-2" in spread(stream, zones, 3)
    # once it is gone, two zones for three replicas: both used, one twice
    without = {b: z for b, z in zones.items() if b != "broker-2"}
    for stream in STREAMS:
        assert Counter(without[b] for b in spread(stream, without, 3)).keys() == {"a", "b"}


def test_a_lost_replica_is_replaced_in_a_zone_the_others_are_not_in() -> None:
    zones = {b: "abc"[i % 3] for i, b in enumerate(BROKERS)}
    for stream in STREAMS:
        placed = spread(stream, zones, 3)
        lost = placed[0]
        up = {b: z for b, z in zones.items() if b != lost}
        order = replacement_order(stream, up, placed)
        assert sorted(order) == sorted(up)
        others = [b for b in placed if b != lost]
        first = next(b for b in order if b not in placed)
        assert zones[first] == zones[lost]  # the only zone no replica left is in
        # and within it, the placement order
        assert first == next(
            b for b in placement_order(stream, list(up)) if zones[b] == zones[lost]
        )
        assert sorted(zones[b] for b in [*others, first]) == ["a", "b", "c"]


def test_without_zones_a_replacement_follows_the_placement_order() -> None:
    zones = dict.fromkeys(BROKERS, "")
    for stream in STREAMS[:20]:
        placed = placement(stream, BROKERS, 3)
        assert replacement_order(stream, zones, placed) == placement_order(stream, BROKERS)
