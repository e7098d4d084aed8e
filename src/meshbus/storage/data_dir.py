"""A broker's data directory is its own: one process at a time holds its lock."""

from __future__ import annotations

import fcntl
import os
from typing import IO

from meshbus.errors import MeshbusError


class DataDirLocked(MeshbusError):
    """Another broker uses this --data-dir: two stores on one file would both write it."""


def lock_data_dir(data_dir: str) -> IO[bytes]:
    """Hold ``DATA_DIR/LOCK`` while the returned file is open: a broker for its lifetime
    (the OS drops it when the process dies, also on kill -9), ``meshbus stream salvage``
    while it reads the store; DataDirLocked if another process holds it."""
    lock = open(os.path.join(data_dir, "LOCK"), "ab")  # noqa: SIM115 -- held until close()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise DataDirLocked(
            f"data directory {data_dir} is in use by another broker; "
            "give each broker its own --data-dir"
        ) from None
    return lock
