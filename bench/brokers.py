"""Broker processes of a benchmark: the one way the benches start meshbus brokers in a mesh.

Every broker is a ``meshbus broker`` child process started with
``meshbus.broker.process.spawn_broker`` on a free loopback port; the first one of
a mesh founds it, the others join through it (``--seed``). A joining broker prints
its ready line once it has linked to its peers and copied their tables.

The processes are asyncio subprocesses because the mesh-operation benchmarks keep
their connectors running on the loop while brokers start, get killed and join. The
thread-based traffic benchmarks use the same code through ``cluster.meshbus_mesh``,
which runs it on a loop of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshbus.broker.process import spawn_broker


@dataclass
class MeshbusProcess:
    """A ``meshbus broker`` child process this bench started, with where it listens."""

    process: asyncio.subprocess.Process
    name: str
    address: str
    start_ms: float  # from starting the process to its ready line

    def rss_mib(self) -> float | None:
        """Resident memory (Linux /proc), None where that is not available."""
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None


class MeshbusProcesses:
    """The broker processes of one command; ``close`` stops every one still running.

    A start that fails or is cancelled leaves nothing behind (``spawn_broker`` kills
    and reaps its child); every broker that did start is listed in ``started``."""

    def __init__(self) -> None:
        self.started: list[MeshbusProcess] = []

    async def start(self, *args: str) -> MeshbusProcess:
        """A broker with ``args``, timed from process start to its ready line."""
        began = time.perf_counter()
        process, name, address, _ = await spawn_broker(*args)
        broker = MeshbusProcess(process, name, address, (time.perf_counter() - began) * 1000.0)
        self.started.append(broker)
        return broker

    async def mesh(
        self, count: int, *args: str, each: Callable[[int], Sequence[str]] | None = None
    ) -> list[MeshbusProcess]:
        """``count`` brokers with ``args`` (and broker i with ``each(i)`` too: its name and
        key in a mesh that trusts only its brokers) in one mesh: the first founds it, the
        others join through it at the same time. Each has joined (linked to all, tables
        copied) on return."""

        def own(index: int) -> Sequence[str]:
            return each(index) if each is not None else ()

        first = await self.start(*args, *own(0))
        rest = await asyncio.gather(
            *(self.start("--seed", first.address, *args, *own(i)) for i in range(1, count)),
            return_exceptions=True,
        )
        for item in rest:
            if isinstance(item, BaseException):
                raise item
        return [first, *(b for b in rest if isinstance(b, MeshbusProcess))]

    async def close(self) -> None:
        """Stop every broker still running, the newest first and one at a time, so each
        goodbye goes to peers that are still running: SIGTERM (with no connectors left
        it stops at once), SIGKILL if it has not exited after 10 s. Cancelled (Ctrl-C),
        it kills the rest at once."""
        try:
            while self.started:
                process = self.started[-1].process
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
                self.started.pop()
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL every broker that has not been reaped: the last resort, without a loop.
        (A pid is not reused before its process is reaped, so this never hits a stranger.)"""
        for broker in self.started:
            if broker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    broker.process.kill()
        self.started.clear()
