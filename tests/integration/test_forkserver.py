"""The tests' fork server (tests/forkserver.py): a broker forked from it is what an exec'd
one is -- the same output and exit codes, its own process for signals -- or the suite's
brokers would prove nothing about ``python -m meshbus broker``."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from meshbus.broker.process import broker_argv, broker_command, child_env, parse_ready_line
from tests import forkserver

PIPES = {"stdout": asyncio.subprocess.PIPE, "stderr": asyncio.subprocess.PIPE}


async def test_a_refused_flag_reads_the_same_forked_as_exec_d() -> None:
    argv = broker_argv("--max-services", "-1")
    exec_d = await asyncio.create_subprocess_exec(*argv, **PIPES, env=child_env())
    forked = await forkserver.launch(*argv, **PIPES, env=child_env())
    assert forked.pid != exec_d.pid
    assert await forked.communicate() == await exec_d.communicate()
    assert forked.returncode == exec_d.returncode == 2


async def test_a_forked_broker_runs_in_the_test_s_directory_and_answers_signals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    process = await forkserver.launch(
        *broker_command("--data-dir", "data"), **PIPES, env=child_env()
    )
    assert process.stdout is not None
    ready = parse_ready_line((await asyncio.wait_for(process.stdout.readline(), 20)).decode())
    assert ready is not None
    assert os.readlink(f"/proc/{process.pid}/cwd") == str(tmp_path)
    assert (tmp_path / "data").is_dir()
    host, port = ready[1].rsplit(":", 1)

    process.send_signal(signal.SIGSTOP)  # paused: it accepts (the kernel does), never answers
    _, writer = await asyncio.open_connection(host, int(port))
    await asyncio.sleep(0.2)
    assert process.returncode is None
    process.send_signal(signal.SIGCONT)
    writer.close()
    await writer.wait_closed()

    process.kill()
    assert await asyncio.wait_for(process.wait(), 10) == -signal.SIGKILL
    assert process.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        process.kill()


async def test_sigterm_drains_a_forked_broker_to_exit_0() -> None:
    process = await forkserver.launch(*broker_command(), **PIPES, env=child_env())
    assert process.stdout is not None
    assert parse_ready_line((await asyncio.wait_for(process.stdout.readline(), 20)).decode())
    process.terminate()
    assert await asyncio.wait_for(process.wait(), 10) == 0


async def test_what_is_not_a_meshbus_command_is_exec_d() -> None:
    process = await forkserver.launch(
        "/bin/sh", "-c", "echo $$; exit 7", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    assert int(out) == process.pid  # the shell itself: no fork server in between
    assert process.returncode == 7
