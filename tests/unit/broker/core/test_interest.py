"""The NATS interest tables between brokers (meshbus.broker.core.interest): what this
broker tells its peers, and what it holds of theirs in the subject table."""

from __future__ import annotations

import pytest

from meshbus.broker.core.interest import (
    InterestError,
    LocalInterest,
    PeerInterest,
    PeerSubscription,
)
from meshbus.broker.core.subjects import SubjectTable


def test_many_local_subscriptions_to_a_subject_are_one_entry_to_the_peers() -> None:
    local = LocalInterest()
    assert local.add(b"orders.*", b"") == 1
    assert local.add(b"orders.*", b"") is None
    assert local.add(b"orders.*", b"") is None
    assert local.remove(b"orders.*", b"") is None
    assert local.remove(b"orders.*", b"") is None
    assert local.remove(b"orders.*", b"") == 0
    assert len(local) == 0
    assert local.remove(b"orders.*", b"") is None  # never there: nothing to tell


def test_a_queue_groups_count_goes_to_the_peers_with_every_change() -> None:
    local = LocalInterest()
    assert [local.add(b"jobs", b"workers") for _ in range(3)] == [1, 2, 3]
    assert local.add(b"jobs", b"") == 1  # a plain one beside it is an entry of its own
    assert local.remove(b"jobs", b"workers") == 2
    assert sorted(local.snapshot()) == [(b"jobs", b"", 1), (b"jobs", b"workers", 2)]
    assert local.remove(b"jobs", b"workers") == 1
    assert local.remove(b"jobs", b"workers") == 0
    assert local.snapshot() == [(b"jobs", b"", 1)]


class Changes(list[bytes]):
    def __call__(self, subject: bytes) -> None:
        self.append(subject)


def tables(
    max_per_peer: int = 10, max_weight: int = 100
) -> tuple[SubjectTable[PeerSubscription[str]], PeerInterest[str], Changes]:
    table: SubjectTable[PeerSubscription[str]] = SubjectTable()
    changes = Changes()
    return table, PeerInterest(table, max_per_peer, max_weight, changes), changes


def test_a_peers_interest_is_a_row_of_the_subject_table() -> None:
    table, interest, changes = tables()
    interest.apply("b", b"orders.*", b"", 1)
    interest.apply("c", b"orders.>", b"", 1)
    interest.apply("c", b"orders.new", b"workers", 3)
    match = table.match(b"orders.new")
    assert sorted(row.peer for row in match.plain) == ["b", "c"]
    [(name, [row])] = [(name, list(members)) for name, members in match.queues]
    assert (name, row.peer, row.weight) == (b"workers", "c", 3)
    assert changes == [b"orders.*", b"orders.>", b"orders.new"]
    assert interest.count("c") == 2


def test_a_count_changes_in_place_and_a_cached_match_sees_it() -> None:
    table, interest, changes = tables()
    interest.apply("b", b"jobs", b"workers", 1)
    [(_, [row])] = table.match(b"jobs").queues
    interest.apply("b", b"jobs", b"workers", 5)
    assert row.weight == 5
    assert table.match(b"jobs").queues[0][1][0] is row  # the cached answer, still right
    assert changes == [b"jobs"]  # a new weight is no new row
    # A plain interest is present or not: its weight stays 1 whatever is said.
    interest.apply("b", b"news", b"", 7)
    assert table.match(b"news").plain[0].weight == 1


def test_a_count_of_zero_ends_the_entry() -> None:
    table, interest, changes = tables()
    interest.apply("b", b"a.b", b"", 1)
    interest.apply("b", b"a.b", b"", 0)
    assert not table.match(b"a.b")
    assert len(table) == 0
    assert interest.count("b") == 0
    interest.apply("b", b"never.there", b"", 0)  # stale or repeated: nothing
    assert len(table) == 0
    assert changes == [b"a.b", b"a.b"]


@pytest.mark.parametrize(
    ("subject", "queue", "count"),
    [
        (b"", b"", 1),
        (b"a..b", b"", 1),
        (b"a b", b"", 1),
        (b">.a", b"", 1),
        (b"a", b"has space", 1),
        (b"a", b"", 101),
        (b"a", b"", -1),
    ],
)
def test_what_no_broker_sends_is_refused_and_changes_nothing(
    subject: bytes, queue: bytes, count: int
) -> None:
    table, interest, changes = tables()
    with pytest.raises(InterestError):
        interest.apply("b", subject, queue, count)
    assert len(table) == 0
    assert changes == []


def test_entries_per_peer_are_capped() -> None:
    table, interest, _ = tables(max_per_peer=3)
    for i in range(3):
        interest.apply("b", b"s.%d" % i, b"", 1)
    with pytest.raises(InterestError, match="more than 3"):
        interest.apply("b", b"s.3", b"", 1)
    interest.apply("b", b"s.0", b"", 1)  # an entry it has: no new one
    interest.apply("c", b"s.3", b"", 1)  # the cap is per peer
    assert len(table) == 4


def test_a_lost_peer_takes_its_interest_with_it() -> None:
    table, interest, changes = tables()
    interest.apply("b", b"x.*", b"", 1)
    interest.apply("b", b"x.y", b"q", 2)
    interest.apply("c", b"x.y", b"", 1)
    assert table.match(b"x.y")
    changes.clear()
    assert interest.drop("b") == 2
    match = table.match(b"x.y")
    assert [row.peer for row in match.plain] == ["c"]
    assert match.queues == ()
    assert sorted(changes) == [b"x.*", b"x.y"]
    assert interest.drop("b") == 0


def test_a_lost_peers_interest_can_leave_a_step_at_a_time() -> None:
    table, interest, _ = tables(max_per_peer=100)
    for i in range(25):
        interest.apply("b", b"s.%d" % i, b"", 1)
    assert interest.drop("b", 10) == 10
    assert interest.count("b") == 15
    assert len(table) == 15
    assert interest.drop("b", 10) == 10
    assert interest.drop("b", 10) == 5
    assert interest.drop("b", 10) == 0
    assert len(table) == 0
