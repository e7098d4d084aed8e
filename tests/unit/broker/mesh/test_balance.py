"""The mesh's pure rules: duplicate links, join quotas, redirects, drain spreading."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from meshbus.broker.mesh.balance import (
    excess,
    incoming_link_wins,
    quotas,
    redirect_target,
    spread_moves,
)


def test_duplicate_link_rule_is_the_same_on_both_ends() -> None:
    # a and b dialled each other: a keeps its own dial and b accepts a's.
    assert not incoming_link_wins("a", "b")  # at a: b's link loses
    assert incoming_link_wins("b", "a")  # at b: a's link wins
    for x, y in [("broker-7400", "broker-7401"), ("n2", "n10")]:
        assert incoming_link_wins(x, y) != incoming_link_wins(y, x)


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({"a": 10, "b": 10, "c": 10, "new": 0}, {"a": 8, "b": 8, "c": 7, "new": 7}),
        ({"a": 15, "b": 15, "new": 0}, {"a": 10, "b": 10, "new": 10}),
        ({"a": 1, "new": 0}, {"a": 1, "new": 0}),
        ({"a": 0, "b": 0, "new": 0}, {"a": 0, "b": 0, "new": 0}),
    ],
)
def test_quotas_are_even_within_one(counts: dict[str, int], expected: dict[str, int]) -> None:
    q = quotas(counts, "new")
    assert q == expected
    assert sum(q.values()) == sum(counts.values())
    assert max(q.values()) - min(q.values()) <= 1


def test_excess_moves_reach_an_even_spread() -> None:
    counts = {"a": 10, "b": 10, "c": 10, "new": 0}
    moves = {name: excess(counts, "new", name) for name in counts}
    assert moves == {"a": 2, "b": 2, "c": 3, "new": 0}
    after = {n: c - moves[n] for n, c in counts.items()}
    after["new"] = sum(moves.values())
    assert max(after.values()) - min(after.values()) <= 1
    assert excess(counts, "new", "unknown") == 0


@dataclass
class B:
    name: str
    address: str
    connectors: int
    capacity: int = 50
    ready: bool = True
    draining: bool = False


def test_redirect_goes_to_the_least_loaded_broker_with_room() -> None:
    brokers = [
        B("me", "m:1", 50),
        B("full", "f:1", 50),
        B("busy", "b:1", 30),
        B("idle", "i:1", 3),
        B("joining", "j:1", 0, ready=False),
        B("leaving", "l:1", 0, draining=True),
    ]
    assert redirect_target(brokers, exclude="me") == "i:1"
    assert redirect_target([B("me", "m:1", 1), B("full", "f:1", 50)], exclude="me") == ""


def test_drain_spreads_connectors_evenly() -> None:
    brokers = [
        B("me", "m:1", 9),
        B("a", "a:1", 5),
        B("b", "b:1", 2),
        B("x", "x:1", 0, draining=True),
    ]
    moves = spread_moves(9, brokers, exclude="me")
    assert len(moves) == 9
    final = {"a:1": 5 + moves.count("a:1"), "b:1": 2 + moves.count("b:1")}
    assert abs(final["a:1"] - final["b:1"]) <= 1
    assert "x:1" not in moves
    assert spread_moves(3, [B("me", "m:1", 3)], exclude="me") == []


def test_drain_spreads_by_load_not_by_a_boosted_capacity() -> None:
    # After a crash one broker takes 60 for a while, the other 50: still an even spread.
    brokers = [B("me", "m:1", 3), B("a", "a:1", 3, capacity=60), B("b", "b:1", 2)]
    moves = spread_moves(3, brokers, exclude="me")
    assert sorted(moves) == ["a:1", "b:1", "b:1"]


def test_drain_respects_capacity_while_any_broker_has_room() -> None:
    brokers = [B("me", "m:1", 4), B("a", "a:1", 1, capacity=2), B("b", "b:1", 5)]
    assert spread_moves(4, brokers, exclude="me") == ["a:1", "b:1", "b:1", "b:1"]
