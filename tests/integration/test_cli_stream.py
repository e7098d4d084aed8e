"""``meshbus stream``, run as real subprocesses against real brokers: the happy path of
every command, and clean errors (no traceback, the right exit code) for bad input.

Runs as `python -m meshbus stream ...` once the group is registered in meshbus.cli.main, and
through a one-line shim around ``meshbus.cli.stream.stream`` until then.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
from dataclasses import dataclass

import meshbus
from meshbus.cli.main import main
from tests.conftest import BrokerProcess, start_mesh, stop_all

CLI_TIMEOUT = 30.0
_SHIM = "from meshbus.cli.stream import stream; stream(prog_name='meshbus stream')"


@dataclass
class Result:
    code: int
    out: str
    err: str


def stream_argv() -> list[str]:
    if "stream" in main.list_commands(None):  # type: ignore[arg-type]
        return [sys.executable, "-m", "meshbus", "stream"]
    return [sys.executable, "-c", _SHIM]


async def stream_cli(*args: str, stdin: bytes = b"") -> Result:
    process = await asyncio.create_subprocess_exec(
        *stream_argv(),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},  # a wide table: one row per line
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), CLI_TIMEOUT)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    result = Result(process.returncode, out.decode(), err.decode())
    assert "Traceback" not in result.err, result.err
    return result


async def test_add_info_list_fetch_delete(broker: BrokerProcess) -> None:
    at = ("--broker", broker.address)
    added = await stream_cli(
        "add", "orders", "--capture", "multicast:orders", "--max-msgs", "50", *at
    )
    assert added.code == 0, added.err
    assert re.search(r"host broker\s*│\s*" + re.escape(broker.name), added.out), added.out
    assert re.search(r"max msgs\s*│\s*50 ", added.out), added.out
    async with await meshbus.connect(broker.address, server="pub") as conn:
        publisher = await conn.register()
        for payload in (b"one", b"two\nlines", b"three"):
            await publisher.send_reliable("multicast:orders", payload)
        source = str(publisher.address)

    info = await stream_cli("info", "orders", "--json", *at)
    assert info.code == 0, info.err
    assert json.loads(info.out) == {
        "name": "orders",
        "broker": broker.name,
        "captures": ["multicast:orders"],
        "first_seq": 1,
        "last_seq": 3,
        "messages": 3,
        "bytes": 17,
        "consumers": [],
        "max_msgs": 50,
        "max_bytes": 1 << 30,  # none given: the broker's --max-stream-bytes
        "max_age": 0.0,
        "dedupe_window": 120.0,
        "store": "",  # this broker keeps its streams in memory
        "host": socket.gethostname(),
        "owner": "",  # a broker without users: nobody's
        "replicas": [],  # --replicas 1: no Raft group
        "leader": "",
        "replica_states": [],
        "learners": [],
    }
    table = await stream_cli("info", "orders", *at)
    assert table.code == 0
    assert re.search(r"messages\s*│\s*3 ", table.out), table.out
    assert re.search(r"last seq\s*│\s*3 ", table.out), table.out
    assert re.search(r"stored in\s*│\s*memory ", table.out), table.out
    assert re.search(r"max bytes\s*│\s*1,073,741,824 \(1 GiB\) ", table.out), table.out
    assert re.search(r"bytes\s*│\s*17 ", table.out), table.out

    listed = await stream_cli("list", "--json", *at)
    assert (listed.code, json.loads(listed.out)) == (0, [{"name": "orders", "broker": broker.name}])
    listed = await stream_cli("list", *at)
    assert re.search(r"orders\s*│\s*" + re.escape(broker.name), listed.out), listed.out

    fetched = await stream_cli("fetch", "orders", "--json", *at)
    assert fetched.code == 0, fetched.err
    rows = [json.loads(line) for line in fetched.out.splitlines()]
    assert [(r["seq"], r["payload"], r["src"], r["dst"]) for r in rows] == [
        (1, "one", source, "multicast:orders"),
        (2, "two\nlines", source, "multicast:orders"),
        (3, "three", source, "multicast:orders"),
    ]
    assert rows[0]["stored_at"] <= rows[1]["stored_at"] <= rows[2]["stored_at"]
    plain = await stream_cli("fetch", "orders", "--from", "2", "--count", "1", *at)
    assert plain.code == 0
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    line = rf"#2 {stamp} \[{source} -> multicast:orders\] two\\nlines"
    assert re.fullmatch(line, plain.out.strip()), plain.out

    refused = await stream_cli("delete", "orders", *at)  # no --yes, and stdin says nothing
    prompt = "Delete stream orders and all its messages? [y/N]: Aborted!"
    assert (refused.code, refused.err.strip().splitlines()[-1]) == (1, prompt)
    assert (await stream_cli("info", "orders", *at)).code == 0
    deleted = await stream_cli("delete", "orders", "--yes", *at)
    assert (deleted.code, deleted.out) == (0, "deleted stream orders\n")
    gone = await stream_cli("info", "orders", *at)
    assert gone.code == 1
    assert gone.err.startswith("Error: no stream named 'orders'")
    assert (await stream_cli("list", "--json", *at)).out.strip() == "[]"


async def test_info_and_fetch_through_another_broker_of_the_mesh() -> None:
    brokers = await start_mesh(2)
    try:
        host, other = brokers
        added = await stream_cli("add", "events", "--capture", "multicast:events", "--capture",
                                 "multicast:audit", "--json", "--broker", host.address)  # fmt: skip
        assert added.code == 0, added.err
        assert json.loads(added.out)["captures"] == ["multicast:events", "multicast:audit"]
        async with await meshbus.connect(host.address, server="pub") as conn:
            publisher = await conn.register()
            await publisher.send_reliable("multicast:audit", b"audited")
        info = await stream_cli("info", "events", "--json", "--broker", other.address)
        assert info.code == 0, info.err
        assert (json.loads(info.out)["broker"], json.loads(info.out)["messages"]) == (host.name, 1)
        fetched = await stream_cli("fetch", "events", "--json", "--broker", other.address)
        assert [json.loads(line)["payload"] for line in fetched.out.splitlines()] == ["audited"]
    finally:
        assert await stop_all(brokers) == [0, 0]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_errors_are_one_line_and_exit_non_zero(broker: BrokerProcess) -> None:
    at = ("--broker", broker.address)
    cases = [
        # (args, exit code, the start of the last line on stderr)
        (("info", "nope", *at), 1, "Error: no stream named 'nope' on this broker; create it"),
        (("fetch", "nope", *at), 1, "Error: no stream named 'nope'"),
        (("delete", "nope", "--yes", *at), 1, "Error: no stream named 'nope'"),
        (("info", "x", "--broker", "nohost:x"), 2, "Error: Invalid value for '--broker'"),
        (
            ("info", "x", "--broker", f"127.0.0.1:{_closed_port()}"),
            1,
            "Error: could not connect to broker 127.0.0.1:",
        ),
        (
            ("add", "s", "--capture", "anycast:pool", *at),
            2,
            "Error: Invalid value for '--capture': anycast:pool is not a multicast address",
        ),
        (("add", "s", *at), 2, "Error: Missing option '--capture'"),
        (
            ("add", "bad name", "--capture", "multicast:x", *at),
            2,
            "Error: Invalid value for 'NAME'",
        ),
        (("fetch", "s", "--from", "0", *at), 2, "Error: Invalid value for '--from'"),
    ]
    for args, code, message in cases:
        result = await stream_cli(*args)
        assert result.code == code, (args, result)
        assert result.err.strip().splitlines()[-1].startswith(message), (args, result.err)
        assert result.out == "", (args, result.out)
    # A stream that exists with other settings is refused, not changed.
    assert (await stream_cli("add", "s", "--capture", "multicast:s", *at)).code == 0
    changed = await stream_cli("add", "s", "--capture", "multicast:s", "--max-msgs", "9", *at)
    assert changed.code == 1
    assert changed.err.startswith("Error: stream 's' already exists with a different configuration")


async def test_help_explains_each_command() -> None:
    group = await stream_cli("--help")
    assert group.code == 0
    for command in ("add", "delete", "fetch", "info", "list"):
        assert re.search(rf"^\s+{command}\s+\S", group.out, re.MULTILINE), group.out
    add = await stream_cli("add", "--help")
    for option in ("--capture", "--max-msgs", "--max-bytes", "--max-age", "--dedupe-window"):
        assert option in add.out
    assert "host the stream" in add.out
