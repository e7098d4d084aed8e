"""The redial table: whom a broker dials to heal the mesh, and when (meshbus.broker.mesh.redial)."""

from __future__ import annotations

import random

from meshbus.broker.mesh.redial import RedialTable

BASE, CAP, FORGET = 0.25, 1.0, 60.0


def table(seed: int = 1) -> RedialTable:
    return RedialTable(base=BASE, cap=CAP, forget_after=FORGET, rng=random.Random(seed))


def due_names(t: RedialTable, now: float, *, isolated: bool = False) -> list[str]:
    return sorted(c.name or c.address for c in t.due(now, isolated=isolated))


def test_a_new_candidate_is_due_at_once_and_then_not_before_its_backoff() -> None:
    t = table()
    t.want("b", "b:1", now=10.0)
    assert due_names(t, 10.0) == ["b"]
    assert due_names(t, 10.0) == [], "a dial in flight is not repeated at once"


def test_failures_back_off_doubling_with_jitter_up_to_the_cap() -> None:
    t = table()
    t.want("b", "b:1", now=0.0)
    now, gaps = 0.0, []
    for _ in range(8):
        [candidate] = t.due(now, isolated=False)
        t.failed("b", "b:1", now)
        gaps.append(candidate.due - now)
        now = candidate.due
    for attempt, gap in enumerate(gaps):
        step = min(CAP, BASE * 2**attempt)
        assert step / 2 <= gap <= step, (attempt, gap)
    assert max(gaps) <= CAP


def test_linked_and_left_end_a_candidacy() -> None:
    t = table()
    t.want("b", "b:1", now=0.0)
    t.want("c", "c:1", now=0.0)
    t.linked("b", "b:1")
    t.left("c")
    assert t.names() == []
    assert due_names(t, 5.0) == []


def test_a_broker_replaced_under_its_name_is_dialled_at_its_new_address() -> None:
    t = table()
    t.want("b", "10.0.0.1:7400", now=0.0)
    t.want("b", "10.0.0.2:7400", now=0.0)
    [candidate] = t.due(0.0, isolated=False)
    assert candidate.address == "10.0.0.2:7400"


def test_a_candidate_is_forgotten_after_failing_for_forget_after_seconds() -> None:
    t = table()
    t.want("b", "b:1", now=0.0)
    t.failed("b", "b:1", now=FORGET - 1)
    assert t.names() == ["b"]
    t.failed("b", "b:1", now=FORGET)
    assert t.names() == []


def test_seeds_are_dialled_only_while_the_broker_is_alone() -> None:
    t = table()
    t.add_seeds(["s:1", "s:2"], now=0.0)
    assert due_names(t, 0.0, isolated=False) == []
    assert due_names(t, 0.0, isolated=True) == ["s:1", "s:2"]
    t.failed("", "s:1", now=0.0)
    assert due_names(t, 0.1, isolated=True) == []
    t.linked("a", "s:1")  # linked to the broker at that seed: its backoff starts afresh
    assert due_names(t, 0.1, isolated=True) == ["s:1"]
    assert len(t) == 0, "seeds are not named candidates"
