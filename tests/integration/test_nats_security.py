"""NATS clients on a broker with users, TLS, and a drain (docs/nats.md, "Signing in",
"Permissions", "TLS", "Lame duck mode"): nats.py and raw protocol text against a real
broker process. What a client is told when refused -- the -ERR words, which close -- is
held to a real nats-server configured alike (users with passwords and permissions)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import trustme
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.errors import NoServersError

from bench import servers
from meshbus.auth import Credentials, TokenKey, nkey_public, users_entry
from meshbus.private_files import write_private
from tests.integration.helpers import IO_TIMEOUT
from tests.integration.test_nats_listener import (
    QUIET,
    Inbox,
    RawNats,
    Server,
    client,
    start_meshbus,
    stop,
)

TOKEN = "s3cret-token"  # bob's
PERMISSIONS = """\
[users.permissions]
send = ["multicast:ok.*", "multicast:_INBOX.*"]
join = { allow = ["multicast:ok.*", "multicast:_INBOX.*"], deny = ["multicast:ok.secret"] }
"""


def users(tmp_path: Path, alice: Credentials, *, permissions: str = "") -> Path:
    """A config file with alice (a key pair) and bob (a token), both allowed everything
    unless ``permissions`` (lines of [users.permissions]) is given for bob."""
    config = tmp_path / "broker.toml"
    bob = f'[[users]]\nname = "bob"\ntoken_hash = "{TokenKey.of("bob", TOKEN)}"\n'
    bob += permissions or '[users.permissions]\nsend = ["*"]\njoin = ["*"]\n'
    text = users_entry("alice", public_key=alice.public_key, allow_all=True) + "\n" + bob
    write_private(config, text.encode())
    return config


@pytest.fixture(scope="module")
def alice_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def alice(alice_key: Ed25519PrivateKey) -> Credentials:
    return Credentials("alice", private_key=alice_key)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, alice: Credentials) -> Iterator[int]:
    """A broker with users (alice, bob), whose NATS clients must sign in within 1 s."""
    config = users(tmp_path_factory.mktemp("secured"), alice, permissions=PERMISSIONS)
    process, port = start_meshbus("--config", str(config), "--handshake-timeout", "1")
    try:
        yield port
    finally:
        stop(process)


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """nats-server with bob, his password and the same permissions, for its words."""
    config = tmp_path_factory.mktemp("nats-server") / "server.conf"
    config.write_text(
        "authorization { users = [ { user: bob, password: "
        + json.dumps(TOKEN)
        + ', permissions: { publish: ["ok.*", "_INBOX.>"], subscribe: { allow: '
        '["ok.*", "_INBOX.>"], deny: ["ok.secret"] } } } ] }\n'
    )
    with servers.nats_server("-c", str(config), kind="nats-server") as peer:
        yield peer.port


def sign(key: Ed25519PrivateKey, nonce: object) -> dict[str, object]:
    """The CONNECT fields of an nkey sign-in: the key as a user nkey, the nonce signed
    (URL-safe base64 without padding, as nats.go and nats.js write it)."""
    assert isinstance(nonce, str)
    signature = base64.urlsafe_b64encode(key.sign(nonce.encode())).rstrip(b"=").decode()
    return {"nkey": nkey_public(key.public_key().public_bytes_raw()), "sig": signature}


# -- signing in ----------------------------------------------------------------------------------


async def test_info_asks_for_a_sign_in_with_a_nonce(secured: int) -> None:
    raw = await RawNats.open(secured)
    assert raw.info["auth_required"] is True
    assert isinstance(raw.info["nonce"], str)
    assert len(raw.info["nonce"]) >= 11
    other = await RawNats.open(secured)
    assert other.info["nonce"] != raw.info["nonce"]  # one per connection
    await raw.close()
    await other.close()


async def test_user_and_password_sign_in_with_nats_py(secured: int) -> None:
    async with client(Server("meshbus", secured), user="bob", password=TOKEN) as nc:
        inbox = Inbox()
        await nc.subscribe("ok.a", cb=inbox.cb)
        await nc.publish("ok.a", b"signed in")
        assert [m.data for m in await inbox.wait_for(1)] == [b"signed in"]


async def test_a_token_written_name_colon_token_signs_in(secured: int) -> None:
    async with client(Server("meshbus", secured), token=f"bob:{TOKEN}") as nc:
        await nc.flush(timeout=IO_TIMEOUT)
        assert nc.is_connected


async def test_an_nkey_signs_the_nonce(secured: int, alice_key: Ed25519PrivateKey) -> None:
    raw = await RawNats.open(secured)
    await raw.send(
        b"CONNECT " + json.dumps({**QUIET, **sign(alice_key, raw.info["nonce"])}).encode() + b"\r\n"
    )
    await raw.send(b"SUB anything.at.all 1\r\nPUB anything.at.all 2\r\nhi\r\n")
    assert await raw.message() == ([b"MSG", b"anything.at.all", b"1", b"2"], b"hi")
    await raw.close()
    # A signature of another nonce (a recording) does not sign in.
    stale = sign(alice_key, raw.info["nonce"])
    replay = await RawNats.open(secured)
    await replay.send(b"CONNECT " + json.dumps({**QUIET, **stale}).encode() + b"\r\n")
    assert (await replay.closed()).split(b"\r\n")[0] == b"-ERR 'Authorization Violation'"
    await replay.close()


@pytest.mark.parametrize(
    "connect",
    [
        {"user": "bob", "pass": "wrong"},
        {"user": "nobody", "pass": TOKEN},
        {"auth_token": TOKEN},  # a token alone names no user
        {},
    ],
    ids=["wrong-password", "unknown-user", "bare-token", "no-credentials"],
)
async def test_wrong_or_missing_credentials_are_an_authorization_violation(
    secured: int, nats_server: int, connect: dict[str, object]
) -> None:
    for port in (secured, nats_server):
        raw = await RawNats.open(port)
        await raw.send(b"CONNECT " + json.dumps({**QUIET, **connect}).encode() + b"\r\nPING\r\n")
        rest = await raw.closed()
        assert rest.split(b"\r\n")[0] == b"-ERR 'Authorization Violation'", port
        await raw.close()


async def test_an_operation_before_connect_is_an_authorization_violation(
    secured: int, nats_server: int
) -> None:
    for port in (secured, nats_server):
        raw = await RawNats.open(port)
        await raw.send(b"SUB ok.a 1\r\n")
        assert (await raw.closed()).split(b"\r\n")[0] == b"-ERR 'Authorization Violation'"
        await raw.close()


async def test_nats_py_hears_of_a_wrong_password(secured: int) -> None:
    nc = nats.aio.client.Client()
    with pytest.raises((nats.errors.Error, NoServersError)):
        await nc.connect(
            f"nats://bob:wrong@127.0.0.1:{secured}",
            allow_reconnect=False,
            connect_timeout=IO_TIMEOUT,
        )
    # nats.py raises without closing its socket when the server refuses it; the loop
    # holds the socket until it closes, so no gc.collect() here frees it, and a later test
    # of this worker that collected it failed on the unraisable ResourceWarning (three
    # times: test_tls_with_a_password, test_order_kept_for_burst_of_10000, the routing
    # table's collector test). Closing the client closes it.
    await nc.close()


async def test_a_client_that_never_signs_in_is_closed(secured: int) -> None:
    raw = await RawNats.open(secured)
    assert (await raw.closed()).split(b"\r\n")[0] == b"-ERR 'Authentication Timeout'"
    await raw.close()


# -- permissions ----------------------------------------------------------------------------------


async def test_permissions_violations_are_told_and_the_connection_stays(
    secured: int, nats_server: int
) -> None:
    for port in (secured, nats_server):
        raw = await RawNats.open(port, {**QUIET, "user": "bob", "pass": TOKEN})
        await raw.send(b"PUB no.a 2\r\nhi\r\nSUB no.b 1\r\nSUB no.c q 2\r\n")
        assert [await raw.line() for _ in range(3)] == [
            b"-ERR 'Permissions Violation for Publish to \"no.a\"'",
            b"-ERR 'Permissions Violation for Subscription to \"no.b\"'",
            b'-ERR \'Permissions Violation for Subscription to "no.c" using queue "q"\'',
        ], port
        # Still open, and allowed what it is allowed; a wildcard subscription does not
        # get what a deny pattern names.
        await raw.send(b"SUB ok.* 3\r\nPUB ok.secret 1\r\nx\r\nPUB ok.open 1\r\ny\r\n")
        assert await raw.message() == ([b"MSG", b"ok.open", b"3", b"1"], b"y"), port
        await raw.pong()
        await raw.close()


async def test_requests_need_the_inbox_and_work_with_it(secured: int) -> None:
    async with client(Server("meshbus", secured), user="bob", password=TOKEN) as nc:

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"pong:" + msg.data)

        await nc.subscribe("ok.svc", cb=answer)
        reply = await nc.request("ok.svc", b"1", timeout=IO_TIMEOUT)
        assert reply.data == b"pong:1"


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca_file, cert, key = (directory / name for name in ("ca.pem", "b.crt", "b.key"))
    ca.cert_pem.write_to_path(str(ca_file))
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    write_private(key, leaf.private_key_pem.bytes())
    return ca_file, cert, key


@pytest.fixture(scope="module")
def tls_broker(tls_files: tuple[Path, Path, Path]) -> Iterator[int]:
    _, cert, key = tls_files
    process, port = start_meshbus("--tls-cert", str(cert), "--tls-key", str(key))
    try:
        yield port
    finally:
        stop(process)


async def test_tls_after_info_with_nats_py(
    tls_broker: int, tls_files: tuple[Path, Path, Path]
) -> None:
    raw = await RawNats.open(tls_broker)
    assert raw.info["tls_required"] is True
    await raw.close()
    context = ssl.create_default_context(cafile=str(tls_files[0]))
    async with client(Server("meshbus", tls_broker), tls=context) as nc:
        inbox = Inbox()
        await nc.subscribe("tls.a", cb=inbox.cb)
        await nc.publish("tls.a", b"encrypted")
        assert [m.data for m in await inbox.wait_for(1)] == [b"encrypted"]


async def test_a_plain_client_of_a_tls_listener_is_closed(tls_broker: int) -> None:
    raw = await RawNats.open(tls_broker)
    await raw.send(b'CONNECT {"verbose":false}\r\nPING\r\n')
    rest = await raw.closed()
    assert b"PONG" not in rest
    await raw.close()


async def test_bytes_before_the_handshake_are_never_lost_to_it(
    tls_files: tuple[Path, Path, Path],
) -> None:
    """Nothing a client sends is read before the INFO and the TLS takeover are out, in
    one step. The listener used to read and drop what came in between -- a plain
    client's text, or nats.py's ClientHello sent the moment it had the INFO -- and the
    handshake then waited for its timeout: one connection in ten, on uvloop, so thirty
    in a row each closed long before the (long) timeout."""
    _, cert, key = tls_files
    process, port = start_meshbus(
        "--tls-cert", str(cert), "--tls-key", str(key), "--handshake-timeout", "60"
    )
    try:
        for _ in range(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')  # without the INFO
                async with asyncio.timeout(IO_TIMEOUT):
                    with contextlib.suppress(ConnectionResetError):
                        assert b"PONG" not in await reader.read()
            finally:
                writer.close()
    finally:
        stop(process)


async def test_tls_with_a_password(
    tmp_path: Path, alice: Credentials, tls_files: tuple[Path, Path, Path]
) -> None:
    _, cert, key = tls_files
    config = users(tmp_path, alice)
    process, port = start_meshbus(
        "--config", str(config), "--tls-cert", str(cert), "--tls-key", str(key)
    )
    try:
        context = ssl.create_default_context(cafile=str(tls_files[0]))
        bob = {"user": "bob", "password": TOKEN}
        async with client(Server("meshbus", port), tls=context, **bob) as nc:
            reply = nc.new_inbox()
            inbox = Inbox()
            await nc.subscribe(reply, cb=inbox.cb)
            await nc.publish(reply, b"both")
            assert [m.data for m in await inbox.wait_for(1)] == [b"both"]
    finally:
        stop(process)


# -- connect_urls, lame duck mode ---------------------------------------------------------------


async def test_connect_urls_name_the_advertised_address() -> None:
    process, port = start_meshbus("--nats-advertise", "nats.example:4222")
    try:
        raw = await RawNats.open(port)
        assert raw.info["connect_urls"] == ["nats.example:4222"]
        await raw.close()
    finally:
        stop(process)


async def test_a_drain_sends_ldm_and_clients_move_to_another_broker() -> None:
    first, first_port = start_meshbus("--drain-grace", "1")
    second, second_port = start_meshbus()
    lame_duck = asyncio.Event()
    reconnected = asyncio.Event()

    async def on_ldm() -> None:
        lame_duck.set()

    async def on_reconnect() -> None:
        reconnected.set()

    try:
        nc = await nats.connect(
            servers=[f"nats://127.0.0.1:{first_port}", f"nats://127.0.0.1:{second_port}"],
            dont_randomize=True,
            connect_timeout=IO_TIMEOUT,
            reconnect_time_wait=0.1,
            lame_duck_mode_cb=on_ldm,
            reconnected_cb=on_reconnect,
        )
        try:
            assert nc.connected_url is not None
            assert nc.connected_url.port == first_port
            os.kill(first.pid, signal.SIGTERM)
            async with asyncio.timeout(IO_TIMEOUT):
                await lame_duck.wait()
            # Closed once the grace is over, the client goes on at the other broker.
            async with asyncio.timeout(IO_TIMEOUT):
                await reconnected.wait()
            assert nc.connected_url is not None
            assert nc.connected_url.port == second_port
            inbox = Inbox()
            await nc.subscribe("moved", cb=inbox.cb)
            await nc.publish("moved", b"here")
            assert [m.data for m in await inbox.wait_for(1)] == [b"here"]
        finally:
            await nc.close()
        first.wait(timeout=IO_TIMEOUT)
    finally:
        stop(first)
        stop(second)
