"""Reliable-send and ordered-group bookkeeping: pure data structures, time passed in."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshbus.client.delivery import (
    COMPACT_SLACK,
    Ack,
    AckTable,
    GroupOrder,
    RetryPolicy,
    SeenWindow,
    Suspicion,
)
from meshbus.errors import InvalidArgument

A = b"a" * 16
B = b"b" * 16
C = b"c" * 16
TO_A = frozenset({A})  # a message sent to A alone: unicast, anycast, a group's member
G = b"group-1"
H = b"group-2"

# --- SeenWindow ---------------------------------------------------------------------------


def test_window_new_and_duplicate() -> None:
    w: SeenWindow[tuple[bytes, int]] = SeenWindow(capacity=10)
    assert w.add((A, 1))
    assert w.add((B, 1))  # same id from another source is a different message
    assert not w.add((A, 1))
    assert (A, 1) in w
    assert (A, 2) not in w
    assert len(w) == 2


def test_window_evicts_oldest_first() -> None:
    w: SeenWindow[int] = SeenWindow(capacity=3)
    for k in (1, 2, 3):
        assert w.add(k)
    assert w.add(4)
    assert 1 not in w
    assert [k in w for k in (2, 3, 4)] == [True, True, True]
    assert len(w) == 3
    assert w.add(5)
    assert 2 not in w
    assert w.add(1)  # evicted keys are new again
    assert 3 not in w
    assert len(w) == 3


def test_window_duplicate_does_not_refresh_age() -> None:
    w: SeenWindow[int] = SeenWindow(capacity=3)
    for k in (1, 2, 3):
        w.add(k)
    assert not w.add(1)  # seen again, but still the oldest
    w.add(4)
    assert 1 not in w
    assert 2 in w


def test_window_capacity_one() -> None:
    w: SeenWindow[int] = SeenWindow(capacity=1)
    assert w.add(1)
    assert not w.add(1)
    assert w.add(2)
    assert 1 not in w
    assert len(w) == 1


def test_window_matches_reference_model() -> None:
    rng = random.Random(7)
    cap = 50
    w: SeenWindow[int] = SeenWindow(capacity=cap)
    model: list[int] = []
    for _ in range(5000):
        k = rng.randrange(200)
        new = k not in model
        assert w.add(k) is new
        if new:
            model.append(k)
            if len(model) > cap:
                model.pop(0)
        assert len(w) == len(model)
    assert all(k in w for k in model)


def test_window_rejects_bad_capacity() -> None:
    with pytest.raises(InvalidArgument, match="capacity"):
        SeenWindow(capacity=0)


# --- RetryPolicy --------------------------------------------------------------------------


def test_policy_intervals_back_off_to_cap() -> None:
    p = RetryPolicy(ack_timeout=0.2, backoff=2.0, max_interval=2.0, max_attempts=10)
    got = [p.interval(a) for a in range(1, 8)]
    assert got == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    assert p.give_up_after() == pytest.approx(0.2 + 0.4 + 0.8 + 1.6 + 2.0 * 6)


def test_policy_defaults_and_constant_backoff() -> None:
    assert RetryPolicy().give_up_after() == pytest.approx(15.0)
    p = RetryPolicy(ack_timeout=0.5, backoff=1.0, max_attempts=3)
    assert [p.interval(a) for a in (1, 2, 3)] == [0.5, 0.5, 0.5]
    assert p.give_up_after() == pytest.approx(1.5)
    assert RetryPolicy(max_attempts=1).give_up_after() == pytest.approx(0.2)


def test_policy_huge_attempt_is_capped() -> None:
    assert RetryPolicy().interval(100_000) == 2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ack_timeout": 0}, "ack_timeout"),
        ({"ack_timeout": -1.0}, "ack_timeout"),
        ({"ack_timeout": math.nan}, "ack_timeout"),
        ({"backoff": 0.5}, "backoff"),
        ({"max_interval": 0}, "max_interval"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_policy_validation(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_interval_rejects_attempt_zero() -> None:
    with pytest.raises(InvalidArgument, match="attempt"):
        RetryPolicy().interval(0)


# --- AckTable -------------------------------------------------------------------------------

P = RetryPolicy(ack_timeout=1.0, backoff=2.0, max_interval=4.0, max_attempts=4)


def test_outbox_first_ack_of_its_receiver_completes() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    assert 1 in o
    assert len(o) == 1
    assert o.pending(1) is None
    assert o.attempts(1) == 1
    assert o.ack(1, B) is Ack.STRANGER, "not sent to B: B cannot complete it"
    assert 1 in o
    assert o.ack(1, A) is Ack.DONE
    assert 1 not in o
    assert o.ack(1, A) is Ack.UNKNOWN  # a second ack is late
    assert len(o) == 0
    assert o.next_deadline() is None


def test_outbox_a_moved_message_takes_the_ack_of_either_receiver() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    o.add(2, TO_A, now=0.0)
    o.allow(1, B)  # sent again, to B (a message group moved)
    o.allow(3, B)  # unknown: a no-op
    assert o.ack(2, B) is Ack.STRANGER
    assert o.ack(1, B) is Ack.DONE
    assert o.ack(2, A) is Ack.DONE
    assert 3 not in o


def test_outbox_multicast_needs_every_target() -> None:
    o = AckTable(P)
    o.add(7, frozenset({A, B, C}), now=0.0, every=True)
    assert o.ack(7, A) is Ack.COUNTED
    assert o.pending(7) == frozenset({B, C})
    assert o.ack(7, A) is Ack.COUNTED  # duplicate ack changes nothing
    assert o.ack(7, b"x" * 16) is Ack.STRANGER  # not a target
    assert o.pending(7) == frozenset({B, C})
    assert o.ack(7, C) is Ack.COUNTED
    assert o.ack(7, B) is Ack.DONE
    assert 7 not in o


def test_outbox_unknown_ids() -> None:
    o = AckTable(P)
    assert o.ack(99, A) is Ack.UNKNOWN
    o.remove(99)  # a no-op
    with pytest.raises(KeyError):
        o.pending(99)


def test_outbox_rejects_duplicate_id_and_empty_targets() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    with pytest.raises(ValueError, match="already"):
        o.add(1, TO_A, now=0.0)
    with pytest.raises(ValueError, match="empty"):
        o.add(2, frozenset(), now=0.0)
    with pytest.raises(ValueError, match="empty"):
        o.add(2, frozenset(), now=0.0, every=True)


def test_outbox_resend_then_give_up_exact_schedule() -> None:
    o = AckTable(P)  # intervals 1, 2, 4, 4; four attempts
    o.add(1, TO_A, now=10.0)
    assert o.next_deadline() == 11.0
    assert o.due(10.999) == ([], [])
    assert o.due(11.0) == ([1], [])  # attempt 2, waits interval(2) = 2
    assert o.attempts(1) == 2
    assert o.next_deadline() == 13.0
    assert o.due(12.0) == ([], [])
    assert o.due(13.0) == ([1], [])  # attempt 3, waits 4
    assert o.next_deadline() == 17.0
    assert o.due(17.0) == ([1], [])  # attempt 4 = max_attempts, waits 4
    assert o.attempts(1) == 4
    assert o.next_deadline() == 21.0
    assert o.due(21.0) == ([], [1])
    assert 1 not in o
    assert o.next_deadline() is None
    assert o.due(100.0) == ([], [])
    assert P.give_up_after() == 11.0  # first sent at 10.0, given up at 21.0


def test_outbox_late_timer_waits_full_interval_from_now() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    assert o.due(5.0) == ([1], [])  # deadline was 1.0; the timer fired late
    assert o.next_deadline() == 7.0


def test_outbox_single_attempt_gives_up_at_first_deadline() -> None:
    o = AckTable(RetryPolicy(ack_timeout=0.5, max_attempts=1))
    o.add(3, frozenset({A}), now=0.0)
    assert o.due(0.5) == ([], [3])


def test_outbox_due_lists_are_ascending() -> None:
    o = AckTable(P)
    # Later ids with earlier deadlines: the heap pops them first, due still sorts.
    for msg_id, now in ((5, 3.0), (4, 2.0), (3, 1.0), (2, 0.5), (1, 0.0)):
        o.add(msg_id, TO_A, now)
    resend, given_up = o.due(10.0)
    assert resend == [1, 2, 3, 4, 5]
    assert given_up == []
    one_shot = AckTable(RetryPolicy(max_attempts=1))
    for msg_id in (9, 3, 6):
        one_shot.add(msg_id, TO_A, now=float(-msg_id))
    assert one_shot.due(1.0) == ([], [3, 6, 9])


def test_outbox_due_mixes_resend_and_give_up() -> None:
    o = AckTable(RetryPolicy(ack_timeout=1.0, backoff=1.0, max_attempts=2))
    o.add(1, TO_A, now=0.0)
    assert o.due(1.0) == ([1], [])
    o.add(2, TO_A, now=1.0)
    assert o.due(2.0) == ([2], [1])
    assert o.ids() == [2]


def test_outbox_next_deadline_after_acks_and_removes() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    o.add(2, TO_A, now=1.0)
    o.add(3, frozenset({A, B}), now=2.0, every=True)
    assert o.next_deadline() == 1.0
    assert o.ack(1, A) is Ack.DONE
    assert o.next_deadline() == 2.0
    o.remove(2)
    assert o.next_deadline() == 3.0
    assert o.ack(3, A) is Ack.COUNTED
    assert o.next_deadline() == 3.0  # still waiting for B
    assert o.ack(3, B) is Ack.DONE
    assert o.next_deadline() is None
    assert o.due(100.0) == ([], [])  # stale heap items do nothing


def test_outbox_acked_entry_is_not_resent() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    o.add(2, TO_A, now=0.0)
    o.ack(1, A)
    assert o.due(1.0) == ([2], [])


def test_outbox_readded_id_is_tracked_once() -> None:
    o = AckTable(P)
    o.add(1, TO_A, now=0.0)
    o.remove(1)
    o.add(1, TO_A, now=0.0)  # same id, same deadline: a stale twin sits in the heap
    assert o.due(1.0) == ([1], [])
    assert o.attempts(1) == 2


def test_outbox_ids_ascending() -> None:
    o = AckTable(P)
    for msg_id in (5, 1, 9, 3):
        o.add(msg_id, TO_A, now=0.0)
    o.ack(9, A)
    assert o.ids() == [1, 3, 5]


def test_outbox_heap_stays_bounded_without_timer() -> None:
    o = AckTable(P)
    for i in range(20_000):
        o.add(i, TO_A, now=float(i))
        assert o.ack(i, A) is Ack.DONE
    assert len(o) == 0
    assert len(o._heap) <= COMPACT_SLACK + 1
    o.add(20_000, TO_A, now=0.0)
    assert o.next_deadline() == 1.0


def test_outbox_many_entries_few_due() -> None:
    o = AckTable(P)
    n = 100_000
    for i in range(n):
        o.add(i, TO_A, now=float(i))
    assert o.due(1.5) == ([0], [])
    assert o.next_deadline() == 2.0
    assert len(o) == n


# --- GroupOrder ---------------------------------------------------------------------------


def test_group_in_order() -> None:
    g: GroupOrder[str] = GroupOrder()
    assert g.push(A, G, 1, 1, "m1", 0.0) == [("m1", False)]
    assert g.push(A, G, 2, 1, "m2", 0.0) == [("m2", False)]
    assert g.push(A, G, 3, 3, "m3", 0.0) == [("m3", False)]
    assert len(g) == 1


def test_group_overtaken_message_held_then_released() -> None:
    g: GroupOrder[str] = GroupOrder()
    assert g.push(A, G, 3, 1, "m3", 0.0) == []  # key starts at floor 1, not at seq 3
    assert g.push(A, G, 2, 1, "m2", 0.0) == []
    assert g.push(A, G, 1, 1, "m1", 0.0) == [("m1", False), ("m2", False), ("m3", False)]
    assert g.push(A, G, 4, 1, "m4", 0.0) == [("m4", False)]


def test_group_duplicates() -> None:
    g: GroupOrder[str] = GroupOrder()
    g.push(A, G, 1, 1, "m1", 0.0)
    assert g.push(A, G, 1, 1, "again", 0.0) == []  # already delivered
    assert g.push(A, G, 3, 1, "m3", 0.0) == []
    assert g.push(A, G, 3, 1, "m3 again", 0.0) == []  # already held
    assert g.push(A, G, 2, 1, "m2", 0.0) == [("m2", False), ("m3", False)]


def test_group_keys_are_independent() -> None:
    g: GroupOrder[str] = GroupOrder()
    assert g.push(A, G, 1, 1, "a", 0.0) == [("a", False)]
    assert g.push(A, H, 2, 1, "ah", 0.0) == []
    assert g.push(B, G, 1, 1, "b", 0.0) == [("b", False)]
    assert len(g) == 3


def test_group_reassigned_only_on_first_with_floor_above_one() -> None:
    g: GroupOrder[str] = GroupOrder()
    # The group's messages 1..4 were delivered by another member before a failover.
    assert g.push(A, G, 6, 5, "m6", 0.0) == []
    assert g.push(A, G, 5, 5, "m5", 0.0) == [("m5", True), ("m6", False)]
    assert g.push(A, G, 7, 7, "m7", 0.0) == [("m7", False)]
    g.end(A, G)
    assert g.push(A, G, 1, 1, "fresh", 0.0) == [("fresh", False)]


def test_group_floor_advance_after_give_up() -> None:
    g: GroupOrder[str] = GroupOrder()
    g.push(A, G, 1, 1, "m1", 0.0)
    assert g.push(A, G, 3, 2, "m3", 0.0) == []  # m2 is missing
    assert g.push(A, G, 5, 2, "m5", 0.0) == []
    # The sender gave up on 2; 3 was acked on receipt here, so it is still delivered.
    assert g.push(A, G, 4, 4, "m4", 0.0) == [("m3", False), ("m4", False), ("m5", False)]
    assert g.push(A, G, 2, 2, "m2 late", 0.0) == []
    assert g.gaps == 0  # floor skips are the sender's give-ups, not receiver timeouts


def test_group_floor_advance_past_held_item_and_gap() -> None:
    g: GroupOrder[str] = GroupOrder()
    g.push(A, G, 1, 1, "m1", 0.0)
    g.push(A, G, 3, 2, "m3", 0.0)
    # Floor 5: 2 and 4 were given up; held m3 goes out, m6 waits for m5.
    assert g.push(A, G, 6, 5, "m6", 0.0) == [("m3", False)]
    assert g.push(A, G, 5, 5, "m5", 0.0) == [("m5", False), ("m6", False)]


def test_group_floor_advance_releases_held_above_floor() -> None:
    g: GroupOrder[str] = GroupOrder()
    g.push(A, G, 1, 1, "m1", 0.0)
    assert g.push(A, G, 4, 2, "m4", 0.0) == []
    # A resend of the held m4 carries the newer floor: it releases m4 itself.
    assert g.push(A, G, 4, 4, "m4", 0.0) == [("m4", False)]


def test_group_first_delivery_after_floor_advance_is_reassigned() -> None:
    g: GroupOrder[str] = GroupOrder()
    assert g.push(A, G, 3, 1, "m3", 0.0) == []
    assert g.push(A, G, 4, 3, "m4", 0.0) == [("m3", True), ("m4", False)]


def test_group_expire_releases_with_gaps() -> None:
    g: GroupOrder[str] = GroupOrder(hold_timeout=10.0)
    g.push(A, G, 1, 1, "m1", 0.0)
    g.push(A, G, 4, 1, "m4", 1.0)
    g.push(A, G, 5, 1, "m5", 2.0)
    assert g.expire(11.0) == []  # m4 has waited exactly hold_timeout, not longer
    assert g.expire(11.5) == [("m4", False), ("m5", False)]
    assert g.gaps == 2  # 2 and 3
    assert g.push(A, G, 6, 1, "m6", 12.0) == [("m6", False)]
    assert g.push(A, G, 2, 1, "m2 late", 12.0) == []


def test_group_expire_skips_only_gaps_that_waited_long_enough() -> None:
    g: GroupOrder[str] = GroupOrder(hold_timeout=10.0)
    g.push(A, G, 1, 1, "m1", 0.0)
    g.push(A, G, 3, 1, "m3", 0.0)
    g.push(A, G, 6, 1, "m6", 8.0)
    assert g.expire(10.5) == [("m3", False)]  # m6 has waited only 2.5 s
    assert g.gaps == 1
    assert g.push(A, G, 4, 1, "m4", 11.0) == [("m4", False)]
    assert g.expire(18.5) == [("m6", False)]
    assert g.gaps == 2


def test_group_expire_first_delivery_is_reassigned() -> None:
    g: GroupOrder[str] = GroupOrder(hold_timeout=1.0)
    g.push(A, G, 2, 1, "m2", 0.0)  # m1 never arrives
    assert g.expire(2.0) == [("m2", True)]
    assert g.gaps == 1


def test_group_idle_keys_are_forgotten() -> None:
    g: GroupOrder[str] = GroupOrder(hold_timeout=1000.0, idle_timeout=100.0)
    g.push(A, G, 1, 1, "a", 0.0)
    g.push(B, G, 2, 1, "b held", 0.0)  # holding: kept even when idle
    g.push(C, G, 1, 1, "c", 50.0)
    assert g.expire(99.0) == []
    assert len(g) == 3
    assert g.expire(120.0) == []
    assert len(g) == 2  # A forgotten; B holds an item, C pushed 70 s ago
    assert g.expire(151.0) == []
    assert len(g) == 1


def test_group_end_forgets_key() -> None:
    g: GroupOrder[str] = GroupOrder(hold_timeout=1.0)
    g.push(A, G, 1, 1, "m1", 0.0)
    g.push(A, G, 3, 1, "m3", 0.0)
    g.end(A, G)
    assert len(g) == 0
    assert g.expire(5.0) == []
    g.end(A, G)  # idempotent


def test_group_validation() -> None:
    with pytest.raises(InvalidArgument, match="timeout"):
        GroupOrder(hold_timeout=0)
    with pytest.raises(InvalidArgument, match="timeout"):
        GroupOrder(idle_timeout=-1.0)


@given(st.data())
def test_group_any_arrival_order_delivers_once_in_order(data: st.DataObject) -> None:
    n = data.draw(st.integers(min_value=1, max_value=30))
    seqs = list(range(1, n + 1))
    seqs += data.draw(st.lists(st.sampled_from(seqs), max_size=20))  # duplicates
    order = data.draw(st.permutations(seqs))
    g: GroupOrder[int] = GroupOrder()
    delivered: list[tuple[int, bool]] = []
    for seq in order:
        delivered += g.push(A, G, seq, 1, seq, 0.0)
    assert delivered == [(s, False) for s in range(1, n + 1)]


# --- Suspicion ----------------------------------------------------------------------------


def test_suspicion_declares_dead_once() -> None:
    s = Suspicion(threshold=3)
    assert not s.failed(A)
    assert not s.failed(A)
    assert s.count(A) == 2
    assert not s.dead(A)
    assert s.failed(A)
    assert s.dead(A)
    assert not s.failed(A)  # already dead
    assert s.dead(A)
    assert not s.dead(B)
    assert s.count(B) == 0


def test_suspicion_cleared_by_any_message() -> None:
    s = Suspicion(threshold=2)
    s.failed(A)
    s.heard(A)
    assert s.count(A) == 0
    assert not s.failed(A)
    assert s.failed(A)
    s.heard(A)
    assert not s.dead(A)
    assert not s.failed(A)
    s.heard(B)  # never suspected: a no-op


def test_suspicion_threshold_one_and_validation() -> None:
    assert Suspicion(threshold=1).failed(A)
    with pytest.raises(InvalidArgument, match="threshold"):
        Suspicion(threshold=0)
