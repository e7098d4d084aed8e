"""The files beside the Raft log (meshbus.storage.raftlog) that damage to the log must
not take with it -- why each is kept apart is in raftlog.py's docstring:

- the state file, ``raft.state`` (``KeptStates``): every group's term, vote, epoch and
  repairing flag (``KeptState``), and the broker's incarnation; replaced whole, its
  payload twice;
- the synced mark, ``raft.synced`` (``SyncedMark``): the log's size at its last fsync,
  and the inode of the file it was measured on.
"""

from __future__ import annotations

import os
import secrets
import struct
import zlib

import msgspec

from meshbus.storage.errors import RaftLogFailed

STATE_MAGIC = b"MBSTATE2"
# The state file before incarnations: its payload is the groups alone (read as
# incarnation 0, "none yet": one is drawn and the file written again at open).
STATE_MAGIC_GROUPS_ONLY = b"MBSTATE1"
_HEADER = struct.Struct("<II")  # a copy's length and checksum, as the log's records have
_encode = msgspec.msgpack.Encoder().encode


class WalHardState(msgspec.Struct, array_like=True, frozen=True):
    term: int = 0
    vote: int = 0  # 0: none
    commit: int = 0
    epoch: int = 0
    repairing: bool = False


class KeptState(msgspec.Struct, array_like=True, frozen=True):
    """A group's hard state but its commit index: what damage to the log must not lose."""

    term: int = 0
    vote: int = 0  # 0: none
    epoch: int = 0
    repairing: bool = False

    @classmethod
    def of(cls, hard: WalHardState) -> KeptState:
        return cls(hard.term, hard.vote, hard.epoch, hard.repairing)

    def with_commit(self, commit: int) -> WalHardState:
        return WalHardState(self.term, self.vote, commit, self.epoch, self.repairing)


class StateFile(msgspec.Struct, array_like=True, frozen=True):
    """The state file's payload: the broker's incarnation and every group's state."""

    incarnation: int = 0
    groups: dict[str, KeptState] = msgspec.field(default_factory=dict)


_decode_state = msgspec.msgpack.Decoder(StateFile).decode
_decode_groups_only = msgspec.msgpack.Decoder(dict[str, KeptState]).decode


def random_incarnation() -> int:
    """A new incarnation: a random positive int of 63 bits (it goes into msgpack)."""
    return secrets.randbits(63) or 1


class KeptStates:
    """The state file: the incarnation and every group's ``KeptState``, replaced whole
    by ``write``.

    The file: ``STATE_MAGIC``, then the payload (msgpack) twice, each copy as
    ``<u32 length><u32 crc32><payload>``, the second from the next 4 KiB boundary (so
    no one sector holds both). The write goes to a new file, fsynced, renamed over the
    old one: a crash leaves the old file or the new one, whole."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> StateFile | None:
        """What the file holds (None if there is no file); RaftLogFailed if neither
        copy is intact."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        if data.startswith((STATE_MAGIC, STATE_MAGIC_GROUPS_ONLY)):
            # The second copy is at the first 4 KiB boundary past the first, whose
            # length may be the damaged part: each boundary is tried.
            for start in (len(STATE_MAGIC), *range(4096, len(data), 4096)):
                state = _read_copy(data, start, data.startswith(STATE_MAGIC))
                if state is not None:
                    return state
        raise RaftLogFailed(
            f"{self.path}, the terms and votes of this broker's replicated streams, is "
            "damaged in both its copies: the broker may have voted in a term it no longer "
            "knows, so it must not take part in those groups again as it is. Move the "
            "data directory away and start the broker afresh (its replicas are then lost "
            "here), or restore the file from a backup"
        )

    def write(self, state: StateFile) -> None:
        payload = _encode(state)
        copy = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        first = STATE_MAGIC + copy
        data = first.ljust(-(-len(first) // 4096) * 4096, b"\0") + copy
        new_path = self.path + ".new"
        fd = os.open(new_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(new_path, self.path)
        fsync_dir(self.path)


def _read_copy(data: bytes, start: int, current: bool) -> StateFile | None:
    if len(data) - start < _HEADER.size:
        return None
    length, crc = _HEADER.unpack_from(data, start)
    payload = data[start + _HEADER.size : start + _HEADER.size + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    try:
        return _decode_state(payload) if current else StateFile(0, _decode_groups_only(payload))
    except msgspec.DecodeError:
        return None


class SyncedMark:
    """The log's size at its last fsync, and the inode of the file it was measured on:
    ``<u64 inode><u64 size><u32 crc32 of the 16 bytes before>``, written in place."""

    _FORMAT = struct.Struct("<QQI")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._inode = 0  # of the log's file (``follow``); 0, a mark that checks nothing

    def read(self) -> tuple[int, int] | None:
        """(inode, size), or None: no mark, or a damaged one."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(self._FORMAT.size)
        except FileNotFoundError:
            return None
        if len(data) < self._FORMAT.size:
            return None
        inode, size, crc = self._FORMAT.unpack(data)
        if zlib.crc32(data[:16]) != crc:
            return None
        return inode, size

    def follow(self, log_fd: int) -> None:
        """The log is the file open as ``log_fd`` from now on (opened, or rewritten):
        its inode is measured once, not at every sync."""
        self._inode = os.fstat(log_fd).st_ino

    def write(self, size: int) -> None:
        """The log was synced at ``size`` bytes. A failed write leaves the mark it was,
        or a damaged one: either checks less, never wrongly."""
        body = struct.pack("<QQ", self._inode, size)
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(self._fd, body + struct.pack("<I", zlib.crc32(body)), 0)
        except OSError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
