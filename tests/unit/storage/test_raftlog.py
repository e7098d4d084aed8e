"""The Raft write-ahead log on real files: read back whole, a torn tail dropped, damage
found, a full disk refused, and the file rewritten."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import msgspec
import pytest

from meshbus.storage.errors import RaftLogFailed
from meshbus.storage.raftlog import MAGIC, RaftWal, WalEntry, WalRecord, WalSnapshot, frame
from meshbus.storage.raftstate import (
    STATE_MAGIC_GROUPS_ONLY,
    KeptState,
    KeptStates,
    StateFile,
    WalHardState,
)


def entries(term: int, first: int, last: int) -> list[WalEntry]:
    return [WalEntry(term, i, f"{term}/{i}".encode()) for i in range(first, last + 1)]


def write(path: Path, records: list[WalRecord], *, synced: bool = True) -> None:
    """``records`` appended to the log at ``path``; unless ``synced``, the broker stops
    before its fsync (the bytes are in the file, the synced mark is not moved)."""
    wal, _ = RaftWal.open(str(path))
    wal.append(records)
    if synced:
        wal.sync()
    wal.close()


def summary(wal: RaftWal) -> dict[str, tuple[WalHardState, int, list[tuple[int, int]]]]:
    return {
        group: (state.hard, state.snapshot.index, [(e.term, e.index) for e in state.entries])
        for group, state in sorted(wal.groups.items())
    }


FOUNDING = WalEntry(1, 1, voters=[1, 2, 3])


def test_records_read_back_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(
        path,
        [
            WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING], meta=b"config-a"),
            WalRecord("b", hard=WalHardState(1, 0, 1), entries=[FOUNDING]),
        ],
    )
    write(
        path,
        [
            WalRecord("a", hard=WalHardState(2, 1, 3), entries=entries(2, 2, 3)),
            WalRecord("b", entries=entries(1, 2, 2)),
        ],
    )
    wal, recovery = RaftWal.open(str(path))
    assert recovery.torn_bytes == 0
    assert not recovery.damage
    assert summary(wal) == {
        "a": (WalHardState(2, 1, 3), 0, [(1, 1), (2, 2), (2, 3)]),
        "b": (WalHardState(1, 0, 1), 0, [(1, 1), (1, 2)]),
    }
    assert wal.groups["a"].meta == b"config-a"
    assert wal.groups["a"].entries[0].voters == [1, 2, 3]
    assert wal.groups["a"].entries[2].data == b"2/3"
    wal.close()


def test_entries_replace_the_log_from_their_first_index(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", entries=[FOUNDING, *entries(1, 2, 5)])])
    write(path, [WalRecord("a", entries=entries(3, 3, 4))])  # a new leader's log wins
    wal, _ = RaftWal.open(str(path))
    assert [(e.term, e.index) for e in wal.groups["a"].entries] == [(1, 1), (1, 2), (3, 3), (3, 4)]
    wal.close()


def test_a_gap_in_the_log_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    wal, _ = RaftWal.open(str(path))
    wal.append([WalRecord("a", entries=[FOUNDING])])
    with pytest.raises(ValueError, match="entries from 5"):
        wal.append([WalRecord("a", entries=entries(1, 5, 5))])
    wal.close()


def test_snapshots_installed_and_compacted(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    snap = WalSnapshot(3, 1, [1, 2, 3], [], b"state")
    write(path, [WalRecord("a", entries=[FOUNDING, *entries(1, 2, 6)])])
    write(path, [WalRecord("a", snapshot=snap, compacted=True)])
    wal, _ = RaftWal.open(str(path))
    assert [e.index for e in wal.groups["a"].entries] == [4, 5, 6]
    assert wal.groups["a"].snapshot == snap
    wal.append([WalRecord("a", snapshot=WalSnapshot(9, 2, [1, 2, 3]))])  # from the leader
    assert wal.groups["a"].entries == []
    wal.append([WalRecord("a", entries=entries(2, 10, 10))])
    wal.close()
    wal, _ = RaftWal.open(str(path))
    assert (wal.groups["a"].snapshot.index, [e.index for e in wal.groups["a"].entries]) == (9, [10])
    wal.close()


def test_a_dropped_group_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", entries=[FOUNDING]), WalRecord("b", entries=[FOUNDING])])
    write(path, [WalRecord("a", dropped=True)])
    wal, _ = RaftWal.open(str(path))
    assert list(wal.groups) == ["b"]
    wal.close()


def last_record_bounds(path: Path) -> tuple[int, int]:
    """Where the last record of the tests below starts and ends in the file (read as
    bytes: opening the log would sync what an unsynced write left there)."""
    end = path.stat().st_size
    last = len(frame(WalRecord("a", hard=WalHardState(5, 2, 4), entries=entries(5, 4, 4))))
    return end - last, end


@pytest.mark.parametrize("cut", [1, 4, 8, 9, 20, -1])
def test_a_torn_tail_is_dropped_as_if_never_written(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING, *entries(1, 2, 3)])])
    last = [WalRecord("a", hard=WalHardState(5, 2, 4), entries=entries(5, 4, 4))]
    write(path, last, synced=False)
    start, end = last_record_bounds(path)
    keep = start + 1 if cut == -1 else end - cut
    os.truncate(path, keep)
    wal, recovery = RaftWal.open(str(path))
    assert recovery.torn_bytes == keep - start
    assert not recovery.damage
    # Its term and vote never reached the state file either (written after the fsync).
    assert summary(wal) == {"a": (WalHardState(1, 0, 1), 0, [(1, 1), (1, 2), (1, 3)])}
    assert path.stat().st_size == start  # cut back, so what is appended next follows it
    wal.append([WalRecord("a", hard=WalHardState(6, 0, 3), entries=entries(6, 4, 4))])
    wal.sync()
    wal.close()
    wal, recovery = RaftWal.open(str(path))
    assert recovery.torn_bytes == 0
    assert summary(wal)["a"] == (WalHardState(6, 0, 3), 0, [(1, 1), (1, 2), (1, 3), (6, 4)])
    wal.close()


@pytest.mark.parametrize("cut", [0, 1, 20])
def test_a_log_cut_short_after_it_was_synced_is_damage(tmp_path: Path, cut: int) -> None:
    """Records lost after their fsync -- the file truncated at a record's start, or
    inside it -- look like a clean end, or a torn write; the synced mark says the log
    was longer: the node may have acknowledged what it lost, so it repairs."""
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING, *entries(1, 2, 3)])])
    write(path, [WalRecord("a", hard=WalHardState(5, 2, 4), entries=entries(5, 4, 4))])
    start, end = last_record_bounds(path)
    os.truncate(path, start + cut)
    wal, recovery = RaftWal.open(str(path))
    assert recovery.damage == (
        f"the log's intact records end at byte {start}, and it was synced to byte {end}: "
        "it lost records after they were synced (cut short)"
    )
    assert summary(wal) == {"a": (WalHardState(5, 2, 1, 1, True), 0, [(1, 1), (1, 2), (1, 3)])}
    wal.close()
    # Read back once, the damage stays known (the state file), and the mark follows the
    # file as it is now: a second start finds nothing more.
    wal, recovery = RaftWal.open(str(path))
    assert recovery == type(recovery)()
    assert wal.groups["a"].hard.repairing
    wal.close()


def test_the_synced_mark_follows_a_rewrite_and_checks_nothing_when_lost(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(
        path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING, *entries(1, 2, 30)])]
    )
    wal, _ = RaftWal.open(str(path))
    wal.append([WalRecord("a", snapshot=WalSnapshot(25, 1, [1]), compacted=True)])
    wal.sync()
    wal.rewrite()  # a new, shorter file: the mark says its size
    wal.close()
    wal, recovery = RaftWal.open(str(path))
    assert recovery == type(recovery)()
    wal.close()
    start = path.stat().st_size
    write(path, [WalRecord("a", hard=WalHardState(2, 1, 30), entries=entries(2, 31, 31))])
    mark = tmp_path / "raft.synced"
    kept = mark.read_bytes()
    mark.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))  # a damaged mark
    os.truncate(path, start)
    wal, recovery = RaftWal.open(str(path))
    assert not recovery.damage  # a clean end, as before there was a mark
    wal.close()
    write(path, [WalRecord("a", hard=WalHardState(2, 1, 30), entries=entries(2, 31, 31))])
    mark.unlink()
    os.truncate(path, start)
    wal, recovery = RaftWal.open(str(path))
    assert not recovery.damage  # no mark
    assert [e.index for e in wal.groups["a"].entries][-1] == 30
    wal.close()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_in_the_last_record_is_damage(tmp_path: Path) -> None:
    """The last record is whole -- no byte missing, no sector of zeros -- and fails its
    checksum: the bit flipped after it was written and synced, maybe after it was
    answered. Dropped as a torn write, it would take the entries acknowledged with it,
    and the node would vote again without them. Its term and vote (5, for node 2) are
    in the state file: they stay."""
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])])
    write(path, [WalRecord("a", hard=WalHardState(5, 2, 4), entries=entries(5, 2, 2))])
    start, end = last_record_bounds(path)
    flip(path, end - 2)
    wal, recovery = RaftWal.open(str(path))
    assert "failing its checksum" in recovery.damage
    assert f"at byte {start}" in recovery.damage
    assert summary(wal) == {"a": (WalHardState(5, 2, 1, epoch=1, repairing=True), 0, [(1, 1)])}
    wal.close()


def test_a_last_record_with_a_sector_of_zeros_is_torn(tmp_path: Path) -> None:
    """What a crash leaves when the file grew but part of the write never reached the
    disk: a 512-byte sector of zeros in the last record (etcd's rule for torn writes)."""
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])])
    big = [WalEntry(2, 2, b"x" * 2000)]
    write(path, [WalRecord("a", hard=WalHardState(2, 1, 1), entries=big)], synced=False)
    good = len(MAGIC) + len(frame(WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])))
    sector = (good // 512 + 2) * 512  # a whole sector inside the last record
    with open(path, "r+b") as f:
        f.seek(sector)
        f.write(bytes(512))
    size = path.stat().st_size
    wal, recovery = RaftWal.open(str(path))
    assert (recovery.torn_bytes, recovery.damage) == (size - good, "")
    assert path.stat().st_size == good
    assert summary(wal) == {"a": (WalHardState(1, 0, 1), 0, [(1, 1)])}
    wal.close()


def test_zeros_after_the_last_record_are_torn(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])])
    good = path.stat().st_size
    with open(path, "ab") as f:
        f.write(bytes(4096))
    wal, recovery = RaftWal.open(str(path))
    assert (recovery.torn_bytes, recovery.damage) == (4096, "")
    assert path.stat().st_size == good
    assert summary(wal) == {"a": (WalHardState(1, 0, 1), 0, [(1, 1)])}
    wal.close()


def test_a_flipped_bit_before_the_end_is_damage_and_every_group_repairs(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(
        path,
        [
            WalRecord("a", hard=WalHardState(1, 0, 1, epoch=2), entries=[FOUNDING]),
            WalRecord("b", hard=WalHardState(1, 0, 1), entries=[FOUNDING]),
        ],
    )
    good = path.stat().st_size
    write(path, [WalRecord("a", hard=WalHardState(2, 1, 1, epoch=2), entries=entries(2, 2, 3))])
    write(path, [WalRecord("b", hard=WalHardState(2, 2, 1), entries=entries(2, 2, 2))])
    flip(path, good + 12)  # in the payload of the first record after `good`
    wal, recovery = RaftWal.open(str(path))
    assert "failing its checksum" in recovery.damage
    assert f"at byte {good}" in recovery.damage
    assert summary(wal) == {
        "a": (WalHardState(2, 1, 1, epoch=3, repairing=True), 0, [(1, 1)]),
        "b": (WalHardState(2, 2, 1, epoch=1, repairing=True), 0, [(1, 1)]),
    }
    assert path.stat().st_size == good
    wal.close()
    # The raised epochs were made durable before the log was cut back: the next start,
    # which finds no damage, still repairs in them.
    wal, recovery = RaftWal.open(str(path))
    assert not recovery.damage
    assert wal.groups["a"].hard == WalHardState(2, 1, 1, epoch=3, repairing=True)
    wal.close()


def test_a_length_past_the_limit_in_the_middle_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", entries=[FOUNDING])])
    good = path.stat().st_size
    write(path, [WalRecord("a", entries=entries(1, 2, 2))])
    write(path, [WalRecord("a", entries=entries(1, 3, 3))])
    with open(path, "r+b") as f:
        f.seek(good)
        f.write(b"\xff\xff\xff\x7f")
    wal, recovery = RaftWal.open(str(path))
    assert "record length" in recovery.damage
    assert [e.index for e in wal.groups["a"].entries] == [1]
    wal.close()


def test_a_file_that_is_no_raft_log_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    path.write_bytes(b"SQLite format 3\x00")
    with pytest.raises(RaftLogFailed, match="is not a meshbus Raft log"):
        RaftWal.open(str(path))
    path.write_bytes(MAGIC[:3])  # the magic cut short: a log created just before a crash
    wal, _ = RaftWal.open(str(path))
    assert wal.groups == {}
    wal.close()


def test_rewrite_keeps_the_live_state_only(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    wal, _ = RaftWal.open(str(path))
    wal.append([WalRecord("a", entries=[FOUNDING])])
    for i in range(2, 200):
        wal.append([WalRecord("a", hard=WalHardState(1, 0, i), entries=entries(1, i, i))])
    wal.append([WalRecord("a", snapshot=WalSnapshot(190, 1, [1, 2, 3]), compacted=True)])
    wal.sync()
    before = summary(wal)
    size = wal.size
    assert wal.should_rewrite(slack=0)
    wal.rewrite()
    assert wal.size < size / 10
    assert not wal.should_rewrite(slack=0)
    for _ in range(3):
        wal.append([WalRecord("a", hard=before["a"][0])])
    # Grown, but not doubled since it was last measured: not measured (nor rewritten).
    assert not wal.should_rewrite(slack=0)
    wal.append([WalRecord("a", entries=entries(1, 200, 200))])
    wal.sync()
    wal.close()
    wal, recovery = RaftWal.open(str(path))
    assert recovery == type(recovery)()
    assert summary(wal) == {"a": (before["a"][0], 190, [*before["a"][2], (1, 200)])}
    wal.close()


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from meshbus.storage.errors import RaftLogFailed
    from meshbus.storage.raftlog import RaftWal, WalEntry, WalRecord
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    wal, _ = RaftWal.open(sys.argv[1])
    wal.append([WalRecord("a", entries=[WalEntry(1, 1, voters=[1])])])
    wal.sync()
    resource.setrlimit(resource.RLIMIT_FSIZE, (wal.size + 3000, wal.size + 3000))
    index = 2
    try:
        while True:
            wal.append([WalRecord("a", entries=[WalEntry(1, index, b"x" * 1000)])])
            wal.sync()
            index += 1
    except RaftLogFailed as exc:
        print(index - 1)
        print(exc)
    try:
        wal.append([WalRecord("a", entries=[WalEntry(1, index, b"y")])])
    except RaftLogFailed as exc:
        print("still failed:", exc)
    """
)


def test_a_full_disk_fails_the_log_and_what_was_synced_survives(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    run = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    last, message, again = run.stdout.splitlines()
    assert int(last) == 3  # entries 2 and 3 (1,025 bytes a record) fit in 3,000 bytes, 4 does not
    assert "writing the Raft log" in message
    assert "acknowledges no append to a replicated stream until it restarts" in message
    assert "File too large" in message
    assert again.startswith("still failed: writing the Raft log")
    wal, recovery = RaftWal.open(str(path))
    assert [e.index for e in wal.groups["a"].entries] == [1, 2, 3]
    assert recovery.torn_bytes > 0  # entry 4's record, cut short by the limit
    wal.close()


def test_the_state_file_is_written_only_when_a_term_vote_or_epoch_changes(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    state = tmp_path / "raft.state"
    wal, _ = RaftWal.open(str(path))
    wal.append([WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])])
    wal.sync()
    written = state.stat().st_ino  # each write is a new file renamed over the old
    wal.append([WalRecord("a", hard=WalHardState(1, 0, 2), entries=entries(1, 2, 2))])
    wal.sync()
    assert state.stat().st_ino == written  # a commit index: the log's alone
    wal.append([WalRecord("a", hard=WalHardState(2, 3, 2))])
    wal.sync()
    assert state.stat().st_ino != written
    assert groups_in(state) == {"a": KeptState(2, 3)}
    wal.append([WalRecord("a", dropped=True)])
    wal.sync()
    assert groups_in(state) == {}
    wal.close()


def groups_in(path: Path) -> dict[str, KeptState]:
    state = KeptStates(str(path)).read()
    assert state is not None
    return state.groups


def state_file_with(path: Path, kept: dict[str, KeptState]) -> bytes:
    KeptStates(str(path)).write(StateFile(1, kept))
    return path.read_bytes()


def test_the_incarnation_is_drawn_with_the_state_file_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    wal, _ = RaftWal.open(str(path), new_incarnation=lambda: 7)
    wal.append([WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])])
    wal.sync()
    wal.close()
    wal, _ = RaftWal.open(str(path), new_incarnation=lambda: 8)
    assert wal.incarnation == 7
    wal.close()
    # A wiped data dir: a new incarnation, before any group is held.
    path.unlink()
    (tmp_path / "raft.state").unlink()
    wal, _ = RaftWal.open(str(path), new_incarnation=lambda: 9)
    assert wal.incarnation == 9
    wal.close()
    state = KeptStates(str(tmp_path / "raft.state")).read()
    assert state == StateFile(9, {})


def test_a_state_file_from_before_incarnations_is_given_one(tmp_path: Path) -> None:
    state = tmp_path / "raft.state"
    payload = msgspec.msgpack.encode({"a": KeptState(5, 2)})
    copy = struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    state.write_bytes(STATE_MAGIC_GROUPS_ONLY + copy)
    wal, _ = RaftWal.open(str(tmp_path / "raft.wal"), new_incarnation=lambda: 3)
    assert (wal.incarnation, wal.kept) == (3, {"a": KeptState(5, 2)})
    wal.close()
    assert KeptStates(str(state)).read() == StateFile(3, {"a": KeptState(5, 2)})


@pytest.mark.parametrize("copy", ["first", "second"])
def test_a_flipped_bit_in_one_copy_of_the_state_file_is_read_past(
    tmp_path: Path, copy: str
) -> None:
    state = tmp_path / "raft.state"
    data = state_file_with(state, {"a": KeptState(7, 2, 1)})
    offset = len(MAGIC) + 2 if copy == "first" else 4096 + 9  # the length, or the payload
    flip(state, offset)
    assert state.read_bytes() != data
    assert groups_in(state) == {"a": KeptState(7, 2, 1)}


def test_a_state_file_damaged_in_both_copies_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "raft.state"
    state_file_with(state, {"a": KeptState(7, 2, 1)})
    flip(state, len(MAGIC) + 9)
    flip(state, 4096 + 9)
    with pytest.raises(RaftLogFailed, match="damaged in both its copies"):
        RaftWal.open(str(tmp_path / "raft.wal"))


def test_a_log_without_a_state_file_keeps_its_own_hard_state(tmp_path: Path) -> None:
    """A log written before the state file (or whose first record's state never reached
    it: a crash between the two writes) is read with the hard state it holds, and the
    state file written from it."""
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(4, 1, 1), entries=[FOUNDING])])
    (tmp_path / "raft.state").unlink()
    wal, _ = RaftWal.open(str(path))
    assert wal.groups["a"].hard == WalHardState(4, 1, 1)
    wal.close()
    assert groups_in(tmp_path / "raft.state") == {"a": KeptState(4, 1)}


def test_a_group_whose_records_are_all_lost_is_known_lost(tmp_path: Path) -> None:
    path = tmp_path / "raft.wal"
    write(path, [WalRecord("a", hard=WalHardState(1, 0, 1), entries=[FOUNDING])])
    good = path.stat().st_size
    write(path, [WalRecord("b", hard=WalHardState(3, 2, 1), entries=[FOUNDING])])
    flip(path, good + 12)
    wal, recovery = RaftWal.open(str(path))
    assert recovery.damage
    assert list(wal.groups) == ["a"]
    assert wal.lost == ["b"]
    assert wal.kept["b"] == KeptState(3, 2, epoch=1, repairing=True)
    wal.close()
