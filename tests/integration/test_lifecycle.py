"""Broker process lifecycle and what connectors see when the broker comes and goes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator

import pytest

import meshbus
from tests.conftest import BrokerProcess
from tests.integration.helpers import IO_TIMEOUT, RawLink, launch_broker, start_broker_process

READY = re.compile(r"meshbus broker (\S+) listening on 127\.0\.0\.1:(\d+)\n")


@pytest.fixture
async def free_port() -> AsyncIterator[int]:
    """A loopback port with nothing listening on it: bound but not listening, so it stays
    reserved for the test and a connect gets 'connection refused'."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# -- the broker process --------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_ready_line_then_clean_exit_on_signal(sig):
    broker = await launch_broker()
    match = READY.fullmatch(broker.ready_line)
    assert match, f"ready line {broker.ready_line!r}"
    name, port = match.group(1), int(match.group(2))
    assert port != 0
    assert name == f"broker-{port}"
    broker.process.send_signal(sig)
    code, rest, err = await broker.finish()
    assert code == 0, err
    assert rest == "", "the broker must print exactly one line on stdout"
    assert "Traceback" not in err


async def test_clean_exit_with_connectors_attached():
    broker = await launch_broker("--name", "b1")
    assert broker.ready_line == f"meshbus broker b1 listening on {broker.address}\n"
    conns = [await meshbus.connect(broker.address, server=f"c{i}") for i in range(3)]
    for conn in conns:
        await conn.register()
    broker.process.send_signal(signal.SIGTERM)
    code, rest, err = await broker.finish()
    assert code == 0, err
    assert rest == ""
    assert "Traceback" not in err
    for conn in conns:
        await conn.close()


async def test_listen_port_is_real():
    broker = await launch_broker("--name", "real")
    try:
        link = await RawLink.open(broker.address)
        try:
            welcome = await link.hello()
            assert welcome.broker == "real"
        finally:
            await link.close()
        async with await meshbus.connect(broker.address, server="g") as conn:
            assert conn.broker_name == "real"
            stat = await conn.stat()
            assert stat["address"] == broker.address
            assert stat["name"] == "real"
    finally:
        broker.process.send_signal(signal.SIGTERM)
        code, _, err = await broker.finish()
        assert code == 0, err


async def test_second_broker_on_same_port_fails_readably():
    first = await launch_broker()
    try:
        second = await start_broker_process("--listen", first.address)
        try:
            out, err = await asyncio.wait_for(second.communicate(), 20)
        except TimeoutError:
            second.kill()
            await second.wait()
            raise AssertionError("a second broker on a taken port kept running") from None
        assert second.returncode != 0
        assert out == b"", "a broker that cannot listen must not print the ready line"
        message = err.decode()
        assert str(first.port) in message, message
        assert "cannot listen" in message.lower() or "in use" in message.lower(), message
        assert "Traceback" not in message, message
        # The first broker is unaffected.
        async with await meshbus.connect(first.address, server="g") as conn:
            await conn.ping()
    finally:
        first.process.send_signal(signal.SIGTERM)
        code, _, err = await first.finish()
        assert code == 0, err


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:99999", ":7400"])
async def test_bad_listen_argument_fails_readably(listen):
    process = await start_broker_process("--listen", listen)
    out, err = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode != 0
    assert out == b""
    message = err.decode()
    assert listen in message, message
    assert "Traceback" not in message, message


# -- connectors when the broker goes away ------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
async def test_connectors_see_connection_lost_when_broker_stops(sig):
    broker = await launch_broker()
    try:
        # They try to reconnect for failover_timeout (the broker might come back): short here.
        requester_conn = await meshbus.connect(broker.address, server="req", failover_timeout=0.5)
        responder_conn = await meshbus.connect(broker.address, server="resp", failover_timeout=0.5)
        requester = await requester_conn.register()
        silent = await responder_conn.register()
        listener = await responder_conn.register()
        request = asyncio.create_task(requester.request(silent.address, b"x", timeout=30))
        receive = asyncio.create_task(listener.recv())

        async def iterate() -> None:
            async for _ in requester:
                pass

        iteration = asyncio.create_task(iterate())
        assert (await silent.recv(timeout=IO_TIMEOUT)).is_request  # the request is pending

        start = time.monotonic()
        broker.process.send_signal(sig)
        for task in (request, receive, iteration):
            with pytest.raises(meshbus.ConnectionLost) as info:
                await asyncio.wait_for(task, IO_TIMEOUT)
            assert "broker" in str(info.value)
        assert time.monotonic() - start < IO_TIMEOUT
        # Later calls fail the same way at once rather than hanging or saying "you closed it".
        with pytest.raises(meshbus.ConnectionLost):
            await requester.send(silent.address, b"y")
        with pytest.raises(meshbus.ConnectionLost):
            await asyncio.wait_for(requester_conn.register(), IO_TIMEOUT)
        with pytest.raises(meshbus.ConnectionLost):
            await asyncio.wait_for(listener.recv(), IO_TIMEOUT)
        await requester_conn.close()
        await responder_conn.close()
        code, _, err = await broker.finish()
    except BaseException:
        if broker.process.returncode is None:
            broker.process.kill()
            await broker.process.wait()
        raise
    if sig == signal.SIGTERM:
        assert code == 0, err
    assert "Traceback" not in err


async def test_closed_connector_raises_not_connected(broker):
    conn = await meshbus.connect(broker.address, server="g")
    svc = await conn.register()
    waiting = asyncio.create_task(svc.request(svc.address, b"x", timeout=30))
    assert (await svc.recv(timeout=IO_TIMEOUT)).is_request
    await conn.close()
    with pytest.raises(meshbus.NotConnected):
        await asyncio.wait_for(waiting, IO_TIMEOUT)
    with pytest.raises(meshbus.NotConnected):
        await svc.send(svc.address, b"y")
    with pytest.raises(meshbus.NotConnected):
        await conn.register()
    await conn.close()  # closing twice is fine


# -- connecting to something that is not a working broker ------------------------------


async def test_connect_to_port_without_broker(free_port):
    address = f"127.0.0.1:{free_port}"
    start = time.monotonic()
    with pytest.raises(meshbus.ConnectionLost) as info:
        await meshbus.connect(address, server="g", timeout=IO_TIMEOUT)
    assert time.monotonic() - start < 1.0
    message = str(info.value)
    assert address in message, message
    assert "refused" in message.lower(), message


async def test_connect_to_a_host_that_does_not_resolve_says_so():
    with pytest.raises(meshbus.ConnectionLost) as info:
        await meshbus.connect("no-such-host.invalid:7400", server="g", timeout=IO_TIMEOUT)
    message = str(info.value)
    assert "'no-such-host.invalid' does not resolve" in message, message
    assert "Unknown error" not in message, message


async def test_connect_to_silent_server_times_out():
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(meshbus.ConnectionLost) as info:
            await meshbus.connect(f"127.0.0.1:{port}", server="g", timeout=0.3)
        elapsed = time.monotonic() - start
        assert 0.3 <= elapsed < 2.0
        assert f"127.0.0.1:{port}" in str(info.value)
        assert "0.3" in str(info.value)
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"\x00\x00\x00\x02\x09\x01"],
    ids=["http-server", "unknown-kind"],
)
async def test_connect_to_server_speaking_another_protocol(answer):
    writers: list[asyncio.StreamWriter] = []

    async def wrong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        writer.write(answer)
        await writer.drain()

    server = await asyncio.start_server(wrong, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(meshbus.ConnectionLost) as info:
            await meshbus.connect(f"127.0.0.1:{port}", server="g", timeout=IO_TIMEOUT)
        assert time.monotonic() - start < 1.0, "an invalid answer must fail the handshake at once"
        assert "invalid" in str(info.value).lower() or "protocol" in str(info.value).lower()
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_broker_name_and_sigterm_via_shared_fixture(broker):
    """The shared fixture's broker is real too: a connector talks to it by its address."""
    async with await meshbus.connect(broker.address, server="g") as conn:
        assert conn.broker_name == broker.name


async def test_broker_survives_running_out_of_file_descriptors() -> None:
    """At its descriptor limit the broker stops accepting, and accepts again once links
    close; it does not crash, and its accept loop survives EMFILE."""
    import resource

    from meshbus.broker.process import broker_command, child_env, parse_ready_line

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    process = await asyncio.create_subprocess_exec(
        *broker_command(),
        stdout=asyncio.subprocess.PIPE,
        env=child_env(),
        preexec_fn=low_fd_limit,
    )
    assert process.stdout is not None
    ready = parse_ready_line((await asyncio.wait_for(process.stdout.readline(), 20)).decode())
    assert ready is not None
    address = ready[1]
    host, port = address.rsplit(":", 1)
    hogs = []
    try:
        for _ in range(100):  # more than the broker can hold open
            _, writer = await asyncio.open_connection(host, int(port))
            hogs.append(writer)
        with pytest.raises(meshbus.ConnectionLost):
            await meshbus.connect(address, server="late", timeout=1.0)
        assert process.returncode is None
    finally:
        for writer in hogs:
            writer.close()
    async with asyncio.timeout(15):
        while True:
            try:
                conn = await meshbus.connect(address, server="late", timeout=1.0)
                break
            except meshbus.ConnectionLost:
                continue
    async with conn:
        assert (await conn.stat())["counters"]["links_accepted"] >= 2
    process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(process.wait(), 10) == 0


async def test_keepalive_survives_a_blocked_event_loop(broker: BrokerProcess) -> None:
    """A connector whose process blocked its loop for longer than 3 keepalive intervals
    (a long synchronous call) keeps its healthy link: it pings instead of aborting."""
    conn = await meshbus.connect(broker.address, server="sleepy", keepalive=0.1, failover=False)
    try:
        service = await conn.register()
        await asyncio.sleep(0.15)
        time.sleep(0.6)  # noqa: ASYNC251 -- the point: nothing runs, nothing is read
        await asyncio.sleep(0.35)  # three ticks after the pause
        await service.send(service.address, b"still there?")
        assert (await service.recv(timeout=2)).payload == b"still there?"
    finally:
        await conn.close()


async def test_a_broker_that_stops_answering_times_a_request_out(broker: BrokerProcess) -> None:
    """SIGSTOP: the link stays open and silent. With no keepalive to notice, the
    request's own deadline does, with a Timeout that names the request."""
    conn = await meshbus.connect(
        broker.address, server="stuck", keepalive=0, failover=False, request_timeout=0.5
    )
    try:
        await conn.ping()
        os.kill(broker.process.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            with pytest.raises(meshbus.Timeout, match=r"did not answer PING within 0\.5 s"):
                await conn.ping()
            assert 0.4 < time.monotonic() - began < 3
        finally:
            os.kill(broker.process.pid, signal.SIGCONT)
        await conn.ping()  # answered again: the link was never lost
    finally:
        await conn.close()
