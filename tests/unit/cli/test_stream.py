"""What meshbus stream info shows of a replicated stream: its voters, the learners being
added in place of a lost replica, and each replica's state as its leader knows it."""

from __future__ import annotations

import pytest

from meshbus.cli.stream import _print_info
from meshbus.client.streams import StreamInfo

REPLACING = StreamInfo(
    name="ledger",
    broker="r0",
    captures=["multicast:ledger"],
    first_seq=1,
    last_seq=40,
    messages=40,
    bytes=400,
    consumers=[],
    max_msgs=0,
    max_bytes=0,
    max_age=0.0,
    dedupe_window=120.0,
    replicas=["r0", "r2"],
    leader="r0",
    replica_states=[
        {"broker": "r0", "state": "leader", "lag": 0, "voter": True},
        {"broker": "r2", "state": "follower", "lag": 0, "voter": True},
        {"broker": "r3", "state": "follower", "lag": 31, "voter": False},
    ],
    learners=["r3"],
)


def test_info_shows_voters_and_learners(capsys: pytest.CaptureFixture[str]) -> None:
    _print_info(REPLACING, as_json=False)
    shown = capsys.readouterr().out
    assert "r0, r2" in shown
    assert "r3 (copying the log, not counted yet)" in shown
    assert "follower learner, 31 entries behind" in shown
    assert "follower, 0 entries behind" in shown
