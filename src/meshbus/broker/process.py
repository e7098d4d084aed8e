"""Running `meshbus broker` as a child process: the ready line, written and read in one place.

The broker prints exactly one line when it accepts links, ``meshbus broker NAME
listening on HOST:PORT`` (with ``--nats-listen``, then ``; NATS clients on HOST:PORT``);
scripts, the demo, the benchmarks and the tests start a broker on port 0 and read the
real addresses from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import NamedTuple

_READY = re.compile(r"meshbus broker (\S+) listening on (\S+:\d+)(?:; NATS clients on (\S+:\d+))?$")


class BrokerStartError(RuntimeError):
    """A broker child process did not come up; the message has what it printed."""


def ready_line(name: str, address: str, nats_address: str = "") -> str:
    line = f"meshbus broker {name} listening on {address}"
    return f"{line}; NATS clients on {nats_address}" if nats_address else line


def parse_ready_line(line: str) -> tuple[str, str] | None:
    """(NAME, HOST:PORT) from a ready line, or None if ``line`` is not one."""
    match = _READY.match(line.strip())
    return (match[1], match[2]) if match else None


def nats_address_of(line: str) -> str:
    """The NATS listener's HOST:PORT a ready line names; "" if it names none."""
    match = _READY.match(line.strip())
    return match[3] or "" if match else ""


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM (a broker drains, then exits), then SIGKILL if it has not exited after
    ``timeout`` seconds; reaped on return."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def broker_argv(*args: str) -> list[str]:
    """The command line of ``meshbus broker ARGS`` with this interpreter."""
    return [sys.executable, "-m", "meshbus", "broker", *args]


def broker_command(*args: str, listen: str = "127.0.0.1:0") -> list[str]:
    """The command line of a broker on ``listen`` (a free loopback port), plus ``args``."""
    return broker_argv("--listen", listen, *args)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


# How a child is started: asyncio.create_subprocess_exec's signature (program, *args,
# stdout=..., env=...); a test suite may start its brokers another way.
Launch = Callable[..., Awaitable[asyncio.subprocess.Process]]


class StartedBroker(NamedTuple):
    process: asyncio.subprocess.Process
    name: str
    address: str
    nats_address: str  # "" without --nats-listen


async def spawn_broker(
    *args: str,
    listen: str = "127.0.0.1:0",
    timeout: float = 20.0,
    launch: Launch = asyncio.create_subprocess_exec,
) -> StartedBroker:
    """Start a broker on ``listen`` and wait for its ready line: the process, its name and
    the addresses it listens on.

    If it does not come up, or the wait ends any other way (cancelled, Ctrl-C), the
    child is killed and reaped before the exception goes on: no broker outlives a
    failed call."""
    process = await launch(
        *broker_command(*args, listen=listen), stdout=asyncio.subprocess.PIPE, env=child_env()
    )
    try:
        assert process.stdout is not None
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), timeout)).decode()
        except TimeoutError:
            line = ""
        ready = parse_ready_line(line)
        if ready is None:
            raise BrokerStartError(f"the broker did not print its ready line (got {line!r})")
    except BaseException:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        await process.wait()
        raise
    return StartedBroker(process, ready[0], ready[1], nats_address_of(line))
