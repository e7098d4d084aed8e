"""The Raft log on disk: one append-only write-ahead file per broker for every group,
and beside it a small file of every group's hard state but its commit index.

Why one file: the driver (meshbus.broker.replication) makes the writes of every group
of a loop turn durable with one fsync; with a file per group it would take one each.

Why the second file (``raft.state``, ``KeptStates``; both side files are in
meshbus.storage.raftstate): damage to a record of the log loses every record after it,
the term and vote they held with them. A node that came
back at an older term could vote twice in a term, or answer a stale leader
(docs/raft.md, "Corruption"). So each group's term, vote, epoch and repairing flag
are also written to a file of their own, replaced whole (written, fsynced, renamed)
by ``sync`` whenever one of them changed -- after the log's fsync (a repair must not
be durable before the entries that made it), before ``sync`` returns and so before
any message that depends on them is sent. It holds its payload twice, each copy with
its checksum, in two sectors: one flipped bit loses neither. At ``open`` it is what
the groups' term, vote, epoch and repairing are read from; the log gives their commit
index. It also holds the broker's *incarnation* (``RaftWal.incarnation``): a random
number drawn when the file is first made, with the data dir's Raft state. A broker
whose data dir was wiped comes back with another: the groups it was a member of tell
its new self from its old one and replace it (docs/raft.md, "Incarnations").

The file: an 8-byte magic, then records ``<u32 length><u32 crc32 of the payload>
<payload>``; a payload is one ``WalRecord`` (msgpack): what one Ready of one group
asks to make durable -- its hard state, a snapshot, entries -- as one atomic record.
Reading it back (``RaftWal.open``):

- what a write that never finished leaves at the end of the file (a crash before its
  fsync) is dropped, as if never written, and the file cut back to the record before
  it: a last record cut short, zeros where records would follow (the file grew, the
  data never reached the disk), or a last record failing its checksum with a whole
  512-byte sector of zeros in it (etcd's rule for torn writes, wal/decoder.go).
  Nothing was sent that depended on it (docs/raft.md, "The driver's contract"), so
  this is no damage;
- any other record failing its checksum is damage -- the last one too, when it is
  whole: a bit flipped after the record was synced, and maybe answered. What follows
  it cannot be trusted. The intact prefix is kept and every group is restarted
  *repairing* with its epoch raised (docs/raft.md, "Corruption"): it may have lost
  entries it acknowledged, so it votes again only once the leader has brought it up
  to date. The raised epochs are written to the state file before the log is cut
  back: a crash between the two must not leave a log with nothing to say it was
  damaged.

Why a third file (``raft.synced``, ``SyncedMark``): a log cut short *after* it was
synced -- truncated by hand or by a bad copy, or the last blocks of the file lost --
reads back as a clean file, or as a torn write, and the node would vote without the
entries it acknowledged (JetStream lost acknowledged writes so, in 2.12.1). So after
each fsync of the log, its size (and the file's inode, which a rewrite changes) is
written there, with a checksum and without an fsync of its own: the log's fsync came
first, so the size it says was on the disk. At ``open`` an intact prefix shorter than
that size is damage, as a failed checksum is. A mark lost or damaged, or of another
file, checks nothing.

It knows nothing of the Raft core's classes (storage imports no broker or raft code):
the driver converts its entries and states into this module's records.

A write or fsync that fails (a full disk, an I/O error) leaves the log *failed*: every
later append raises ``RaftLogFailed`` -- the broker stops acknowledging rather than
acknowledge what may not be on disk -- until the broker restarts and reads back what
is intact.

``rewrite()`` compacts the file: the live state of every group (hard state, snapshot,
entries after it) written to a new file, fsynced, renamed over the old one.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from meshbus.storage.errors import RaftLogFailed
from meshbus.storage.raftstate import (
    KeptState,
    KeptStates,
    StateFile,
    SyncedMark,
    WalHardState,
    fsync_dir,
    random_incarnation,
    write_all,
)

MAGIC = b"MBRAFT1\n"
_HEADER = struct.Struct("<II")
# No record is larger: a length past this is damage, not an allocation to attempt.
MAX_RECORD = 64 << 20
# Rewrite once the file holds this many bytes more than the live state needs.
REWRITE_SLACK = 64 << 20
# A write cut short by a crash leaves whole sectors of zeros (_looks_torn).
SECTOR = 512


class WalEntry(msgspec.Struct, array_like=True, frozen=True):
    term: int
    index: int
    data: bytes = b""
    # A membership change: its voters and learners (None: an entry of data).
    voters: list[int] | None = None
    learners: list[int] = msgspec.field(default_factory=list)


class WalSnapshot(msgspec.Struct, array_like=True, frozen=True):
    index: int = 0
    term: int = 0
    voters: list[int] = msgspec.field(default_factory=list)
    learners: list[int] = msgspec.field(default_factory=list)
    data: bytes = b""


class WalRecord(msgspec.Struct, array_like=True, frozen=True):
    """One group's write: applied in the order snapshot, entries, hard state.

    ``snapshot`` with ``compacted`` is the node's own compaction (entries after it
    stay); without it, one installed from the leader (it replaces the whole log).
    ``entries`` replace the log from ``entries[0].index`` on. ``dropped``: the group
    is gone from this broker (its stream deleted)."""

    group: str
    hard: WalHardState | None = None
    snapshot: WalSnapshot | None = None
    compacted: bool = False
    entries: list[WalEntry] = msgspec.field(default_factory=list)
    dropped: bool = False
    # What the group is (the driver's: a stream's configuration), kept with its log.
    meta: bytes | None = None


@dataclass
class GroupLog:
    """What the file holds for one group, as of its last record."""

    hard: WalHardState = field(default_factory=WalHardState)
    snapshot: WalSnapshot = field(default_factory=WalSnapshot)
    entries: list[WalEntry] = field(default_factory=list)
    meta: bytes = b""

    def apply(self, record: WalRecord) -> None:
        if record.meta is not None:
            self.meta = record.meta
        snapshot = record.snapshot
        if snapshot is not None:
            if record.compacted:
                self.entries = [e for e in self.entries if e.index > snapshot.index]
            else:
                self.entries = []
            self.snapshot = snapshot
        if record.entries:
            first = record.entries[0].index
            expected = self.snapshot.index + 1 + len(self.entries)
            if first > expected:
                raise ValueError(f"entries from {first} after a log that ends at {expected - 1}")
            keep = first - self.snapshot.index - 1
            del self.entries[max(keep, 0) :]
            self.entries.extend(e for e in record.entries if e.index > self.snapshot.index)
        if record.hard is not None:
            self.hard = record.hard

    def as_record(self, group: str) -> WalRecord:
        return WalRecord(
            group=group,
            hard=self.hard,
            snapshot=self.snapshot,
            entries=list(self.entries),
            meta=self.meta,
        )


@dataclass(frozen=True)
class Recovery:
    """What ``open`` found: the bytes dropped at the end and whether the file was
    damaged (then ``damage`` says where and how)."""

    torn_bytes: int = 0
    damage: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(WalRecord).decode


def frame(record: WalRecord) -> bytes:
    """``record`` as it goes into the file: length, checksum, payload."""
    payload = _encode(record)
    if len(payload) > MAX_RECORD:
        raise RaftLogFailed(
            f"a Raft log record of {len(payload)} bytes is past the limit of {MAX_RECORD}"
        )
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class RaftWal:
    """The write-ahead file and the state of every group it holds.

    Not thread-safe: the driver calls ``append``/``sync``/``rewrite`` from one worker
    thread at a time, and nothing else touches the file meanwhile."""

    def __init__(
        self,
        path: str,
        groups: dict[str, GroupLog],
        fd: int,
        size: int,
        state_file: KeptStates,
        kept: dict[str, KeptState],
        incarnation: int,
        mark: SyncedMark,
    ) -> None:
        self.path = path
        self._mark = mark
        self.groups = groups
        self._fd = fd
        self.size = size
        self.failed: str = ""
        self._measured_at = 0  # the file's size when its live size was last measured
        self._state_file = state_file
        # What the state file holds: every group of the log, and any whose records the
        # log lost to damage (``lost``).
        self.kept = kept
        self._kept_changed = False
        self.incarnation = incarnation

    @classmethod
    def open(
        cls, path: str, new_incarnation: Callable[[], int] = random_incarnation
    ) -> tuple[RaftWal, Recovery]:
        """Read ``path`` back (created if missing), dropping a torn tail; the log opened
        for appending after the intact prefix. A state file made now (none was there:
        a new or wiped data dir) gets the incarnation ``new_incarnation()``."""
        groups: dict[str, GroupLog] = {}
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        recovery = Recovery()
        if not data:
            good = 0
        elif not data.startswith(MAGIC):
            if MAGIC.startswith(data):  # the magic itself was cut short
                good = 0
            else:
                raise RaftLogFailed(
                    f"{path} is not a meshbus Raft log (its first bytes are {data[:8]!r}); "
                    "move it away if it is not one, and restart the broker"
                )
        else:
            good, recovery = _read_records(data, groups)
        stem = os.path.splitext(path)[0]
        mark = SyncedMark(stem + ".synced")
        if data and not recovery.damage:
            recovery = _cut_short(recovery, good, os.stat(path).st_ino, mark.read())
        state_file = KeptStates(stem + ".state")
        incarnation, kept = _kept_states(state_file, groups, recovery, new_incarnation)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if good == 0:
                os.ftruncate(fd, 0)
                os.write(fd, MAGIC)
                good = len(MAGIC)
            elif good < len(data):
                os.ftruncate(fd, good)
            os.fsync(fd)
            os.lseek(fd, good, os.SEEK_SET)
        except OSError:
            os.close(fd)
            raise
        fsync_dir(path)
        mark.follow(fd)
        mark.write(good)
        return cls(path, groups, fd, good, state_file, kept, incarnation, mark), recovery

    @property
    def lost(self) -> list[str]:
        """The groups the state file names whose every record the log lost to damage."""
        return [group for group in self.kept if group not in self.groups]

    def append(self, records: list[WalRecord]) -> None:
        """Write ``records`` after the others (not durable until ``sync``)."""
        self._check()
        data = b"".join(map(frame, records))
        try:
            write_all(self._fd, data)
        except OSError as exc:
            self._fail("writing", exc)
        self.size += len(data)
        kept = self.kept
        for record in records:
            group = record.group
            if record.dropped:
                self.groups.pop(group, None)
                self._kept_changed |= kept.pop(group, None) is not None
                continue
            self.groups.setdefault(group, GroupLog()).apply(record)
            if record.hard is not None:
                state = KeptState.of(record.hard)
                if kept.get(group) != state:
                    kept[group] = state
                    self._kept_changed = True

    def sync(self) -> None:
        """Make every record appended so far durable; then, if a term, vote, epoch or
        repairing flag changed, the state file."""
        self._check()
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._fail("syncing", exc)
        self._mark.write(self.size)
        if self._kept_changed:
            try:
                self._state_file.write(StateFile(self.incarnation, self.kept))
            except OSError as exc:
                self._fail("writing the state file of", exc)
            self._kept_changed = False

    def live_size(self) -> int:
        return len(MAGIC) + sum(
            len(frame(state.as_record(group))) for group, state in self.groups.items()
        )

    def should_rewrite(self, slack: int = REWRITE_SLACK) -> bool:
        """Whether the file holds twice what is live (and ``slack`` bytes more). The live
        size is measured again only once the file doubled since the last time: it costs
        an encoding of every group's state."""
        if self.size <= slack or self.size < 2 * self._measured_at:
            return False
        self._measured_at = self.size
        return self.size > 2 * self.live_size()

    def rewrite(self) -> None:
        """Replace the file by one record per group: its live state."""
        self._check()
        new_path = self.path + ".new"
        try:
            fd = os.open(new_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                data = MAGIC + b"".join(
                    frame(state.as_record(group)) for group, state in self.groups.items()
                )
                write_all(fd, data)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            os.replace(new_path, self.path)
            fsync_dir(self.path)
        except OSError as exc:
            # The old file is whole and still open: keep appending to it.
            try:
                os.unlink(new_path)
            except OSError:
                pass
            raise RaftLogFailed(f"rewriting the Raft log {self.path} failed: {exc}") from exc
        os.close(self._fd)
        self._fd = fd = os.open(self.path, os.O_RDWR)
        os.lseek(fd, 0, os.SEEK_END)
        self.size = self._measured_at = len(data)
        self._mark.follow(fd)
        self._mark.write(self.size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._mark.close()

    def _check(self) -> None:
        if self.failed:
            raise RaftLogFailed(self.failed)

    def _fail(self, doing: str, exc: OSError) -> None:
        self.failed = (
            f"{doing} the Raft log {self.path} failed ({exc.strerror or exc}): this broker "
            "acknowledges no append to a replicated stream until it restarts; free space "
            "or fix the disk, then restart it (it reads back what is intact)"
        )
        raise RaftLogFailed(self.failed) from exc


def _read_records(data: bytes, groups: dict[str, GroupLog]) -> tuple[int, Recovery]:
    """Apply the intact records of ``data`` to ``groups``; the end of the intact prefix."""
    pos = len(MAGIC)
    end = len(data)
    header = _HEADER.size
    while pos < end:
        if end - pos < header:
            return pos, Recovery(torn_bytes=end - pos)
        length, crc = _HEADER.unpack_from(data, pos)
        stop = pos + header + length
        if length > MAX_RECORD or stop > end:
            if stop >= end and length <= MAX_RECORD:
                return pos, Recovery(torn_bytes=end - pos)
            return pos, _damage(pos, end, f"a record length of {length} bytes")
        payload = data[pos + header : stop]
        if zlib.crc32(payload) != crc:
            if stop == end and _looks_torn(data, pos):
                return pos, Recovery(torn_bytes=end - pos)
            return pos, _damage(pos, end, "a record failing its checksum")
        if length == 0 and not any(data[pos:]):
            return pos, Recovery(torn_bytes=end - pos)  # the file grew by zeros only
        try:
            record = _decode(payload)
            state = groups.get(record.group)
            if record.dropped:
                groups.pop(record.group, None)
            else:
                if state is None:
                    state = groups[record.group] = GroupLog()
                state.apply(record)
        except (msgspec.DecodeError, ValueError) as exc:
            return pos, _damage(pos, end, f"a record that does not decode ({exc})")
        pos = stop
    return pos, Recovery()


def _cut_short(recovery: Recovery, good: int, inode: int, mark: tuple[int, int] | None) -> Recovery:
    """Damage if the intact prefix ends before the size the log was synced to: the file
    lost records after they were synced (``SyncedMark``)."""
    if mark is None or mark[0] != inode or good >= mark[1]:
        return recovery
    return Recovery(
        torn_bytes=recovery.torn_bytes,
        damage=(
            f"the log's intact records end at byte {good}, and it was synced to byte "
            f"{mark[1]}: it lost records after they were synced (cut short)"
        ),
    )


def _kept_states(
    state_file: KeptStates,
    groups: dict[str, GroupLog],
    recovery: Recovery,
    new_incarnation: Callable[[], int],
) -> tuple[int, dict[str, KeptState]]:
    """The broker's incarnation (a new one if the file has none) and the groups' term,
    vote, epoch and repairing flag, from the state file (the log's own for a group it
    does not name: a crash came between the two writes of the group's first record),
    set into ``groups``; the file written again if that changed anything -- before the
    log is cut back, and before any message can carry the incarnation."""
    found = state_file.read() or StateFile()
    incarnation = found.incarnation or new_incarnation()
    kept = dict(found.groups)
    for group, state in groups.items():
        kept.setdefault(group, KeptState.of(state.hard))
    if recovery.damage:
        # docs/raft.md, "Corruption": it may have lost what it acknowledged.
        kept = {
            group: msgspec.structs.replace(state, epoch=state.epoch + 1, repairing=True)
            for group, state in kept.items()
        }
    for group, state in groups.items():
        state.hard = kept[group].with_commit(state.hard.commit)
    written = StateFile(incarnation, kept)
    if written != found:
        state_file.write(written)
    return incarnation, kept


def _looks_torn(data: bytes, pos: int) -> bool:
    """Whether the last record, from ``pos``, has a sector of the file (or the part of
    one it covers) all zeros: what a crash leaves of a write that never finished. A
    record failing its checksum without one was whole: a flipped bit is damage."""
    start = pos
    while start < len(data):
        stop = min((start // SECTOR + 1) * SECTOR, len(data))
        if not any(data[start:stop]):
            return True
        start = stop
    return False


def _damage(pos: int, end: int, what: str) -> Recovery:
    return Recovery(
        torn_bytes=end - pos,
        damage=f"{what} at byte {pos}, with {end - pos} bytes from there on dropped",
    )
