"""What a leader knows of each follower's log, and how it sends to it.

- PROBE: where the logs agree is not known yet; one append at a time, the next only
  after an answer or a heartbeat's answer (so a lost message costs a heartbeat).
- REPLICATE: the logs agree up to ``match``; appends are sent back to back.
- SNAPSHOT: the follower is behind the leader's first entry; a snapshot is on its way
  and nothing else is sent until it is answered (or, since the message may be lost, a
  heartbeat's answer shows it did not arrive: then it is sent again).
"""

from __future__ import annotations

import enum


class Mode(enum.Enum):
    PROBE = "probe"
    REPLICATE = "replicate"
    SNAPSHOT = "snapshot"


class Progress:
    def __init__(self, next_index: int, epoch: int = 0) -> None:
        self.match = 0
        self.next = next_index
        self.mode = Mode.PROBE
        self.probe_sent = False  # in PROBE: an append is out, unanswered
        self.pending_snapshot = 0  # in SNAPSHOT: the index of the snapshot sent
        self.recent_active = False  # heard from since the last check-quorum
        # docs/raft.md, "Corruption": the follower's epoch and whether it is repairing,
        # from its answers; and the index of the entry this leader appended when it
        # learned the follower restarted repairing -- once that is committed (without
        # the follower, whose answers do not count while it repairs), holding the
        # leader's log up to its commit index repairs it. 0: no such entry.
        self.epoch = epoch
        self.repairing = False
        self.repair_index = 0

    @property
    def paused(self) -> bool:
        return self.mode is Mode.SNAPSHOT or (self.mode is Mode.PROBE and self.probe_sent)

    def become_probe(self) -> None:
        if self.mode is Mode.SNAPSHOT:
            self.next = max(self.match + 1, self.pending_snapshot + 1)
        else:
            self.next = self.match + 1
        self.mode = Mode.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0

    def become_replicate(self) -> None:
        self.mode = Mode.REPLICATE
        self.next = self.match + 1
        self.pending_snapshot = 0

    def become_snapshot(self, index: int) -> None:
        self.mode = Mode.SNAPSHOT
        self.pending_snapshot = index

    def restart_epoch(self, epoch: int, repairing: bool, last_index: int) -> None:
        """The follower restarted from a damaged log: all that was known of it is void."""
        self.epoch = epoch
        self.repairing = repairing
        self.repair_index = 0
        self.match = 0
        self.next = last_index + 1
        self.mode = Mode.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0

    def answered(self, repairing: bool) -> None:
        """An answer of the current epoch: a node repaired in it stays repaired (an
        older answer, still saying it repairs, may come after)."""
        self.repairing = self.repairing and repairing

    def repair_epoch(self, committed: int) -> int:
        """The epoch an append says it may repair the follower in: its own, once the
        entry appended for its repair is committed (``committed`` the leader's commit
        index); 0 before that, or when it is not repairing (nothing to repair)."""
        if self.repairing and 0 < self.repair_index <= committed:
            return self.epoch
        return 0

    def sent(self, last_sent: int | None) -> None:
        """An append went out, its last entry ``last_sent`` (None: no entries)."""
        if self.mode is Mode.REPLICATE:
            if last_sent is not None:
                self.next = last_sent + 1
        else:
            self.probe_sent = True

    def acked(self, index: int) -> bool:
        """The follower holds the leader's log up to ``index``; True if that is news."""
        self.probe_sent = False
        if index <= self.match:
            return False
        self.match = index
        self.next = max(self.next, index + 1)
        return True

    def rejected(self, refused: int, hint: int) -> bool:
        """The follower refused an append after ``refused``; ``hint`` is where the logs
        may agree. False if the refusal is stale (an answer to an older append)."""
        if self.mode is Mode.REPLICATE:
            if refused <= self.match:
                return False
            self.become_probe()
            return True
        if self.next - 1 != refused:
            return False
        self.next = max(min(refused, hint + 1), self.match + 1)
        self.probe_sent = False
        return True
