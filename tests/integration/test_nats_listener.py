"""NATS clients on a real broker (``meshbus broker --nats-listen``): nats.py, the NATS
project's own asyncio client, and raw protocol text over a socket.

Every test of what a client sees runs twice: against the broker's listener and against
a real nats-server (on its own port, -p -1), so the behaviour is held to the server it
copies -- the -ERR words, which errors close, what a message looks like. The
tests of the broker's own bounds (slow consumers, stale connections, the connection
limit) run against the broker alone; sign-in, permissions, TLS and lame duck mode are
tests/integration/test_nats_security.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from bench.nats_py import flushed
from bench.servers import nats_server
from meshbus.broker.process import (
    broker_command,
    child_env,
    nats_address_of,
    parse_ready_line,
    stop_process,
)
from tests.integration.helpers import (
    IO_TIMEOUT,
    wait_until,
)

# -- servers -----------------------------------------------------------------------------


@dataclass
class Server:
    kind: str  # "meshbus" or "nats-server"
    port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"


def stop(process: subprocess.Popen[bytes]) -> None:
    stop_process(process)
    if process.stdout is not None:
        process.stdout.close()


def start_meshbus(*args: str) -> tuple[subprocess.Popen[bytes], int]:
    """A broker process with --nats-listen on a port of its own choosing, ready: its port
    is the one its ready line names."""
    process = subprocess.Popen(
        broker_command("--nats-listen", "127.0.0.1:0", *args),
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    nats_address = nats_address_of(line)
    if parse_ready_line(line) is None or not nats_address:
        stop(process)
        raise AssertionError(f"the broker did not come up: {line!r}")
    return process, int(nats_address.rsplit(":", 1)[1])


@pytest.fixture(scope="module", params=["meshbus", "nats-server"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The server under test: the broker's NATS listener, or nats-server itself (one
    process per module, shared by its tests: each test uses subjects of its own)."""
    if request.param == "nats-server":
        # nats-server picks its own port (-p -1) and logs it: no port handed over and lost.
        with nats_server(kind="nats-server") as peer:
            yield Server(peer.kind, peer.port)
        return
    process, port = start_meshbus()
    try:
        yield Server(request.param, port)
    finally:
        stop(process)


@contextlib.asynccontextmanager
async def client(server: Server, **options: object) -> AsyncIterator[Client]:
    # nats.py waits 2 s for a server by default: not enough on a loaded machine.
    nc = await nats.connect(
        server.url,
        allow_reconnect=False,
        connect_timeout=IO_TIMEOUT,
        **options,  # type: ignore[arg-type]
    )
    try:
        yield nc
    finally:
        await nc.close()


class Inbox:
    """A subscription's messages, in arrival order."""

    def __init__(self) -> None:
        self.messages: list[Msg] = []
        self.arrived = asyncio.Event()

    async def cb(self, msg: Msg) -> None:
        self.messages.append(msg)
        self.arrived.set()

    async def wait_for(self, count: int) -> list[Msg]:
        async with asyncio.timeout(IO_TIMEOUT):
            while len(self.messages) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.messages


# -- raw protocol text ------------------------------------------------------------------


class RawNats:
    """A NATS connection driven by hand: lines out, lines and messages in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.info: dict[str, object] = {}

    @classmethod
    async def open(cls, port: int, connect: dict[str, object] | None = None) -> RawNats:
        """Connected and greeted; with ``connect``, that CONNECT sent and a PING answered."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = cls(reader, writer)
        line = await raw.line()
        assert line.startswith(b"INFO "), line
        raw.info = json.loads(line[5:])
        if connect is not None:
            await raw.send(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
            assert await raw.line() == b"PONG"
        return raw

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def line(self) -> bytes:
        """The next line, without its CRLF; AssertionError if the connection closed."""
        async with asyncio.timeout(IO_TIMEOUT):
            line = await self.reader.readline()
        assert line.endswith(b"\r\n"), f"the connection closed ({line!r} was left)"
        return line[:-2]

    async def message(self) -> tuple[list[bytes], bytes]:
        """The next MSG or HMSG: (its line's words, the bytes after the line)."""
        words = (await self.line()).split()
        assert words[0] in (b"MSG", b"HMSG"), words
        async with asyncio.timeout(IO_TIMEOUT):
            data = await self.reader.readexactly(int(words[-1]) + 2)
        assert data.endswith(b"\r\n")
        return words, data[:-2]

    async def closed(self) -> bytes:
        """Everything the server still sends until it closes the connection."""
        async with asyncio.timeout(IO_TIMEOUT):
            try:
                return await self.reader.read()
            except ConnectionResetError:
                return b""

    async def pong(self) -> None:
        """A PING answered: the server handled everything sent before it."""
        await self.send(b"PING\r\n")
        assert await self.line() == b"PONG"

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


QUIET = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True}


# -- what every client sees ------------------------------------------------------------------


async def test_info_has_what_clients_read(server: Server) -> None:
    raw = await RawNats.open(server.port)
    info = raw.info
    assert info["proto"] == 1
    assert info["headers"] is True
    assert info["max_payload"] == 1024 * 1024
    assert isinstance(info["server_id"], str)
    assert isinstance(info["client_id"], int)
    assert info["client_ip"] == "127.0.0.1"
    assert str(info["version"]).startswith("2.")
    # nats-core reads these three as required (the protocol reference lists them).
    assert isinstance(info["go"], str)
    assert info["host"] == "127.0.0.1"
    assert isinstance(info["port"], int)
    await raw.close()


async def test_without_connect_every_operation_gets_ok_as_on_telnet(server: Server) -> None:
    raw = await RawNats.open(server.port)
    await raw.send(b"sub telnet.x 1\r\n")
    assert await raw.line() == b"+OK"
    await raw.send(b"PUB telnet.x 2\r\nhi\r\n")
    assert [await raw.line() for _ in range(3)] == [b"+OK", b"MSG telnet.x 1 2", b"hi"]
    await raw.close()


async def test_pub_sub_with_wildcards_one_copy_per_matching_sid(server: Server) -> None:
    async with client(server) as nc:
        exact, one, rest, other = Inbox(), Inbox(), Inbox(), Inbox()
        await nc.subscribe("wild.a.b", cb=exact.cb)
        await nc.subscribe("wild.*.b", cb=one.cb)
        await nc.subscribe("wild.>", cb=rest.cb)
        await nc.subscribe("wild.*", cb=other.cb)
        await nc.publish("wild.a.b", b"1")
        await nc.publish("wild.z", b"2")
        await nc.publish("wild.a.b.c", b"3")
        await nc.flush()
        assert [m.data for m in await exact.wait_for(1)] == [b"1"]
        assert [m.data for m in await one.wait_for(1)] == [b"1"]
        assert [m.data for m in await rest.wait_for(3)] == [b"1", b"2", b"3"]
        assert [m.data for m in await other.wait_for(1)] == [b"2"]
        await nc.flush()
        assert len(exact.messages) == len(one.messages) == len(other.messages) == 1
        assert len(rest.messages) == 3


async def test_a_queue_group_gets_each_message_once(server: Server) -> None:
    count = 90
    async with client(server) as a, client(server) as b, client(server) as c:
        inboxes = [Inbox(), Inbox(), Inbox()]
        for nc, inbox in zip((a, b, c), inboxes, strict=True):
            await nc.subscribe("jobs.run", queue="workers", cb=inbox.cb)
        everything = Inbox()
        await a.subscribe("jobs.>", cb=everything.cb)
        await flushed(a, b, c)
        async with client(server) as publisher:
            for i in range(count):
                await publisher.publish("jobs.run", str(i).encode())
            await publisher.flush()
        await everything.wait_for(count)
        for nc in (a, b, c):
            await nc.flush()  # whatever the group got has arrived
        got = [m.data for inbox in inboxes for m in inbox.messages]
        assert sorted(got) == sorted(str(i).encode() for i in range(count))
        assert all(inbox.messages for inbox in inboxes), "the picks are random: all get some"


async def test_headers_round_trip_byte_for_byte(server: Server) -> None:
    sub = await RawNats.open(server.port, QUIET)
    pub = await RawNats.open(server.port, QUIET)
    await sub.send(b"SUB hdr.x 7\r\n")
    await sub.pong()
    headers = b"NATS/1.0\r\nX-Odd:   spaced  value \r\nx-lower: a\r\nX-Odd: twice\r\n\r\n"
    data = headers + b"payload\r\nwith crlf"
    await pub.send(b"HPUB hdr.x reply.to %d %d\r\n%b\r\n" % (len(headers), len(data), data))
    words, got = await sub.message()
    assert words == [b"HMSG", b"hdr.x", b"7", b"reply.to", b"%d" % len(headers), b"%d" % len(data)]
    assert got == data
    # A client that did not turn headers on gets the payload alone, as MSG.
    plain = await RawNats.open(server.port, {"verbose": False, "pedantic": False})
    await plain.send(b"SUB hdr.x 1\r\n")
    await plain.pong()
    await pub.send(b"HPUB hdr.x %d %d\r\n%b\r\n" % (len(headers), len(data), data))
    words, got = await plain.message()
    assert words == [b"MSG", b"hdr.x", b"1", b"%d" % (len(data) - len(headers))]
    assert got == data[len(headers) :]
    for raw in (sub, pub, plain):
        await raw.close()


async def test_nats_py_headers(server: Server) -> None:
    async with client(server) as nc:
        inbox = Inbox()
        await nc.subscribe("hdr.py", cb=inbox.cb)
        await nc.publish("hdr.py", b"x", headers={"Trace-Id": "abc", "N": "1"})
        [msg] = await inbox.wait_for(1)
        assert msg.headers == {"Trace-Id": "abc", "N": "1"}
        assert msg.data == b"x"


async def test_request_reply_and_many_replies(server: Server) -> None:
    async with client(server) as responders, client(server) as requester:

        async def answer(msg: Msg) -> None:
            await msg.respond(b"re:" + msg.data)

        async def answer_twice(msg: Msg) -> None:
            await responders.publish(msg.reply, b"second")

        await responders.subscribe("svc.echo", cb=answer)
        await flushed(responders)
        reply = await requester.request("svc.echo", b"hello", timeout=IO_TIMEOUT)
        assert reply.data == b"re:hello"
        # Many replies to one request are legal: the reply subject is a plain subject.
        await responders.subscribe("svc.echo", cb=answer_twice)
        await flushed(responders)
        inbox = Inbox()
        reply_subject = requester.new_inbox()
        await requester.subscribe(reply_subject, cb=inbox.cb)
        await requester.publish("svc.echo", b"q", reply=reply_subject)
        replies = await inbox.wait_for(2)
        assert sorted(m.data for m in replies) == [b"re:q", b"second"]


async def test_no_responders(server: Server) -> None:
    async with client(server) as nc:
        with pytest.raises(NoRespondersError):
            await nc.request("nobody.home", b"?", timeout=IO_TIMEOUT)
    raw = await RawNats.open(server.port, QUIET)
    await raw.send(b"SUB _INBOX.raw.* 5\r\nPUB nobody.home _INBOX.raw.1 0\r\n\r\n")
    words, header = await raw.message()
    assert words[:3] == [b"HMSG", b"_INBOX.raw.1", b"5"]
    assert header.startswith(b"NATS/1.0 503\r\n")
    await raw.close()


async def test_unsub_with_max(server: Server) -> None:
    async with client(server) as nc:
        inbox = Inbox()
        sub = await nc.subscribe("limited", cb=inbox.cb)
        await sub.unsubscribe(limit=2)
        for i in range(5):
            await nc.publish("limited", b"%d" % i)
        await nc.flush()
        await inbox.wait_for(2)
        await nc.flush()
        assert [m.data for m in inbox.messages] == [b"0", b"1"]
    raw = await RawNats.open(server.port, QUIET)
    await raw.send(b"SUB limited.raw 9\r\nUNSUB 9 1\r\n")
    await raw.send(b"PUB limited.raw 1\r\na\r\nPUB limited.raw 1\r\nb\r\n")
    words, data = await raw.message()
    assert (words[2], data) == (b"9", b"a")
    await raw.pong()  # and not the second message before it
    await raw.close()


async def test_echo_off(server: Server) -> None:
    async with client(server, no_echo=True) as quiet, client(server) as other:
        mine, theirs = Inbox(), Inbox()
        await quiet.subscribe("echo.t", cb=mine.cb)
        await other.subscribe("echo.t", cb=theirs.cb)
        await flushed(quiet, other)
        await quiet.publish("echo.t", b"from quiet")
        await quiet.flush()
        await theirs.wait_for(1)
        await quiet.flush()
        assert mine.messages == []


async def test_ping_pong_both_ways(server: Server) -> None:
    raw = await RawNats.open(server.port, QUIET)
    await raw.send(b"ping\r\n")
    assert await raw.line() == b"PONG"
    await raw.close()
    async with client(server) as nc:
        before = time.monotonic()
        await nc.flush(timeout=IO_TIMEOUT)  # a PING answered
        assert time.monotonic() - before < IO_TIMEOUT


async def test_invalid_subject_is_refused_and_the_connection_stays(server: Server) -> None:
    raw = await RawNats.open(server.port, QUIET)
    for subject in (b"bad..subject", b"bad.>.x", b"bad."):
        await raw.send(b"SUB " + subject + b" 1\r\n")
        assert await raw.line() == b"-ERR 'Invalid Subject'"
    await raw.pong()
    await raw.close()


async def test_a_pedantic_client_hears_of_a_wildcard_publish(server: Server) -> None:
    raw = await RawNats.open(server.port, {**QUIET, "pedantic": True})
    await raw.send(b"PUB pedantic.* 0\r\n\r\n")
    assert await raw.line() == b"-ERR 'Invalid Publish Subject'"
    await raw.pong()
    await raw.close()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (b"ZZZ\r\n", b"-ERR 'Unknown Protocol Operation'"),
        (b"PUB big 1048577\r\n", b"-ERR 'Maximum Payload Violation'"),
        (b"SUB " + b"x" * 5000 + b" 1\r\n", b"-ERR 'maximum control line exceeded'"),
        (b'CONNECT {"protocol": 5}\r\n', b"-ERR 'invalid client protocol'"),
        (
            b'CONNECT {"no_responders": true, "headers": false}\r\n',
            b"-ERR 'no responders requires headers support'",
        ),
        (b"PUB foo x\r\n", b""),  # no -ERR: nats-server just closes
        (b"SUB foo\r\n", b""),
        (b"-ERR 'from a client'\r\n", b""),
    ],
)
async def test_errors_that_close(server: Server, text: bytes, error: bytes) -> None:
    raw = await RawNats.open(server.port, QUIET)
    await raw.send(text)
    rest = await raw.closed()
    assert rest.split(b"\r\n")[0] == error
    await raw.close()


async def test_a_second_sub_of_a_sid_in_use_changes_nothing(server: Server) -> None:
    raw = await RawNats.open(server.port, QUIET)
    await raw.send(b"SUB dup.first 1\r\nSUB dup.second 1\r\n")
    await raw.send(b"PUB dup.second 1\r\nb\r\nPUB dup.first 1\r\na\r\n")
    words, data = await raw.message()
    assert (words[1], data) == (b"dup.first", b"a")
    await raw.pong()
    await raw.close()


async def test_hpub_without_headers_turned_on_closes_quietly(server: Server) -> None:
    raw = await RawNats.open(server.port, {"verbose": False, "pedantic": False})
    await raw.send(b"HPUB h 12 12\r\nNATS/1.0\r\n\r\n\r\n")
    assert await raw.closed() == b""
    await raw.close()


async def test_a_clients_info_and_ok_are_read_past(server: Server) -> None:
    raw = await RawNats.open(server.port, QUIET)
    await raw.send(b'INFO {"server_id": "client"}\r\n+OK\r\n')
    await raw.pong()
    await raw.close()


async def test_nats_py_reconnect_url_list_is_sane(server: Server) -> None:
    async with client(server) as nc:
        assert nc.max_payload == 1024 * 1024
        assert nc.is_connected


# -- the broker's own bounds ------------------------------------------------------------------


@pytest.fixture
def bounded() -> Iterator[int]:
    """A broker with small bounds: 1 MiB of unsent output per client, three clients,
    pings every 0.2 s with one left unanswered at most."""
    process, port = start_meshbus(
        "--max-pending-bytes", str(1 << 20),
        "--max-connectors", "3",
        "--nats-ping-interval", "0.2",
        "--nats-max-pings-out", "1",
    )  # fmt: skip
    try:
        yield port
    finally:
        stop(process)


async def slow_consumer(port: int) -> RawNats:
    """A client subscribed to ``flood`` that reads nothing more, with a small receive
    buffer: what the broker sends it piles up in the broker."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    slow = RawNats(reader, writer)
    assert (await slow.line()).startswith(b"INFO ")
    await slow.send(b'CONNECT {"verbose":false}\r\nSUB flood 1\r\nPING\r\n')
    assert await slow.line() == b"PONG"
    return slow


async def flood(nc: Client, slow: RawNats) -> None:
    """10 MiB to ``flood`` -- more than the socket buffers and 1 MiB of unsent output
    hold -- until ``slow``'s connection is gone (what it reads ends)."""
    payload = b"x" * 65536
    for _ in range(160):
        await nc.publish("flood", payload)
    await nc.flush(timeout=IO_TIMEOUT)
    async with asyncio.timeout(IO_TIMEOUT):
        while await slow.reader.read(1 << 20):
            pass


async def test_a_slow_consumer_is_closed_and_others_go_on(bounded: int) -> None:
    slow = await slow_consumer(bounded)
    async with client(Server("meshbus", bounded)) as nc:
        await flood(nc, slow)
        # The publisher goes on.
        inbox = Inbox()
        await nc.subscribe("after", cb=inbox.cb)
        await nc.publish("after", b"still here")
        assert [m.data for m in await inbox.wait_for(1)] == [b"still here"]
    await slow.close()


async def test_a_client_that_does_not_answer_pings_is_stale(bounded: int) -> None:
    raw = await RawNats.open(bounded, QUIET)
    assert await raw.line() == b"PING"
    rest = await raw.closed()
    assert rest.split(b"\r\n")[0] == b"-ERR 'Stale Connection'"
    await raw.close()
    # One that answers stays.
    async with client(Server("meshbus", bounded)) as nc:
        await asyncio.sleep(1.0)
        assert nc.is_connected
        await nc.flush(timeout=IO_TIMEOUT)


async def test_past_the_connection_limit_a_client_is_refused(bounded: int) -> None:
    held = [await RawNats.open(bounded, QUIET) for _ in range(3)]
    extra = await RawNats.open(bounded)
    rest = await extra.closed()
    assert rest.split(b"\r\n")[0] == b"-ERR 'maximum connections exceeded'"
    await extra.close()
    await held.pop().close()

    async def admitted() -> bool:
        raw = await RawNats.open(bounded)
        await raw.send(b"PING\r\n")
        line = (await raw.reader.readline()).strip()
        await raw.close()
        return line == b"PONG"

    await wait_until(admitted, "a client admitted once another left")
    for raw in held:
        await raw.close()
