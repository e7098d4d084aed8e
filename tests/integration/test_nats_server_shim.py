"""``meshbus nats-server``: started as a NATS client's test harness starts nats-server
(``-a``, ``-p -1``, ``-m``, ``--user``/``--pass``, ``--ports_file_dir``), it writes
nats-server's ready lines, and nats.py connects to the port they name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nats

from meshbus.broker.process import child_env, stop_process
from tests.integration.helpers import IO_TIMEOUT, free_port

_LISTENING = re.compile(r"\[\d+\] \S+ \S+ \[INF\] Listening for client connections on (\S+):(\d+)$")


def shim(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshbus", "nats-server", *args],
        stderr=subprocess.PIPE,
        env=child_env(),
    )


def ready_port(process: subprocess.Popen[bytes]) -> int:
    """The port of its 'Listening for client connections' line, once 'Server is ready'."""
    assert process.stderr is not None
    port = 0
    for raw in process.stderr:
        line = raw.decode().rstrip()
        listening = _LISTENING.match(line)
        if listening:
            port = int(listening[2])
        if line.endswith("[INF] Server is ready"):
            return port
    raise AssertionError("no 'Server is ready' line")


async def test_a_random_port_a_user_and_the_ports_file(tmp_path: Path) -> None:
    monitor = free_port()
    process = shim(
        "-a", "127.0.0.1", "-p", "-1", "-m", str(monitor), "--user", "u", "--pass", "p",
        "-DV", f"--ports_file_dir={tmp_path}",
    )  # fmt: skip
    try:
        port = ready_port(process)
        assert port > 0
        ports = json.loads((tmp_path / f"nats-server_{process.pid}.ports").read_text())
        assert ports["nats"] == [f"nats://127.0.0.1:{port}"]
        assert ports["monitoring"] == [f"http://127.0.0.1:{monitor}"]
        nc = await nats.connect(
            f"nats://u:p@127.0.0.1:{port}", allow_reconnect=False, connect_timeout=IO_TIMEOUT
        )
        try:
            reply = nc.new_inbox()
            sub = await nc.subscribe(reply)
            await nc.publish(reply, b"in its place")
            assert (await sub.next_msg(timeout=IO_TIMEOUT)).data == b"in its place"
        finally:
            await nc.close()
    finally:
        stop_process(process)
        assert process.stderr is not None
        process.stderr.close()


def test_what_it_cannot_do_is_refused_with_a_reason() -> None:
    process = shim("-p", "-1", "-js")
    _, err = process.communicate(timeout=30)
    assert process.returncode == 2
    assert "does not take -js" in err.decode()
    assert "Use nats-server for those" in err.decode()
