"""When a replicated stream's Raft log is compacted, and to where (CompactionPolicy)."""

from __future__ import annotations

import pytest

from meshbus.broker.replication.compaction import CompactionPolicy
from meshbus.errors import InvalidArgument

POLICY = CompactionPolicy(entries=100, bytes=10_000)


def test_not_due_until_the_entries_or_their_bytes_reach_a_threshold() -> None:
    assert POLICY.compact_to(snapshot=0, applied=99, held_bytes=9_999) is None
    assert POLICY.compact_to(snapshot=0, applied=100, held_bytes=0) == 100
    assert POLICY.compact_to(snapshot=50, applied=149, held_bytes=0) is None
    assert POLICY.compact_to(snapshot=50, applied=60, held_bytes=10_000) == 60


def test_a_follower_compacts_to_what_it_applied() -> None:
    assert POLICY.compact_to(snapshot=200, applied=300, held_bytes=500, followers=()) == 300


def test_a_leader_keeps_what_its_live_followers_lack() -> None:
    assert POLICY.compact_to(0, applied=120, held_bytes=0, followers=[118, 90]) == 90
    assert POLICY.compact_to(0, applied=120, held_bytes=0, followers=[120, 130]) == 120


def test_a_follower_far_behind_holds_the_log_up_to_twice_the_threshold_only() -> None:
    # Behind the snapshot: nothing to compact while under twice the threshold...
    assert POLICY.compact_to(100, applied=250, held_bytes=0, followers=[40]) is None
    # ... then the log is compacted past it (it is sent the snapshot).
    assert POLICY.compact_to(100, applied=300, held_bytes=0, followers=[40]) == 300
    assert POLICY.compact_to(100, applied=150, held_bytes=20_000, followers=[40]) == 150


def test_thresholds_below_one_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="at least 1"):
        CompactionPolicy(entries=0, bytes=1)
