"""The durable store's upkeep, off the appends' path: a deleted stream's blocks removed a
slice per turn of the event loop, and the WAL checkpointed in a worker thread ahead of
the checkpoint SQLite runs in the writer's commit."""

from __future__ import annotations

import asyncio
import logging

from meshbus.storage.errors import StoreError
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.util import FailureLog

log = logging.getLogger("meshbus.broker")

# The WAL is checkpointed in a worker thread once it holds this much (SQLite's own
# checkpoint, in the writer's commit, comes at 1,000 pages: ~4 MiB), looked at this often.
CHECKPOINT_AHEAD = 1 << 20
CHECKPOINT_EVERY = 0.05
CHECKPOINT_RETRY = 1.0  # after a failed one (a full disk): no worker busy on it all along


class StoreUpkeep:
    def __init__(self, store: SqliteStreamStore) -> None:
        self._store = store
        self._purging: asyncio.Handle | None = None
        self._checkpoint_timer: asyncio.TimerHandle | None = None
        self._checkpointing: asyncio.Future[None] | None = None
        self._failures = FailureLog(log, "checkpointing the stream store failed")

    def start(self) -> None:
        self.purge_later()  # a delete that a restart cut short
        self._checkpoint_soon()

    def close(self) -> None:
        if self._purging is not None:
            self._purging.cancel()  # the rest goes after the next start
        if self._checkpoint_timer is not None:
            self._checkpoint_timer.cancel()

    def purge_later(self) -> None:
        """Remove deleted streams' blocks a slice per turn of the event loop (a slice
        takes about 10 ms): deleting a big stream must not stall the broker."""
        if self._purging is None and self._store.purging:
            self._purging = asyncio.get_running_loop().call_soon(self._purge_slice)

    def _purge_slice(self) -> None:
        self._purging = None
        try:
            self._store.purge()
        except StoreError as exc:
            log.error("purging a deleted stream failed", extra={"error": str(exc)})
            return
        self.purge_later()

    def _checkpoint_soon(self) -> None:
        """Every ``CHECKPOINT_EVERY`` s: once the WAL holds ``CHECKPOINT_AHEAD`` bytes, a
        checkpoint in a worker thread (SqliteStreamStore.checkpoint), so the one SQLite
        runs in the writer's commit, on the event loop, finds little to copy: it was the
        appends' p99 (20 ms and more, against 10 ms without it; BENCHMARKS.md)."""
        loop = asyncio.get_running_loop()
        every = CHECKPOINT_RETRY if self._failures.failing else CHECKPOINT_EVERY
        self._checkpoint_timer = loop.call_later(every, self._checkpoint_due)

    def _checkpoint_due(self) -> None:
        store = self._store
        if self._checkpointing is None and store.wal_bytes() >= CHECKPOINT_AHEAD:
            running = asyncio.get_running_loop().run_in_executor(None, store.checkpoint)
            running.add_done_callback(self._checkpointed)
            self._checkpointing = running
        self._checkpoint_soon()

    def _checkpointed(self, done: asyncio.Future[None]) -> None:
        self._checkpointing = None
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            self._failures.failed(str(error))
        else:
            self._failures.succeeded()
