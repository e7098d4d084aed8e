"""The meta group's state machine: applied in log order, every voter holds the same
records at each index, and a name is taken by the first add that commits it."""

from __future__ import annotations

import msgspec

from meshbus.broker.replication.meta import (
    ADD,
    ADDED,
    ALREADY,
    DELETED,
    EXISTS,
    MEMBERS,
    NO_STREAM,
    REFUSED,
    REMOVED,
    UPDATED,
    ConfigBody,
    MetaCommand,
    MetaState,
    Placed,
    decode_command,
    decode_config,
    encode_command,
    founding_config,
    meta_voters,
)
from meshbus.storage.store import StreamConfig

ABC = [Placed("a", 11), Placed("b", 12), Placed("c", 13)]


def add(name: str, members: list[Placed] = ABC) -> MetaCommand:
    return MetaCommand(ADD, name, b"config of " + name.encode(), members)


def test_the_first_add_of_a_name_takes_it_and_another_stream_of_it_is_refused() -> None:
    state = MetaState()
    assert state.apply(1, add("ledger")) == ADDED
    elsewhere = [Placed("d", 14), Placed("e", 15), Placed("f", 16)]
    # The same stream asked again (placed elsewhere this time): it is there already.
    assert state.apply(2, add("ledger", elsewhere)) == ALREADY
    # Another configuration, or another count of replicas: another stream, refused.
    other = MetaCommand(ADD, "ledger", b"another config", elsewhere)
    assert state.apply(3, other) == EXISTS
    assert state.apply(4, add("ledger", [*elsewhere, Placed("g"), Placed("h")])) == EXISTS
    record = state.streams["ledger"]
    assert record.brokers == ["a", "b", "c"]  # the first one's placement stays
    assert (record.index, record.config, record.confirmed) == (1, b"config of ledger", False)
    assert state.applied == 4


def test_members_follow_the_group_and_confirm_it() -> None:
    state = MetaState()
    state.apply(1, add("ledger"))
    assert state.unconfirmed() == [("ledger", state.streams["ledger"])]
    now = [Placed("a", 11), Placed("b", 12), Placed("d", 20)]  # c replaced by d
    assert state.apply(2, MetaCommand(MEMBERS, "ledger", members=now)) == UPDATED
    record = state.streams["ledger"]
    assert record.members == now
    assert record.founding == ABC  # the group's node ids 1..3 stay those of its founding
    assert record.confirmed
    assert state.unconfirmed() == []
    assert state.apply(3, MetaCommand(MEMBERS, "other", members=now)) == NO_STREAM
    assert "other" not in state.streams


def test_a_deleted_name_is_free_again() -> None:
    state = MetaState()
    state.apply(1, add("ledger"))
    assert state.apply(2, MetaCommand(DELETED, "ledger")) == REMOVED
    assert state.apply(3, MetaCommand(DELETED, "ledger")) == NO_STREAM
    assert state.apply(4, add("ledger")) == ADDED
    assert state.streams["ledger"].index == 4


def test_a_command_of_another_stream_of_the_name_changes_nothing() -> None:
    """A group's MEMBERS and DELETED name its record (the index of its ADD): the group
    of a deleted stream, late or telling again, never changes a later stream's record."""
    state = MetaState()
    state.apply(1, add("ledger"))
    assert state.apply(2, MetaCommand(DELETED, "ledger", record=1)) == REMOVED
    assert state.apply(3, add("ledger")) == ADDED
    late = [Placed("x", 1), Placed("y", 2), Placed("z", 3)]
    assert state.apply(4, MetaCommand(MEMBERS, "ledger", members=late, record=1)) == NO_STREAM
    assert state.apply(5, MetaCommand(DELETED, "ledger", record=1)) == NO_STREAM
    record = state.streams["ledger"]
    assert (record.index, record.members, record.confirmed) == (3, ABC, False)
    assert state.apply(6, MetaCommand(MEMBERS, "ledger", members=late, record=3)) == UPDATED
    assert state.apply(7, MetaCommand(DELETED, "ledger", record=3)) == REMOVED
    assert state.streams == {}


def test_the_founding_configuration_names_the_record() -> None:
    config = ConfigBody.of(StreamConfig("ledger", (b"\x02" + bytes(15),)))
    state = MetaState()
    state.apply(7, MetaCommand(ADD, "ledger", msgspec.msgpack.encode(config), ABC))
    founded = decode_config(founding_config(state.streams["ledger"]))
    assert founded == msgspec.structs.replace(config, record=7)
    assert founded.config() == config.config()


def test_an_unknown_command_changes_nothing() -> None:
    state = MetaState()
    state.apply(1, add("ledger"))
    assert state.apply(2, MetaCommand(9, "ledger")) == REFUSED
    assert list(state.streams) == ["ledger"]


def test_every_voter_applying_the_same_log_holds_the_same_records() -> None:
    log = [
        add("a"),
        add("b"),
        add("a", [Placed("x")]),
        MetaCommand(MEMBERS, "b", members=[Placed("c", 13)]),
        MetaCommand(DELETED, "a"),
        add("a", [Placed("y")]),
    ]
    data = [encode_command(c) for c in log]  # as the entries carry them
    states = [MetaState(), MetaState(), MetaState()]
    outcomes = [[s.apply(i, decode_command(d)) for i, d in enumerate(data, 1)] for s in states]
    assert outcomes[0] == [ADDED, ADDED, EXISTS, UPDATED, REMOVED, ADDED]
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert states[0].dump() == states[1].dump() == states[2].dump()
    again = MetaState.load(states[0].dump())  # a snapshot of it
    assert again.streams == states[0].streams
    assert again.applied == 6


def test_the_voters_are_configured_or_the_first_ready_brokers_by_name() -> None:
    ready = ["b5", "b1", "b4", "b2", "b3", "b6"]
    assert meta_voters([], ready[:2]) == []  # too few to found it
    assert meta_voters([], ready[:4]) == ["b1", "b2", "b4"]
    assert meta_voters([], ready) == ["b1", "b2", "b3", "b4", "b5"]
    assert meta_voters([], list(reversed(ready))) == meta_voters([], ready)
    assert meta_voters(["z", "x", "y"], ready) == ["x", "y", "z"]
