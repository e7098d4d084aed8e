"""``python -m meshbus.demo`` runs its whole scenario and exits 0; on Ctrl-C it leaves
no broker or Spark process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _hear_sigint() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A test run started in the
    background of a non-interactive shell (``make test &``) has SIGINT ignored, and an
    ignored signal stays ignored across exec -- the demo would rightly not hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def start_demo(*args: str) -> asyncio.subprocess.Process:
    """The demo in a process group of its own, with its brokers and Spark's JVM: a test
    that fails or times out kills the whole group (``kill_demo``), not the demo alone,
    whose children would outlive it."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshbus.demo", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=_hear_sigint, start_new_session=True,
    )  # fmt: skip


async def kill_demo(process: asyncio.subprocess.Process) -> None:
    """A demo still running when its test ends (failed, timed out) is killed with its
    whole process group. One that exited is left as it is: what it left behind is for
    the test to find (``left_behind``)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def left_behind(work_dir: str) -> str:
    """Processes whose command line names the demo's work dir (its brokers, the JVM)."""
    found = subprocess.run(["pgrep", "-af", work_dir], capture_output=True, text=True)
    return found.stdout.strip()


@pytest.mark.timeout(240)
async def test_demo_runs_and_passes(tmp_path: object) -> None:
    report = f"{tmp_path}/report.html"
    process = await start_demo("--play-seconds", "10", "--report", report)
    try:
        out_bytes, err_bytes = await asyncio.wait_for(process.communicate(), 200)
    finally:
        await kill_demo(process)
    out, err = out_bytes.decode(), err_bytes.decode()
    assert process.returncode == 0, out + err
    assert "Traceback" not in err, err[-4000:]
    for expected in (
        "3 brokers: 127.0.0.1:",
        "TLS and sign-in on",
        "durable stream results on mesh-1",
        "12 players logged in",
        "Spark job: stream results",
        "kill -9 mesh-2",
        "failover done in",
        "starting mesh-4",
        "the leaderboard matches every result",
        "wrote",
        "reliable match results: lost /",
        "leaderboard top 5",
        "demo passed",
    ):
        assert expected in out, f"{expected!r} missing from the demo output:\n{out}"
    assert re.search(r"reliable rewards: lost / duplicated\s*│\s*0 / 0", out), out
    stopped = (
        "brokers stopped: mesh-1 exit 0, mesh-2 killed (signal 9), mesh-3 exit 0, mesh-4 exit 0"
    )
    assert stopped in " ".join(out.split()), out  # as words: the console wraps long lines
    # Each broker linked to mesh-2 reports its loss once, naming itself (past the time stamp).
    lost = [line.split(" ", 2)[2] for line in err.splitlines() if "peer broker lost" in line]
    assert lost, err[-4000:]
    assert len(lost) == len(set(lost)), lost
    work_dir = re.search(r"work dir (\S+)", out)
    assert work_dir, out
    assert not left_behind(work_dir[1])
    page = await asyncio.to_thread(pathlib.Path(report).read_text, encoding="utf-8")
    assert page.count('<img src="data:image/png;base64,') == 4, page[:2000]
    assert "mesh-1" in page
    # mesh-2's streams died with it: the report says so, from what the others recorded.
    gone = page.split("<h2>Unreachable brokers</h2>")[1].split("<h2>")[0]
    assert "<td>mesh-2</td>" in gone, gone
    assert "crashed (" in gone, gone
    assert "<td>crash</td><td>mesh-2</td>" in page
    assert "<td>join</td><td>mesh-4</td>" in page


@pytest.mark.timeout(120)
async def test_ctrl_c_leaves_no_process_behind() -> None:
    process = await start_demo("--play-seconds", "8")
    assert process.stdout is not None
    seen = b""
    try:
        # Mid-way: the brokers, the players' connectors and Spark's streaming query up.
        while b"Spark job: stream results" not in seen:
            line = await asyncio.wait_for(process.stdout.readline(), 60)
            assert line, f"the demo ended early:\n{seen.decode()}"
            seen += line
        process.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        await kill_demo(process)
    assert process.returncode == 130, (seen + rest + err).decode()
    work_dir = re.search(rb"work dir (\S+)", seen)
    assert work_dir, seen
    assert not left_behind(work_dir[1].decode())
