"""The ``meshbus`` command, run as real subprocesses against a real broker.

Readiness is never guessed with a sleep: a test that starts ``listen`` or
``reply`` polls the broker's ``stat`` until the membership or registration is
there, then sends. ``listen`` runs without PYTHONUNBUFFERED on purpose: its
output must reach the pipe line by line on its own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
import trustme

import meshbus
from meshbus.auth import Credentials
from meshbus.cli.common import EXIT_TIMEOUT
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import free_port, start_secure_broker, user_with

CLI_TIMEOUT = 30.0
READY_TIMEOUT = 10.0


class Broker(Protocol):
    address: str
    name: str


@dataclass
class Result:
    code: int
    out: str
    err: str


async def spawn_cli(
    *args: str, stdin: int = asyncio.subprocess.DEVNULL
) -> asyncio.subprocess.Process:
    """`python -m meshbus ARGS` with stdout and stderr captured; stdin empty unless PIPE."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshbus",
        *args,
        stdin=stdin,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def run_cli(*args: str, timeout: float = CLI_TIMEOUT, stdin: bytes | None = None) -> Result:
    """Run a command to its end; ``stdin``: the bytes it reads there."""
    process = await spawn_cli(
        *args, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


@asynccontextmanager
async def cli_process(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A long-running command (listen, reply); killed at the end if it is still running."""
    process = await spawn_cli(*args)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def finish(process: asyncio.subprocess.Process) -> Result:
    out, err = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT)
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


async def wait_for_stat(
    address: str, ready: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """Poll the broker's stat until ``ready`` holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT
    async with await meshbus.connect(address, server="probe") as conn:
        while True:
            data = await conn.stat()
            if ready(data):
                return data
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last stat: {data}")
            await asyncio.sleep(0.02)


def members(group: str, count: int = 1) -> Callable[[dict[str, Any]], bool]:
    return lambda data: len(data["groups"].get(group, [])) >= count


def registered(address: str) -> Callable[[dict[str, Any]], bool]:
    return lambda data: address in data["service_addresses"]


# -- send / listen -------------------------------------------------------------------


async def test_listen_send_multicast_to_two_members(broker: Broker) -> None:
    args = ("--broker", broker.address, "multicast:chat", "--count", "1", "--timeout", "20")
    async with (
        cli_process("listen", *args) as text_listener,
        cli_process("listen", "--json", *args) as json_listener,
    ):
        await wait_for_stat(broker.address, members("multicast:chat", 2), "two chat members")
        sent = await run_cli(
            "send", "--broker", broker.address, "-H", "Trace: 7", "multicast:chat", "hello world"
        )
        assert sent.code == 0, sent.err
        assert sent.out == ""

        text = await finish(text_listener)
        assert text.code == 0, text.err
        assert re.fullmatch(r"\[cli:\d+ -> multicast:chat\] hello world\n", text.out), text.out
        assert "listening on multicast:chat" in text.err

        as_json = await finish(json_listener)
        assert as_json.code == 0, as_json.err
        message = json.loads(as_json.out)
        assert message["dst"] == "multicast:chat"
        assert message["payload"] == "hello world"
        assert message["request"] is False
        assert message["headers"] == {"Trace": "7"}
        assert re.fullmatch(r"cli:\d+", message["src"])


def subscriptions(count: int) -> Callable[[dict[str, Any]], bool]:
    return lambda data: data["nats"]["service_subscriptions"] >= count


async def test_subscribe_with_wildcards_gets_what_publish_sends(broker: Broker) -> None:
    at = ("--broker", broker.address)
    async with (
        cli_process("subscribe", *at, "game.*.chat", "game.eu.>", "--count", "2") as text,
        cli_process("subscribe", *at, "--json", "game.>", "--count", "1") as as_json,
    ):
        await wait_for_stat(broker.address, subscriptions(3), "three subject subscriptions")
        # Matches both of the first subscriber's patterns: it gets one copy.
        sent = await run_cli("publish", *at, "-H", "Trace: 7", "game.eu.chat", "gg")
        assert (sent.code, sent.out) == (0, ""), sent.err
        assert (await run_cli("publish", *at, "game.us.chat", "hi")).code == 0
        printed = await finish(text)
        assert printed.code == 0, printed.err
        lines = printed.out.splitlines()
        assert len(lines) == 2, printed.out
        assert lines[0].endswith("-> game.eu.chat] gg"), lines
        assert lines[1].endswith("-> game.us.chat] hi"), lines
        assert "subscribed to game.*.chat game.eu.>" in printed.err
        message = json.loads((await finish(as_json)).out)
        assert (message["subject"], message["payload"]) == ("game.eu.chat", "gg")
        assert message["headers"] == {"Trace": "7"}


async def test_subscribe_and_publish_refuse_what_is_not_a_subject(broker: Broker) -> None:
    at = ("--broker", broker.address)
    bad = await run_cli("subscribe", *at, "game..chat", "--timeout", "5")
    assert bad.code == 1, bad
    assert "game..chat" in bad.err
    wild = await run_cli("publish", *at, "game.*", "x")
    assert wild.code == 1, wild
    assert "game.*" in wild.err
    quiet = await run_cli("subscribe", *at, "nobody.here", "--count", "1", "--timeout", "0.3")
    assert quiet.code == EXIT_TIMEOUT, quiet


async def test_listen_prints_each_line_as_it_arrives(broker: Broker) -> None:
    async with cli_process(
        "listen", "--broker", broker.address, "--server", "ears", "anycast:news"
    ) as listener:
        await wait_for_stat(broker.address, members("anycast:news"), "the listener")
        assert listener.stdout is not None
        for n in range(2):
            sent = await run_cli("send", "--broker", broker.address, "anycast:news", f"item {n}")
            assert sent.code == 0, sent.err
            line = await asyncio.wait_for(listener.stdout.readline(), CLI_TIMEOUT)
            assert line.decode().endswith(f"-> anycast:news] item {n}\n")


async def test_listen_on_unicast_address_registers_it(broker: Broker) -> None:
    async with cli_process(
        "listen", "--broker", broker.address, "game01:5", "--count", "1", "--timeout", "20"
    ) as listener:
        await wait_for_stat(broker.address, registered("game01:5"), "game01:5")

        taken = await run_cli("listen", "--broker", broker.address, "game01:5", "--count", "1")
        assert taken.code == 1
        assert "game01:5 is already registered" in taken.err
        assert "Traceback" not in taken.err

        sent = await run_cli("send", "--broker", broker.address, "game01:5", "two\nlines")
        assert sent.code == 0, sent.err
        result = await finish(listener)
        assert result.code == 0, result.err
        assert re.fullmatch(r"\[cli:\d+ -> game01:5\] two\\nlines\n", result.out), result.out
        assert "listening on game01:5 as game01:5" in result.err


async def test_listen_timeout_before_count_exits_3(broker: Broker) -> None:
    result = await run_cli(
        "listen", "--broker", broker.address, "multicast:quiet", "--count", "1", "--timeout", "0.2"
    )
    assert result.code == 3
    assert "received 0 of 1 messages" in result.err


async def test_send_notify_reports_no_route(broker: Broker) -> None:
    plain = await run_cli("send", "--broker", broker.address, "anycast:nobody", "x")
    assert plain.code == 0, plain.err
    assert plain.err == ""

    notified = await run_cli("send", "--notify", "--broker", broker.address, "anycast:nobody", "x")
    assert notified.code == 4
    assert "no route to anycast:nobody" in notified.err
    assert "Traceback" not in notified.err


async def test_send_notify_is_quiet_when_delivered(broker: Broker) -> None:
    async with await meshbus.connect(broker.address, server="game01") as conn:
        room = await conn.register(instance=3)
        sent = await run_cli("send", "--notify", "--broker", broker.address, "game01:3", "hi")
        assert sent.code == 0, sent.err
        message = await room.recv(timeout=5)
        assert message.payload == b"hi"


async def test_send_reads_the_payload_from_stdin_or_a_file(broker: Broker, tmp_path: Path) -> None:
    binary = bytes(range(256))
    payload_file = tmp_path / "payload.bin"
    payload_file.write_bytes(binary)
    async with await meshbus.connect(broker.address, server="game01") as conn:
        room = await conn.register(instance=4)
        for args, stdin in (
            (["game01:4", "-"], b"from stdin\n"),
            (["game01:4"], b"stdin, no TEXT"),
            (["game01:4", "--file", str(payload_file)], None),
        ):
            sent = await run_cli("send", "--broker", broker.address, *args, stdin=stdin)
            assert sent.code == 0, sent.err
            assert (await room.recv(timeout=5)).payload == (binary if stdin is None else stdin)
    both = await run_cli("send", "game01:4", "text", "--file", str(payload_file))
    assert both.code == 2
    assert "TEXT and --file exclude each other" in both.err


async def test_send_without_text_on_a_terminal_asks_for_it() -> None:
    terminal, stdin = os.openpty()
    try:
        process = await spawn_cli("send", "multicast:a", stdin=stdin)
        result = await finish(process)
    finally:
        os.close(terminal)
        os.close(stdin)
    assert result.code == 2
    assert "Missing argument 'TEXT' (or --file PATH, or a payload on stdin)" in result.err


async def test_listen_json_puts_binary_payloads_in_base64(broker: Broker) -> None:
    async with cli_process(
        "listen", "--json", "--broker", broker.address, "multicast:bin", "--count", "2"
    ) as listener:
        await wait_for_stat(broker.address, members("multicast:bin"), "the listener")
        async with await meshbus.connect(broker.address, server="game01") as conn:
            service = await conn.register()
            await service.send(meshbus.Multicast("bin"), b"\xff\x00binary")
            await service.send(meshbus.Multicast("bin"), "text über".encode())
        result = await finish(listener)
    assert result.code == 0, result.err
    binary, text = (json.loads(line) for line in result.out.splitlines())
    assert (binary["encoding"], base64.b64decode(binary["payload"])) == (
        "base64",
        b"\xff\x00binary",
    )
    assert (text["encoding"], text["payload"]) == ("utf-8", "text über")


# -- request / reply -------------------------------------------------------------------


async def test_reply_timeout_stops_it(broker: Broker) -> None:
    quiet = await run_cli("reply", "--broker", broker.address, "anycast:quiet", "--timeout", "0.3")
    assert quiet.code == 0, quiet.err
    short = await run_cli(
        "reply", "--broker", broker.address, "anycast:quiet", "--count", "1", "--timeout", "0.3"
    )
    assert short.code == 3
    assert "answered 0 of 1 requests" in short.err


async def test_reply_echo_and_request(broker: Broker) -> None:
    async with cli_process(
        "reply", "--broker", broker.address, "anycast:echo", "--count", "2"
    ) as responder:
        await wait_for_stat(broker.address, members("anycast:echo"), "the responder")
        for text in ("ping", "über"):
            result = await run_cli("request", "--broker", broker.address, "anycast:echo", text)
            assert result.code == 0, result.err
            assert result.out == f"{text}\n"
        done = await finish(responder)
        assert done.code == 0, done.err
        assert done.out.splitlines()[1].endswith("-> anycast:echo] über")


async def test_reply_fixed_text_on_unicast_address(broker: Broker) -> None:
    async with cli_process(
        "reply", "--broker", broker.address, "--text", "pong", "game01:7", "--count", "1"
    ) as responder:
        await wait_for_stat(broker.address, registered("game01:7"), "game01:7")
        result = await run_cli("request", "--broker", broker.address, "game01:7", "ping")
        assert result.code == 0, result.err
        assert result.out == "pong\n"
        assert (await finish(responder)).code == 0


async def test_request_timeout_exits_3(broker: Broker) -> None:
    async with await meshbus.connect(broker.address, server="game01") as conn:
        await conn.register(instance=9)  # registered, never answers
        result = await run_cli(
            "request", "--broker", broker.address, "--timeout", "0.3", "game01:9", "anyone?"
        )
    assert result.code == 3
    assert result.out == ""
    assert "no response from game01:9" in result.err
    assert "Traceback" not in result.err


async def test_request_no_route_exits_4(broker: Broker) -> None:
    result = await run_cli("request", "--broker", broker.address, "anycast:nobody", "x")
    assert result.code == 4
    assert result.out == ""
    assert "no service is registered at or member of anycast:nobody" in result.err
    assert "Traceback" not in result.err


# -- stat ----------------------------------------------------------------------------


async def test_stat_json_and_table(broker: Broker) -> None:
    async with await meshbus.connect(broker.address, server="game01") as conn:
        player = await conn.register()
        await player.join(meshbus.Multicast("chat.lobby"))
        fixed = await conn.register(instance=1)

        result = await run_cli("stat", "--json", "--broker", broker.address)
        assert result.code == 0, result.err
        data = json.loads(result.out)
        assert data["name"] == broker.name
        assert data["address"] == broker.address
        # The connector's first service is also in the broadcast group.
        assert data["groups"] == {
            "multicast:chat.lobby": [str(player.address)],
            "multicast:$all": [str(player.address)],
        }
        assert {str(player.address), str(fixed.address)} <= set(data["service_addresses"])
        names = {link["name"] for link in data["links"]}
        assert {"game01", "cli"} <= names
        assert {"msgs_in", "requests", "timeouts", "dropped_no_route"} <= set(data["counters"])

        table = await run_cli("stat", "--broker", broker.address)
        assert table.code == 0, table.err
        for text in (broker.name, "links", "groups", "counters", "multicast:chat.lobby"):
            assert text in table.out


async def test_stat_with_only_the_stat_right_falls_back_to_the_brief_view(
    tmp_path: Path,
) -> None:
    config = tmp_path / "broker.toml"
    creds: dict[str, Path] = {}
    entries = []
    for user, rights in (("viewer", '["stat"]'), ("ops", '["stat-detail"]')):
        who = Credentials.generate(user)
        creds[user] = tmp_path / f"{user}.creds"
        who.write(creds[user])
        entries.append(user_with(who, f"operator = {rights}"))
    config.write_text("".join(entries))
    broker = await start_broker("--config", str(config))
    try:
        at = ("--broker", broker.address)
        brief = await run_cli("stat", *at, "--creds", str(creds["viewer"]))
        assert brief.code == 0, brief.err
        assert brief.err.startswith("permission denied: user 'viewer' may not use the operator")
        assert brief.err.rstrip().endswith("showing the brief view (meshbus stat --brief)")
        assert "this broker links to only its [[brokers]]" in brief.out
        assert "counters" not in brief.out
        as_json = await run_cli("stat", "--json", *at, "--creds", str(creds["viewer"]))
        assert as_json.code == 0, as_json.err
        assert "groups" not in json.loads(as_json.out)  # the brief answer
        full = await run_cli("stat", *at, "--creds", str(creds["ops"]))
        assert (full.code, full.err) == (0, "")
        assert "this broker links to only its [[brokers]]" in full.out
        words = " ".join(full.out.split())  # the headline wraps at 80 columns
        assert "0 connectors (capacity 50) and 1 operator link" in words
        assert "operator links: 1 (this command's among them" in words
    finally:
        assert await broker.stop() == 0


# -- configuration from the environment -------------------------------------------------


async def test_the_environment_names_the_broker_its_ca_and_the_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secure = await start_secure_broker(tmp_path, "alice")
    try:
        monkeypatch.setenv("MESHBUS_BROKER", secure.process.address)
        monkeypatch.setenv("MESHBUS_TLS_CA", str(secure.ca_file))
        monkeypatch.setenv("MESHBUS_CREDS", str(secure.creds))
        result = await run_cli("stat", "--json")
        assert result.code == 0, result.err
        assert json.loads(result.out)["name"] == secure.process.name
        async with await meshbus.connect(server="envtest") as conn:
            assert conn.broker_name == secure.process.name
        elsewhere = f"127.0.0.1:{free_port()}"  # an explicit --broker wins
        refused = await run_cli("stat", "--broker", elsewhere)
        assert refused.err.startswith(f"Error: could not connect to broker {elsewhere}")
    finally:
        await stop_all([secure.process])


async def test_no_tls_is_plain_tcp_whatever_meshbus_tls_ca_says(
    broker: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca))
    monkeypatch.setenv("MESHBUS_TLS_CA", str(ca))
    over_tls = await run_cli("stat", "--json", "--broker", broker.address)
    assert over_tls.code == 1, over_tls  # the environment's TLS, against a plain broker
    plain = await run_cli("stat", "--json", "--no-tls", "--broker", broker.address)
    assert plain.code == 0, plain.err
    assert json.loads(plain.out)["name"] == broker.name
    both = await run_cli("stat", "--no-tls", "--tls-ca", str(ca), "--broker", broker.address)
    assert both.code == 2, both
    assert "--no-tls contradicts --tls-ca" in both.err


async def test_a_broker_without_a_port_means_port_7400() -> None:
    if not _port_is_free(7400):
        pytest.skip("something listens on 127.0.0.1:7400")
    result = await run_cli("stat", "--broker", "127.0.0.1")
    assert result.code == 1, result
    assert result.err.startswith("Error: could not connect to broker 127.0.0.1:7400")
    with pytest.raises(meshbus.MeshbusError, match=r"127\.0\.0\.1:7400"):
        await meshbus.connect("127.0.0.1", timeout=1)


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["send", "nocolon", "x"], "has no ':'"),
        (["send", "game01:abc", "x"], "is not a decimal integer"),
        (["send", "Multicast:chat", "x"], "did you mean multicast:chat?"),
        (["send", "--broker", "localhost:x", "multicast:a", "x"], "is not a number"),
        (["stat", "--broker", "127.0.0.1:99999"], "out of range"),
        (["send", "multicast:" + "a" * 16, "x"], "the limit is 15 bytes"),
        (["listen", "averylongname:1"], "the limit is 11 bytes"),
        (["request", "--server", "s" * 12, "anycast:a", "x"], "the limit is 11 bytes"),
        (["listen", "game01:70000"], "only fixed ids 1..65535"),
        (["request", "--timeout", "0", "anycast:a", "x"], "--timeout"),
        (["reply", "--echo", "--text", "a", "anycast:a"], "exclude each other"),
    ],
)
async def test_bad_arguments_exit_2(args: list[str], message: str) -> None:
    result = await run_cli(*args)
    assert result.code == 2, result
    assert "Usage:" in result.err
    assert message in result.err
    assert "Traceback" not in result.err


@pytest.mark.parametrize(
    "args",
    [
        ["send", "multicast:a", "x"],
        ["request", "anycast:a", "x"],
        ["listen", "multicast:a"],
        ["reply", "anycast:a"],
        ["stat"],
    ],
)
async def test_no_broker_exits_1_without_traceback(args: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    result = await run_cli(args[0], "--broker", address, *args[1:])
    assert result.code == 1
    assert result.err.startswith(f"Error: could not connect to broker {address}")
    assert "Traceback" not in result.err


async def test_help_explains_addresses_and_exit_codes() -> None:
    main = await run_cli("--help")
    assert main.code == 0
    assert "multicast:NAME" in main.out
    assert "SERVER:INSTANCE" in main.out
    request = await run_cli("request", "--help")
    assert "3 timeout" in request.out
    assert "4 no route" in request.out
    assert "anycast:NAME" in request.out
