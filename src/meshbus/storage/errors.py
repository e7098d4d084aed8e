"""The errors of the stream stores (meshbus.storage.store): each message says what to do
about it."""

from __future__ import annotations

from meshbus.errors import MeshbusError


class StoreError(Exception):
    """Base of the store's errors; the message says what to do about it."""


class StoreDamaged(StoreError, MeshbusError):
    """A stream store failed its checks at open: the message names the file, what is
    wrong and how to recover. The broker refuses to start on it."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem  # what is wrong, without the file or the way out


class StoreFull(StoreError):
    """A limit of the broker's (streams, bytes per stream, bytes per data dir) would be
    passed; the message names the limit and the ``meshbus broker`` flag that sets it."""


class StreamNotFound(StoreError):
    def __init__(self, name: str) -> None:
        super().__init__(
            f"no stream named {name!r} on this broker; "
            f"create it with `meshbus stream add {name} --capture ...`"
        )
        self.name = name


class StreamExists(StoreError):
    def __init__(self, name: str) -> None:
        super().__init__(
            f"stream {name!r} already exists with a different configuration; "
            "delete it first (its messages go with it) or choose another name"
        )
        self.name = name


class ConsumerNotFound(StoreError):
    def __init__(self, stream: str, name: str) -> None:
        super().__init__(f"no consumer named {name!r} on stream {stream!r}; add it first")
        self.stream = stream
        self.name = name


class ConsumerExists(StoreError):
    def __init__(self, stream: str, name: str) -> None:
        super().__init__(
            f"consumer {name!r} on stream {stream!r} already exists with a different "
            "configuration; delete it first (its position goes with it) or choose another name"
        )
        self.stream = stream
        self.name = name


class RaftLogFailed(StoreError):
    """A write or fsync of the Raft log failed: the broker stops acknowledging appends
    to replicated streams (what it would acknowledge may not be on its disk)."""
