"""When a replicated stream's Raft log is compacted (docs/raft.md, "Snapshots of a
stream"): a plain rule the driver asks after every turn that applied entries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshbus.errors import InvalidArgument


@dataclass(frozen=True)
class CompactionPolicy:
    """When a group's log is compacted, and to where.

    Due once the entries applied since the last snapshot reach ``entries`` or their
    data ``bytes``. To the index applied -- but a leader keeps the entries its
    followers that answered lately still lack (their lowest match), so that a follower
    a little behind is sent entries, not a snapshot and a copy of the store; only while
    the log holds less than twice the thresholds, so a follower that stays behind does
    not hold the log up for ever. A follower gone silent counts for nothing: it gets a
    snapshot when it is back."""

    entries: int
    bytes: int

    def __post_init__(self) -> None:
        if self.entries < 1 or self.bytes < 1:
            raise InvalidArgument(
                f"compaction thresholds must be at least 1 (entries {self.entries}, "
                f"bytes {self.bytes})"
            )

    def compact_to(
        self, snapshot: int, applied: int, held_bytes: int, followers: Iterable[int] = ()
    ) -> int | None:
        """The index to compact the log at now (None: not now). ``snapshot``: the last
        snapshot's index; ``held_bytes``: the data of the entries applied since;
        ``followers``: the match indexes of the followers that answered lately (a
        leader's; none for a follower)."""
        held = applied - snapshot
        if held < self.entries and held_bytes < self.bytes:
            return None
        index = applied
        lowest = min(followers, default=applied)
        if lowest < applied and held < 2 * self.entries and held_bytes < 2 * self.bytes:
            index = lowest
        return index if index > snapshot else None
