"""`python -m bench reliable` and `python -m bench chaos` end to end with small loads (real
broker processes, no process left behind), and the chaos bench's counting on its own:
the counts are the result, so they must catch what they claim to catch.

Plain ``def`` tests: each command runs its own uvloop event loop, which cannot start
inside a running one.
"""

from __future__ import annotations

import re

import pytest

import meshbus
from bench.chaos import NO_GROUP, PAYLOAD, Tally, chaos, plan_sends
from bench.reliable import reliable
from tests.bench.helpers import last_line, run_bench

_SENDER = meshbus.Unicast("s", 1).to_bytes()
_POOL = meshbus.Anycast("chaos").to_bytes()


def test_reliable_last_line() -> None:
    line = last_line(reliable, "--count", "2000", "--runs", "1")
    match = re.fullmatch(r"plain=(\d+) reliable=(\d+) ratio=(\d+\.\d{3})", line)
    assert match, line
    plain, reliable_, ratio = int(match[1]), int(match[2]), float(match[3])
    assert plain > 0
    assert reliable_ > 0
    # The ratio is printed to three decimals: half a unit of the last one is its rounding.
    assert ratio == pytest.approx(reliable_ / plain, rel=0.01, abs=0.0005)


# The healing goal after the pause: whole within 3 heartbeat intervals + 1 s.
_HEAL_GOAL_S = 3 * 0.5 + 1.0


def _check_chaos(line: str) -> None:
    fields = dict(item.split("=") for item in line.split())
    assert list(fields) == ["lost", "duplicated", "out_of_order", "two_members", "healed_s"]
    counts = ("lost", "duplicated", "out_of_order", "two_members")
    assert {name: fields[name] for name in counts} == dict.fromkeys(counts, "0")
    assert 0 <= float(fields["healed_s"]) <= _HEAL_GOAL_S


def test_chaos_in_process() -> None:
    _check_chaos(last_line(chaos, "--count", "3000", "--groups", "5"))


def test_chaos_as_a_command_with_b_isolated_under_pause_minority() -> None:
    sizes = ("--count", "3000", "--groups", "7", "--group-size", "4")
    rule = ("--isolate", "--partition-handling", "pause-minority")
    _check_chaos(run_bench("chaos", *sizes, *rule))


# -- the counting -------------------------------------------------------------------------


def _message(
    msg_id: int, group: int = NO_GROUP, seq: int = 0, reassigned: bool = False
) -> meshbus.Message:
    payload = PAYLOAD.pack(msg_id, 0, group, seq)
    return meshbus.Message(_SENDER, _POOL, payload, msg_id, 0, None, group_reassigned=reassigned)


def test_tally_counts_duplicates_order_and_switches() -> None:
    tally = Tally(10)
    first, second = tally.listener("receiver 0"), tally.listener("receiver 1")
    first(_message(0))
    first(_message(0))  # a duplicate
    first(_message(1, group=3, seq=1))
    first(_message(3, group=3, seq=3))
    first(_message(2, group=3, seq=2))  # below seq 3: out of order
    second(_message(4, group=3, seq=4))  # another member, unflagged
    first(_message(5, group=3, seq=5, reassigned=True))  # back, flagged
    first(_message(3, group=3, seq=3))  # a duplicate is not out of order as well
    assert tally.received == 6
    assert [n for n in tally.counts if n > 1] == [2, 2]
    assert tally.out_of_order == 1
    assert (tally.switches, tally.unflagged) == (2, 1)


@pytest.mark.parametrize(("count", "groups", "size"), [(30, 0, 1), (3000, 5, 20), (31, 7, 4)])
def test_plans_send_every_id_once(count: int, groups: int, size: int) -> None:
    receivers = [meshbus.Unicast("r", i + 1) for i in range(3)]
    plans = plan_sends(count, groups, size, receivers)
    ids = sorted(send[0] for plan in plans for send in plan)
    assert ids == list(range(count + groups * size))
    for index, plan in enumerate(plans):
        unicast = [send for send in plan if send[2] == NO_GROUP]
        assert all(dst != receivers[index] for _, dst, _, _, _ in unicast)
        seqs: dict[int, list[int]] = {}
        for _, _, group, seq, final in plan:
            if group != NO_GROUP:
                seqs.setdefault(group, []).append(seq)
                assert final == (seq == size)
        assert all(found == list(range(1, size + 1)) for found in seqs.values())


def test_tally_counts_a_group_whose_message_reached_two_members() -> None:
    tally = Tally(10)
    first, second = tally.listener("receiver 0"), tally.listener("receiver 1")
    first(_message(1, group=3, seq=1))
    first(_message(1, group=3, seq=1))  # the same member again: a duplicate, not two
    assert tally.two_members == set()
    second(_message(1, group=3, seq=1))
    first(_message(5))  # a unicast message is no group's
    second(_message(5))
    assert tally.two_members == {(0, 3)}
