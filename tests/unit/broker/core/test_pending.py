"""The pending-request table: reverse routes and deadlines, with no clock of its own."""

from __future__ import annotations

import random

from meshbus.address import Anycast, Unicast
from meshbus.broker.core.pending import (
    COMPACT_SLACK,
    WRONG_RESPONDER,
    PendingEntry,
    PendingTable,
    Tally,
)

R1 = Unicast("client", 1).to_bytes()
R2 = Unicast("client", 2).to_bytes()
DST = Unicast("server", 1).to_bytes()
FORGER = Unicast("forger", 1).to_bytes()
POOL = Anycast("pool").to_bytes()


def keys(entries: list[PendingEntry[str]]) -> list[tuple[bytes, int]]:
    return [(e.requester, e.msg_id) for e in entries]


def test_add_and_resolve() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 2, "a", 11.0, DST)
    assert len(t) == 2
    assert t.resolve(R1, 1) == "a"
    assert len(t) == 1
    assert t.resolve(R1, 1) is None  # a second response is late
    assert t.resolve(R1, 3) is None
    assert t.resolve(R1, 2) == "a"
    assert len(t) == 0


def test_key_is_requester_and_msg_id() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 7, "a", 10.0, DST)
    t.add(R2, 7, "b", 10.0, DST)
    assert len(t) == 2
    assert t.resolve(R2, 7) == "b"
    assert t.resolve(R1, 7) == "a"


def test_expire_returns_due_entries_in_deadline_order() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 30.0, DST)
    t.add(R1, 2, "a", 10.0, POOL)
    t.add(R2, 3, "b", 20.0, DST)
    t.add(R2, 4, "b", 40.0, DST)
    assert t.expire(5.0) == []
    got = t.expire(30.0)  # a deadline equal to now is due
    assert keys(got) == [(R1, 2), (R2, 3), (R1, 1)]
    assert got[0] == PendingEntry(R1, 2, "a", 10.0, POOL)
    assert got[1].link == "b"
    assert got[1].dst == DST
    assert len(t) == 1
    assert t.expire(30.0) == []
    assert keys(t.expire(1e9)) == [(R2, 4)]
    assert len(t) == 0


def test_equal_deadlines_expire_in_insertion_order() -> None:
    t: PendingTable[str] = PendingTable()
    for msg_id in (5, 3, 9, 1):
        t.add(R1, msg_id, "a", 1.0, DST)
    assert [e.msg_id for e in t.expire(1.0)] == [5, 3, 9, 1]


def test_resolve_after_expire_returns_none() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    assert keys(t.expire(10.0)) == [(R1, 1)]
    assert t.resolve(R1, 1) is None


def test_expire_after_resolve_returns_nothing() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 2, "a", 10.0, DST)
    assert t.resolve(R1, 1) == "a"
    assert keys(t.expire(100.0)) == [(R1, 2)]


def test_replacing_with_a_later_deadline() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 1, "b", 20.0, POOL)
    assert len(t) == 1
    assert t.expire(15.0) == []  # the old deadline no longer counts
    assert t.expire(20.0) == [PendingEntry(R1, 1, "b", 20.0, POOL)]
    assert len(t) == 0


def test_replacing_with_an_earlier_deadline() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 20.0, DST)
    t.add(R1, 1, "b", 10.0, DST)
    assert [e.link for e in t.expire(10.0)] == ["b"]
    assert t.expire(100.0) == []


def test_replacing_then_resolving() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 1, "b", 10.0, DST)
    assert t.resolve(R1, 1) == "b"
    assert t.resolve(R1, 1) is None
    assert t.expire(100.0) == []


def test_resolve_then_add_same_key_again() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    assert t.resolve(R1, 1) == "a"
    t.add(R1, 1, "b", 50.0, DST)
    assert t.expire(10.0) == []  # the stale item for the first request must not expire it
    assert [e.link for e in t.expire(50.0)] == ["b"]


def test_drop_link() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 2, "a", 20.0, DST)
    t.add(R2, 1, "b", 15.0, DST)
    assert t.drop_link("a") == 2
    assert t.drop_link("a") == 0
    assert t.drop_link("nobody") == 0
    assert len(t) == 1
    assert t.resolve(R1, 1) is None
    assert keys(t.expire(100.0)) == [(R2, 1)]


def test_next_deadline() -> None:
    t: PendingTable[str] = PendingTable()
    assert t.next_deadline() is None
    t.add(R1, 1, "a", 30.0, DST)
    assert t.next_deadline() == 30.0
    t.add(R1, 2, "a", 10.0, DST)
    assert t.next_deadline() == 10.0
    t.expire(10.0)
    assert t.next_deadline() == 30.0
    t.expire(30.0)
    assert t.next_deadline() is None


def test_next_deadline_may_be_a_resolved_entrys() -> None:
    # Documented: lazy deletion means the earliest deadline may belong to a resolved entry;
    # it is never later than the earliest live one, so a sweeper never wakes too late.
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 2, "a", 20.0, DST)
    t.resolve(R1, 1)
    deadline = t.next_deadline()
    assert deadline is not None
    assert deadline <= 20.0
    assert t.expire(10.0) == []
    assert t.next_deadline() == 20.0


def test_compaction_keeps_correctness() -> None:
    rng = random.Random(7)
    t: PendingTable[str] = PendingTable()
    live: dict[tuple[bytes, int], float] = {}
    for msg_id in range(1, 5001):
        deadline = rng.uniform(0, 1000)
        t.add(R1, msg_id, "a", deadline, DST)
        live[(R1, msg_id)] = deadline
        # Resolve most requests, in random order, so stale heap items pile up.
        if rng.random() < 0.9:
            key = rng.choice(list(live)) if len(live) > 1 else (R1, msg_id)
            assert t.resolve(*key) == "a"
            del live[key]
    assert len(t) == len(live)
    expected = sorted(live.items(), key=lambda kv: kv[1])
    half = expected[len(expected) // 2][1]
    first = t.expire(half)
    assert keys(first) == [k for k, d in expected if d <= half]
    rest = t.expire(1001.0)
    assert keys(rest) == [k for k, d in expected if d > half]
    assert len(t) == 0
    for key in live:
        assert t.resolve(*key) is None


def test_heap_stays_bounded_under_add_resolve_cycles() -> None:
    t: PendingTable[str] = PendingTable()
    for msg_id in range(10000):
        t.add(R1, msg_id, "a", float(msg_id), DST)
        t.resolve(R1, msg_id)
    # The module promises to rebuild the heap when stale items outnumber live ones 2:1
    # (plus a fixed slack).
    assert len(t._heap) <= 3 * len(t) + COMPACT_SLACK + 1


def test_heap_stays_bounded_when_the_same_key_is_replaced() -> None:
    """A connector that reuses one msg_id must not grow the heap (or make each add O(n)).

    The heap items of replaced entries are stale too: ``expire`` already skips them
    (their deadline no longer matches), so compaction should drop them as well.
    """
    t: PendingTable[str] = PendingTable()
    for i in range(5 * COMPACT_SLACK):
        t.add(R1, 1, "a", float(i), DST)
    assert len(t) == 1
    assert len(t._heap) <= 3 * len(t) + COMPACT_SLACK + 1
    assert keys(t.expire(1e9)) == [(R1, 1)]


def test_drop_via_removes_what_only_that_link_could_answer() -> None:
    table: PendingTable[str] = PendingTable()
    table.add(b"r1", 1, "req", 10.0, b"d", via="peer-b")
    table.add(b"r1", 2, "req", 10.0, b"d", via="peer-c")
    table.add(b"r2", 1, "req", 10.0, b"d")  # a local or multicast request: no single via
    gone = table.drop_via("peer-b")
    assert [(e.requester, e.msg_id, e.link) for e in gone] == [(b"r1", 1, "req")]
    assert len(table) == 2
    assert table.resolve(b"r1", 1) is None
    assert table.drop_via("peer-b") == []
    assert table.expire(10.0)[0].msg_id in (1, 2)  # the rest still expire as usual


class CountingLink:
    """A link that counts how often it is compared: what a scan of the table costs."""

    compared = 0

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        CountingLink.compared += 1
        return self is other

    def __hash__(self) -> int:
        return id(self)


def test_drop_link_and_drop_via_touch_only_that_links_entries() -> None:
    """Closing a link costs what it held: 10,000 other requests are never looked at."""
    t: PendingTable[CountingLink] = PendingTable()
    busy, idle, peer = CountingLink("busy"), CountingLink("idle"), CountingLink("peer")
    for i in range(10_000):
        t.add(R1, i, busy, 10.0, DST, peer if i % 2 else None)
    t.add(R2, 1, idle, 10.0, DST)
    t.add(R2, 2, idle, 10.0, DST, peer)
    CountingLink.compared = 0
    assert t.drop_link(idle) == 2
    assert CountingLink.compared <= 2
    assert len(t) == 10_000
    CountingLink.compared = 0
    gone = t.drop_via(peer)
    assert len(gone) == 5_000
    assert CountingLink.compared <= 5_000
    assert {e.link for e in gone} == {busy}
    assert t.count(busy) == 5_000
    assert t.drop_link(busy) == 5_000
    assert len(t) == 0


def test_count_follows_add_resolve_expire_replace_and_drop() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST)
    t.add(R1, 2, "a", 20.0, DST, "peer")
    t.add(R2, 1, "b", 10.0, DST)
    assert (t.count("a"), t.count("b"), t.count("nobody")) == (2, 1, 0)
    assert t.resolve(R1, 1) == "a"
    assert t.count("a") == 1
    t.add(R1, 2, "b", 30.0, DST)  # the same key, now b's and out on no single peer
    assert (t.count("a"), t.count("b")) == (0, 2)
    assert t.drop_via("peer") == []
    assert keys(t.expire(10.0)) == [(R2, 1)]
    assert t.count("b") == 1
    assert t.drop_link("a") == 0
    assert t.drop_link("b") == 1
    assert len(t) == 0
    assert t.count("b") == 0


def test_indexes_match_the_entries_under_random_operations() -> None:
    """And a tally shared by links a and b (a user's: meshbus.broker.core.usage) counts their
    entries, whatever removes them -- an entry of c, another user's, replacing one too."""
    rng = random.Random(7)
    t: PendingTable[str] = PendingTable()
    tally = Tally()
    links = ["a", "b", "c"]
    vias: list[str | None] = [None, "p", "q"]
    now = 0.0
    for _ in range(5_000):
        op = rng.random()
        if op < 0.5:
            link = rng.choice(links)
            shared = None if link == "c" else tally
            t.add(
                R1,
                rng.randrange(200),
                link,
                now + rng.random(),
                DST,
                rng.choice(vias),
                tally=shared,
            )
        elif op < 0.7:
            t.resolve(R1, rng.randrange(200))
        elif op < 0.8:
            t.accept_response(R1, rng.randrange(200), rng.choice((DST, FORGER)), "a")
        elif op < 0.9:
            now += 0.1
            t.expire(now)
        elif op < 0.95:
            t.drop_via(rng.choice(["p", "q"]))
        else:
            t.drop_link(rng.choice(links))
        for link in links:
            assert t.count(link) == sum(1 for e in t._entries.values() if e[0] == link)
        for via in ("p", "q"):
            assert t._by_via.get(via, set()) == {k for k, e in t._entries.items() if e[4] == via}
        assert tally.count == t.count("a") + t.count("b")


def test_add_refuses_past_max_per_link() -> None:
    t: PendingTable[str] = PendingTable(max_per_link=2)
    assert t.add(R1, 1, "a", 10.0, DST)
    assert t.add(R1, 2, "a", 10.0, DST)
    assert not t.add(R1, 3, "a", 10.0, DST)
    assert t.add(R2, 3, "b", 10.0, DST), "another link has its own room"
    assert t.resolve(R1, 3) is None, "nothing was recorded"
    assert t.resolve(R1, 1) == "a"
    assert t.add(R1, 3, "a", 10.0, DST)
    assert (t.count("a"), len(t)) == (2, 3)


def test_a_unicast_request_takes_a_response_from_its_destination_only() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST, "peer")
    assert t.accept_response(R1, 1, FORGER, "b") is WRONG_RESPONDER
    assert t.accept_response(R1, 1, FORGER, "peer") is WRONG_RESPONDER, "the link is no pass"
    assert (len(t), t.count("a")) == (1, 1), "a refused response leaves the entry as it was"
    assert t.accept_response(R1, 1, DST, "peer") == "a"
    assert t.accept_response(R1, 1, DST, "peer") is None, "a duplicate finds no entry"
    assert (len(t), t.count("a"), t.drop_via("peer")) == (0, 0, [])


def test_a_group_request_takes_a_response_over_a_link_it_went_out_on() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, POOL, responders=("picked",))
    t.add(R1, 2, "a", 10.0, POOL, responders=("b", "peer"))  # a multicast request
    assert t.accept_response(R1, 1, DST, "other") is WRONG_RESPONDER
    assert t.accept_response(R1, 1, DST, "picked") == "a", "any member on the picked link"
    assert t.accept_response(R1, 2, FORGER, "c") is WRONG_RESPONDER
    assert t.accept_response(R1, 2, FORGER, "peer") == "a"
    assert len(t) == 0


def test_a_refused_response_leaves_the_deadline_and_the_via_index() -> None:
    t: PendingTable[str] = PendingTable()
    t.add(R1, 1, "a", 10.0, DST, "peer")
    t.add(R1, 2, "a", 20.0, DST, "peer")
    assert t.accept_response(R1, 1, FORGER, "peer") is WRONG_RESPONDER
    assert keys(t.expire(10.0)) == [(R1, 1)], "still expires, once"
    assert t.accept_response(R1, 2, FORGER, "peer") is WRONG_RESPONDER
    assert keys(t.drop_via("peer")) == [(R1, 2)]
    assert t.expire(100.0) == []


def test_an_uncapped_request_is_recorded_past_max_per_link() -> None:
    t: PendingTable[str] = PendingTable(max_per_link=1)
    assert t.add(R1, 1, "peer", 10.0, POOL, responders=("picked",), capped=False)
    assert t.add(R1, 2, "peer", 10.0, POOL, responders=("picked",), capped=False)
    assert not t.add(R1, 3, "peer", 10.0, POOL, responders=("picked",))
    assert t.count("peer") == 2
