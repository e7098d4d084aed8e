"""Running the benchmark commands in the bench tests: as ``python -m bench`` from the
root of the checkout in a subprocess, the way a user does, or in process with click's
CliRunner. Either way the command must exit 0 and leave no process behind; the result is
its last line.

A subprocess runs in a session of its own: every process it starts is in that session
(brokers and nats-servers do not start their own), so what is left of it can be found
after it has exited (and killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import click
from click.testing import CliRunner

BENCH = [sys.executable, "-m", "bench"]
# The rig is not installed: ``python -m bench`` finds it in the checkout it runs in.
CHECKOUT = Path(__file__).resolve().parents[2]
BENCH_TIMEOUT = 120.0


def _live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process (Linux /proc; empty elsewhere)."""
    found: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # pid (comm) state ppid pgrp session ...: comm may hold spaces, so split after it.
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry)] = (int(fields[1]), int(fields[3]))
    return found


def child_pids() -> set[int]:
    """Live child processes of this test process."""
    me = os.getpid()
    return {pid for pid, (ppid, _) in _live_processes().items() if ppid == me}


def _session_pids(session: int) -> set[int]:
    return {pid for pid, (_, sid) in _live_processes().items() if sid == session}


# How long the processes of a bench that ended may take to end too: multiprocessing's
# resource tracker (which a spawned worker starts) exits once it reads the end of its
# pipe, just after the bench; a process still there past this was left running.
_EXIT_GRACE = 3.0


def _left_running(session: int) -> set[int]:
    deadline = time.monotonic() + _EXIT_GRACE
    while (left := _session_pids(session)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_bench(
    *args: str,
    command: Sequence[str] = BENCH,
    cwd: Path = CHECKOUT,
    timeout: float = BENCH_TIMEOUT,
) -> str:
    """`python -m bench ARGS` (or ``command ARGS``) in a session of its own: its last line
    on stdout; killed, and the test failed, past ``timeout`` seconds."""
    process = subprocess.Popen(
        [*command, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            # Its whole session goes, not the bench alone: the brokers and the JVM it
            # started hold its pipes open, and communicate() would wait for them.
            _kill_all(_session_pids(process.pid))
            process.communicate()
        left = _left_running(process.pid)
        _kill_all(left)
    assert process.returncode == 0, err
    assert not left, f"processes left running by `python -m bench {' '.join(args)}`: {left}"
    lines = out.strip().splitlines()
    assert lines, err
    return lines[-1]


def last_line(command: click.Command, *args: str) -> str:
    """Run ``command`` in process: its last line on stdout."""
    before = child_pids()
    result = CliRunner().invoke(command, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert child_pids() <= before, "a server process was left running"
    lines = result.stdout.strip().splitlines()
    assert lines, result.output
    return lines[-1]
