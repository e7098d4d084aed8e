"""Small helpers shared by the library and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class BackgroundTasks:
    """The background tasks of one owner (a connector, the mesh): each is named, kept
    until it ends, and cancelled with the others when the owner stops, so none
    outlives it or is garbage-collected while it runs."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def names(self) -> list[str]:
        return [task.get_name() for task in self._tasks]

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel(self) -> None:
        """Cancel every task (but the one calling) and wait until they have ended."""
        tasks = self._others()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def cancel_now(self) -> None:
        """Cancel every task (but the one calling) without waiting."""
        for task in self._others():
            task.cancel()

    def _others(self) -> list[asyncio.Task[Any]]:
        # A task that ends its owner must not cancel itself halfway through the ending.
        me = asyncio.current_task()
        return [task for task in self._tasks if task is not me]


class Turns(Generic[K]):
    """One at a time per key, in the order they came (``asyncio.Lock`` is first come,
    first served). A key's lock is kept only while someone holds it or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[K, tuple[asyncio.Lock, list[int]]] = {}  # key -> (lock, [users])

    @contextlib.asynccontextmanager
    async def turn(self, key: K) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]

    def __contains__(self, key: object) -> bool:
        """True while someone holds ``key``'s turn or waits for it."""
        return key in self._locks

    def __len__(self) -> int:
        return len(self._locks)


class FailureLog:
    """A failure that repeats -- a full disk failing every commit -- logged as an error
    when it starts, then at most once every ``every`` seconds with how often it happened
    meanwhile, and as a warning once it stops: the operator reads what is wrong, and the
    log is not flooded (a commit fails up to a hundred times a second)."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._message = message
        self._every = every
        self._clock = clock
        self.failing = False
        self._logged_at = 0.0
        self._unlogged = 0

    def failed(self, error: str, **extra: object) -> None:
        now = self._clock()
        if self.failing and now - self._logged_at < self._every:
            self._unlogged += 1
            return
        if self.failing:
            extra["times_since_last_logged"] = self._unlogged + 1
        self._logger.error(self._message, extra={"error": error, **extra})
        self.failing = True
        self._logged_at = now
        self._unlogged = 0

    def succeeded(self) -> None:
        if self.failing:
            self.failing = False
            self._logger.warning(
                f"{self._message}: works again",
                extra={"times_since_last_logged": self._unlogged},
            )


def parse_hostport(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6); ValueError names what is wrong.
    With ``default_port``, a bare ``HOST`` (or ``[v6]``) means that port."""
    host, sep, port_text = text.rpartition(":")
    if not sep or text.endswith("]"):  # "host" or "[v6]": no port
        if default_port is None:
            raise ValueError(f"{text!r} is not HOST:PORT")
        host, port_text = text, str(default_port)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{text!r} has no host; expected HOST:PORT, e.g. 127.0.0.1:7400")
    try:
        port = int(port_text, 10)
    except ValueError:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is out of range 0..65535")
    return host, port


def hostport_text(host: str, port: int) -> str:
    """``HOST:PORT`` again, with an IPv6 host in brackets: what ``parse_hostport`` reads."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
