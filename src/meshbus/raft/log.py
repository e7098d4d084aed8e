"""The core's view of its log: the snapshot it starts from, the entries after it, and
three marks on them -- durable up to ``persisted``, committed up to ``committed``,
applied up to ``applied`` (applied <= committed <= last; persisted <= last).

The whole log since the snapshot is held in memory; the driver bounds it by
compacting (``compact``) once its state machine has a snapshot.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from meshbus.raft.config import Membership
from meshbus.raft.errors import LogConflict
from meshbus.raft.messages import Entry, Snapshot


class RaftLog:
    def __init__(self, snapshot: Snapshot, entries: Sequence[Entry], committed: int) -> None:
        self.snapshot = snapshot
        self._entries: list[Entry] = []
        self._changes: list[int] = []  # indexes of the entries that change the membership
        self.persisted = snapshot.index
        self._append(entries)
        self.persisted = self.last_index  # what the driver read back is durable
        # A log cut short by damage may end below the commit index that was stored.
        self.committed = min(max(committed, snapshot.index), self.last_index)
        self.applied = snapshot.index

    @property
    def first_index(self) -> int:
        return self.snapshot.index + 1

    @property
    def last_index(self) -> int:
        return self.snapshot.index + len(self._entries)

    @property
    def last_term(self) -> int:
        return self._entries[-1].term if self._entries else self.snapshot.term

    def term(self, index: int) -> int | None:
        """The term of the entry at ``index``; None if compacted away or not there."""
        if index == self.snapshot.index:
            return self.snapshot.term
        if self.first_index <= index <= self.last_index:
            return self._entries[index - self.first_index].term
        return None

    def is_up_to_date(self, index: int, term: int) -> bool:
        """Whether a log ending at (index, term) is at least as complete as this one."""
        return term > self.last_term or (term == self.last_term and index >= self.last_index)

    def entries(self, low: int, limit: int) -> tuple[Entry, ...]:
        """Up to ``limit`` entries from ``low`` (which must not be compacted)."""
        start = low - self.first_index
        return tuple(self._entries[start : start + limit])

    def unpersisted(self) -> tuple[Entry, ...]:
        return tuple(self._entries[self.persisted - self.snapshot.index :])

    def unapplied(self) -> tuple[Entry, ...]:
        """The committed entries not yet handed out to apply."""
        base = self.snapshot.index
        return tuple(self._entries[self.applied - base : self.committed - base])

    @property
    def membership(self) -> Membership:
        """The latest membership in the log, committed or not."""
        return self.membership_at(self.last_index)

    def membership_at(self, index: int) -> Membership:
        position = bisect.bisect_right(self._changes, index)
        if position == 0:
            return self.snapshot.membership
        membership = self._entries[self._changes[position - 1] - self.first_index].membership
        assert membership is not None
        return membership

    @property
    def last_change(self) -> int:
        """The index of the latest membership change in the log (the snapshot's if none)."""
        return self._changes[-1] if self._changes else self.snapshot.index

    def change_at(self, index: int) -> int:
        """The index of the latest membership change at or before ``index`` (the
        snapshot's if none in the log is)."""
        position = bisect.bisect_right(self._changes, index)
        return self._changes[position - 1] if position else self.snapshot.index

    def append(self, entries: Sequence[Entry]) -> None:
        """The leader's own entries, right after its last."""
        assert not entries or entries[0].index == self.last_index + 1
        self._append(entries)

    def try_append(self, prev_index: int, prev_term: int, entries: Sequence[Entry]) -> int | None:
        """A leader's entries after (prev_index, prev_term): None if this log has no
        such entry, else the index of the last entry this log now holds of the leader's.
        Entries already here are kept (a message may be late or repeated); from the
        first that differs, this log's tail is replaced."""
        if self.term(prev_index) != prev_term:
            return None
        for position, entry in enumerate(entries):
            if self.term(entry.index) == entry.term:
                continue
            if entry.index <= self.committed:
                raise LogConflict(
                    f"entry {entry.term}/{entry.index} would replace a committed entry "
                    f"(committed to {self.committed}): a log was damaged undetected"
                )
            self._truncate_after(entry.index - 1)
            self._append(entries[position:])
            break
        return prev_index + len(entries)

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """The last entry at or before ``index`` whose term is <= ``term``: where a log
        whose entry at ``index`` has ``term`` may agree with this one (index, term)."""
        index = min(index, self.last_index)
        while index > self.snapshot.index and (self.term(index) or 0) > term:
            index -= 1
        return index, self.term(index) or 0

    def commit_to(self, index: int) -> bool:
        if index <= self.committed:
            return False
        assert index <= self.last_index, (index, self.last_index)
        self.committed = index
        return True

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the whole log with a snapshot from the leader."""
        self.snapshot = snapshot
        self._entries.clear()
        self._changes.clear()
        self.persisted = self.committed = self.applied = snapshot.index

    def compact(self, index: int, data: bytes) -> Snapshot:
        """Drop the entries up to ``index`` (applied), keeping a snapshot in their place."""
        term = self.term(index)
        assert term is not None
        assert index <= self.applied
        snapshot = Snapshot(index, term, self.membership_at(index), data)
        del self._entries[: index - self.snapshot.index]
        del self._changes[: bisect.bisect_right(self._changes, index)]
        self.snapshot = snapshot
        return snapshot

    def _append(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            if entry.membership is not None:
                self._changes.append(entry.index)
        self._entries.extend(entries)

    def _truncate_after(self, index: int) -> None:
        del self._entries[index - self.snapshot.index :]
        del self._changes[bisect.bisect_right(self._changes, index) :]
        self.persisted = min(self.persisted, index)
