"""Start and stop the servers a benchmark measures: a meshbus broker, a nats-server."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from meshbus.broker.process import broker_command, child_env, parse_ready_line
from meshbus.util import parse_hostport


class BenchSetupError(Exception):
    """The benchmark could not start what it measures; the message says what to do."""


@dataclass
class Server:
    kind: str
    process: subprocess.Popen[bytes]
    host: str
    port: int


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def meshbus_broker(*extra: str) -> Iterator[Server]:
    """A `meshbus broker` subprocess on a free loopback port, stopped on exit."""
    process = subprocess.Popen(broker_command(*extra), stdout=subprocess.PIPE, env=child_env())
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        ready = parse_ready_line(line)
        if ready is None:
            raise BenchSetupError(f"meshbus broker did not start: {line!r}")
        host, port = parse_hostport(ready[1])
        yield Server("meshbus", process, host, port)
    finally:
        _stop(process)


def find_nats_server() -> str:
    path = shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if os.path.exists("/usr/sbin/nats-server") else None
    )
    if path is None:
        raise BenchSetupError(
            "nats-server is not installed; on Debian: apt-get install nats-server "
            "(or run without --vs-nats)"
        )
    return path


@contextlib.contextmanager
def nats_server() -> Iterator[Server]:
    """A `nats-server` subprocess on a random loopback port (-p -1), stopped on exit."""
    process = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", "-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 10
        seen = []
        while time.monotonic() < deadline:
            line = process.stderr.readline().decode()
            if not line:
                break
            seen.append(line)
            match = re.search(r"Listening for client connections on (\S+):(\d+)", line)
            if match:
                # Keep draining its log so a chatty server never blocks on a full pipe.
                _drain_in_background(process)
                yield Server("nats", process, match.group(1), int(match.group(2)))
                return
        raise BenchSetupError("nats-server did not start: " + "".join(seen[-5:]))
    finally:
        _stop(process)


def _drain_in_background(process: subprocess.Popen[bytes]) -> None:
    import threading

    def drain() -> None:
        assert process.stderr is not None
        for _ in process.stderr:
            pass

    threading.Thread(target=drain, daemon=True).start()
