"""The checks run on a stream store's files before SQLite opens them, and the message
of ``StoreDamaged``.

Separate from the store because they read the raw files, not SQLite: once SQLite has
opened a damaged WAL it cuts it short for good, so the check must come first. Salvage
runs them too, to report what is wrong with the store it copies.
"""

from __future__ import annotations

import os
import struct

from meshbus.storage.errors import StoreDamaged


def store_damaged(path: str, problem: str) -> StoreDamaged:
    """The error that stops the store ``path`` from opening because of ``problem``."""
    return StoreDamaged(damaged(path, problem), problem)


def damaged(path: str, problem: str) -> str:
    """The message of ``StoreDamaged``: the file, what is wrong, how to recover."""
    data_dir = os.path.dirname(os.path.abspath(path))
    return (
        f"the stream store {path} is damaged: {problem}. The broker does not start on it "
        f"and has changed nothing. To recover, stop every broker using {data_dir}, then run "
        f"`meshbus stream salvage --data-dir {data_dir} --out NEW_DIR` (it copies every "
        "intact block to a new store and reports what is lost) and start the broker with "
        "--data-dir NEW_DIR; or restore the directory from a backup"
    )


_MAGIC = b"SQLite format 3\x00"
_WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums of little-, big-endian words


def check_files(path: str) -> str:
    """What is wrong with the database file and its WAL, found without SQLite ("": nothing
    found). SQLite opening a truncated file fails late and vaguely, and one opening a
    damaged WAL drops it and every commit after it without a word."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return ""
    wal = check_wal(path + "-wal")
    if wal:
        return wal
    if size == 0:
        return ""
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(_MAGIC):
        return "its first bytes are not an SQLite header (overwritten?)"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    valid = header[24:28] == header[92:96]  # else the page count is from an older SQLite
    has_wal = os.path.exists(path + "-wal") and os.path.getsize(path + "-wal") > 32
    if valid and not has_wal and size < pages * page_size:
        return (
            f"it is {size} bytes, but its header says {pages} pages of {page_size} bytes "
            f"({pages * page_size} bytes): it was cut short"
        )
    return ""


def check_wal(wal: str) -> str:
    """Where SQLite would stop reading the WAL ``wal`` before its last commit ("" if it
    would not): what a crash leaves (a torn last transaction) is not damage; a commit
    after a frame that fails its checksum is."""
    try:
        with open(wal, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ""
    if len(data) <= 32:
        return ""
    magic, _, page_size, _, salt1, salt2, c1, c2 = struct.unpack_from(">8I", data)
    big = magic == _WAL_MAGIC[1]
    if magic not in _WAL_MAGIC or _wal_sum(data[:24], 0, 0, big) != (c1, c2):
        return (
            f"its write-ahead log {wal} has a damaged header, so SQLite would drop all of it "
            f"({len(data)} bytes: every commit since the last checkpoint)"
        )
    frame = 24 + page_size
    frames = (len(data) - 32) // frame
    sums = (c1, c2)
    for i in range(frames):
        at = 32 + i * frame
        _, _, s1, s2, f1, f2 = struct.unpack_from(">6I", data, at)
        if (s1, s2) != (salt1, salt2):
            return ""  # the end of this generation of the log: older frames follow
        sums = _wal_sum(data[at : at + 8], *sums, big)
        sums = _wal_sum(data[at + 24 : at + frame], *sums, big)
        if sums != (f1, f2):
            heads = [struct.unpack_from(">4I", data, 32 + j * frame) for j in range(i, frames)]
            lost = [h for h in heads if h[1] and h[2:] == (salt1, salt2)]  # commit frames
            if not lost:
                return ""  # only an uncommitted tail: what a crash in a commit leaves
            return (
                f"its write-ahead log {wal} is damaged at frame {i + 1} of {frames} (its "
                f"checksum does not match): SQLite would drop that frame and the "
                f"{frames - i - 1} after it, {len(lost)} committed transactions since the "
                f"last checkpoint ({(frames - i) * page_size} bytes of pages); moving the WAL "
                "aside (keep a copy) starts the store as it was at that checkpoint"
            )
    return ""


def _wal_sum(data: bytes, s0: int, s1: int, big: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (8-byte aligned), carried on from (s0, s1)."""
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    for a, b in zip(words[::2], words[1::2], strict=True):
        s0 = (s0 + a + s1) & mask
        s1 = (s1 + b + s0) & mask
    return s0, s1
