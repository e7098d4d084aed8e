"""Signing in to real brokers started with a config file that has users (keys made at
test time): who gets in, what the others see, and what a raw link is told -- nothing
before it signed in. Also the config file itself, and ``meshbus keygen`` end to end."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import meshbus
from meshbus.auth import Credentials, TokenKey, users_entry
from meshbus.private_files import write_private
from meshbus.protocol import ControlFrame, ControlType, ErrorCode, encode_control
from meshbus.protocol.control import TOKEN_PROOF_SIZE, Auth, Challenge, Error, Hello, Welcome
from meshbus.protocol.handshake import sign_in_message
from tests.conftest import BrokerProcess, start_broker
from tests.integration.helpers import (
    IO_TIMEOUT,
    RawLink,
    assert_next_is,
    broker_key,
    start_broker_process,
    wait_until,
)

TOKEN = "bobs-dev-token"


@dataclass
class Mesh:
    """Brokers sharing one config file, and the credentials files of its users."""

    brokers: list[BrokerProcess]
    config: Path
    alice: Path  # a key pair
    bob: Path  # a token

    @property
    def address(self) -> str:
        return self.brokers[0].address


def write_config(tmp_path: Path, *settings: str, brokers: str = "") -> tuple[Path, Path, Path]:
    """A config file with users alice (key) and bob (token), and their credentials files;
    ``brokers``, the [[brokers]] entries, if any (a broker with users links to no other
    without them)."""
    alice = Credentials.generate("alice")
    alice_file = tmp_path / "alice.creds"
    alice.write(alice_file)
    bob_file = tmp_path / "bob.creds"
    Credentials("bob", token=TOKEN).write(bob_file)
    config = tmp_path / "broker.toml"
    text = (
        "".join(f"{line}\n" for line in settings)
        + users_entry("alice", public_key=alice.public_key, allow_all=True)
        + users_entry("bob", token_hash=str(TokenKey.of("bob", TOKEN)), allow_all=True)
        + brokers
    )
    write_private(config, text.encode())  # token hashes: the broker's secret
    return config, alice_file, bob_file


@asynccontextmanager
async def mesh_with_users(tmp_path: Path, count: int = 1, *args: str) -> AsyncIterator[Mesh]:
    """``count`` brokers sharing one config file, each with its own key, all of them in
    its [[brokers]]."""
    keys = [broker_key(tmp_path, f"b{index}") for index in range(1, count + 1)]
    config, alice, bob = write_config(tmp_path, brokers="".join(key.entry for key in keys))
    first = await start_broker("--config", str(config), *keys[0].args, *args)
    brokers = [first]
    try:
        for key in keys[1:]:
            brokers.append(
                await start_broker(
                    "--config", str(config), *key.args, "--seed", first.address, *args
                )
            )
        yield Mesh(brokers, config, alice, bob)
    finally:
        codes = await asyncio.gather(*(b.stop() for b in brokers))
        assert all(code in (0, -9) for code in codes), codes


@pytest.fixture
async def users_mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with mesh_with_users(tmp_path) as mesh:
        yield mesh


async def stat_as(address: str, credentials: Path) -> dict[str, Any]:
    async with await meshbus.connect(
        address, server="stat", operator=True, credentials=credentials
    ) as conn:
        return await conn.stat()


async def run_cli(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshbus",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "MESHBUS_CREDS"},
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


# -- who gets in --------------------------------------------------------------------------------


async def test_a_good_key_connects_sends_and_receives(users_mesh: Mesh) -> None:
    async with (
        await meshbus.connect(users_mesh.address, server="a", credentials=users_mesh.alice) as a,
        await meshbus.connect(
            users_mesh.address, server="b", credentials=Credentials.load(users_mesh.alice)
        ) as b,
    ):
        sender, receiver = await a.register(), await b.register()
        await sender.send(receiver.address, b"signed in")
        await assert_next_is(receiver, b"signed in")
    data = await stat_as(users_mesh.address, users_mesh.alice)
    assert {link["user"] for link in data["links"]} == {"alice"}


async def test_a_good_token_works(users_mesh: Mesh) -> None:
    async with await meshbus.connect(
        users_mesh.address, server="b", credentials=Credentials("bob", token=TOKEN)
    ) as conn:
        service = await conn.register()
        await service.send(service.address, b"mine")
        await assert_next_is(service, b"mine")
        data = await stat_as(users_mesh.address, users_mesh.bob)
        assert sorted((link["role"], link["user"]) for link in data["links"]) == [
            ("connector", "bob"),
            ("operator", "bob"),
        ]


async def test_meshbus_creds_is_read_when_no_credentials_are_given(
    users_mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHBUS_CREDS", str(users_mesh.alice))
    async with await meshbus.connect(users_mesh.address, server="env") as conn:
        await conn.ping()


REFUSED_KEY = "this broker does not accept the key given for user"


@pytest.mark.parametrize(
    ("credentials", "expected"),
    [
        (lambda: Credentials.generate("alice"), REFUSED_KEY + " 'alice'"),  # wrong key
        (lambda: Credentials.generate("mallory"), REFUSED_KEY + " 'mallory'"),  # unknown user
        (lambda: Credentials("bob", token="guess"), "does not accept the token given for user"),
        (lambda: Credentials("alice", token=TOKEN), "does not accept the token"),  # wrong kind
        (lambda: None, "requires authentication, and no credentials were given"),
    ],
    ids=["wrong-key", "unknown-user", "wrong-token", "token-for-a-key-user", "missing"],
)
async def test_a_bad_or_missing_credential_is_refused_and_the_link_closes(
    users_mesh: Mesh,
    monkeypatch: pytest.MonkeyPatch,
    credentials: Any,
    expected: str,
) -> None:
    monkeypatch.delenv("MESHBUS_CREDS", raising=False)
    with pytest.raises(meshbus.AuthenticationFailed, match=expected) as raised:
        await meshbus.connect(users_mesh.address, server="x", credentials=credentials())
    message = str(raised.value)
    assert users_mesh.address in message
    if credentials() is None:
        for hint in ("credentials=", "--creds", "MESHBUS_CREDS"):
            assert hint in message
    else:
        assert "check the credentials file" in message

    async def none_left() -> bool:
        data = await stat_as(users_mesh.address, users_mesh.alice)
        return [link["role"] for link in data["links"]] == ["operator"]

    await wait_until(none_left, "the refused link to close")


# -- what a raw link sees ----------------------------------------------------------------------


async def challenged(link: RawLink, correlation: int = 5) -> bytes:
    """Send HELLO; the broker's only answer is a CHALLENGE; its nonce."""
    await link.send(encode_control(ControlType.HELLO, Hello(name="raw"), correlation))
    frame = await link.read_control()
    assert frame.type == ControlType.CHALLENGE, frame
    assert frame.correlation == correlation
    assert isinstance(frame.body, Challenge)
    with pytest.raises(TimeoutError):  # and nothing else, until the AUTH comes
        await asyncio.wait_for(link.reader.read(1), 0.3)
    return frame.body.nonce


async def test_after_hello_only_a_challenge_and_after_a_bad_auth_only_an_error(
    users_mesh: Mesh,
) -> None:
    link = await RawLink.open(users_mesh.address)
    try:
        nonce = await challenged(link)
        wrong = Credentials.generate("alice").answer(sign_in_message(nonce))
        await link.send(encode_control(ControlType.AUTH, wrong, 5))
        frames = await link.read_until_closed()
    finally:
        await link.close()
    assert len(frames) == 1, frames  # no WELCOME, no broker list
    (frame,) = frames
    assert isinstance(frame, ControlFrame)
    assert frame.type == ControlType.ERROR
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.AUTH_FAILED
    assert users_mesh.brokers[0].name not in frame.body.message


async def test_a_signature_of_this_links_nonce_opens_it(users_mesh: Mesh) -> None:
    alice = Credentials.load(users_mesh.alice)
    link = await RawLink.open(users_mesh.address)
    try:
        nonce = await challenged(link)
        await link.send(encode_control(ControlType.AUTH, alice.answer(sign_in_message(nonce)), 5))
        frame = await link.read_control()
        assert frame.type == ControlType.WELCOME, frame
        assert frame.correlation == 5
        assert isinstance(frame.body, Welcome)
        assert frame.body.broker == users_mesh.brokers[0].name
        await link.ping()
    finally:
        await link.close()


async def test_a_frame_other_than_auth_after_the_challenge_is_refused(users_mesh: Mesh) -> None:
    link = await RawLink.open(users_mesh.address)
    try:
        await challenged(link)
        await link.send(encode_control(ControlType.STAT, meshbus.protocol.control.StatRequest(), 6))
        (frame,) = await link.read_until_closed()
    finally:
        await link.close()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.AUTH_FAILED
    assert "requires authentication" in frame.body.message


async def test_the_handshake_timeout_runs_until_the_sign_in_is_done(tmp_path: Path) -> None:
    args = ("--handshake-timeout", "0.5", "--heartbeat-interval", "0.1")
    async with mesh_with_users(tmp_path, 1, *args) as mesh:
        link = await RawLink.open(mesh.address)
        try:
            await challenged(link)
            (frame,) = await link.read_until_closed(timeout=IO_TIMEOUT)
        finally:
            await link.close()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.NOT_HANDSHAKEN
    assert "AUTH" in frame.body.message
    assert "--handshake-timeout" in frame.body.message


@pytest.mark.parametrize("user", ["alice", "bob"], ids=["key", "token"])
async def test_a_recorded_sign_in_is_refused_on_a_new_link(users_mesh: Mesh, user: str) -> None:
    """The AUTH a user sent, captured off a plain-TCP link and replayed byte for byte on a
    new one, does not sign in: it answered another nonce. A token's AUTH does not hold the
    token either."""
    credentials = Credentials.load(users_mesh.alice if user == "alice" else users_mesh.bob)
    first = await RawLink.open(users_mesh.address)
    try:
        nonce = await challenged(first)
        recorded = encode_control(ControlType.AUTH, credentials.answer(sign_in_message(nonce)), 5)
        await first.send(recorded)
        assert (await first.read_control()).type == ControlType.WELCOME  # the real sign-in
    finally:
        await first.close()
    replay = await RawLink.open(users_mesh.address)
    try:
        await challenged(replay)
        await replay.send(recorded)
        (frame,) = await replay.read_until_closed()
    finally:
        await replay.close()
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error)
    assert frame.body.code == ErrorCode.AUTH_FAILED
    assert TOKEN.encode() not in recorded


async def test_a_flood_of_bad_tokens_does_not_stall_the_loop(users_mesh: Mesh) -> None:
    async def bad_token() -> None:
        link = await RawLink.open(users_mesh.address)
        try:
            await link.send(encode_control(ControlType.HELLO, Hello(), 1))
            await link.read_control()
            bad = Auth(user="bob", token_proof=bytes(TOKEN_PROOF_SIZE))
            await link.send(encode_control(ControlType.AUTH, bad, 1))
            await link.read_until_closed(timeout=30)
        finally:
            await link.close()

    await asyncio.gather(*(bad_token() for _ in range(100)))
    data = await stat_as(users_mesh.address, users_mesh.bob)
    # The broker's own share of its loop lag (its loop thread's CPU time): a token's proof
    # is two HMACs, where checking the token itself took a scrypt each (100 of them on
    # the loop stalled it 833 ms). The wall-clock maximum would also count time the
    # broker waited for a core on a busy machine.
    assert data["loop_lag_ms"]["max_own"] < 200, data["loop_lag_ms"]


# -- failover signs in again; brokers without users --------------------------------------------


async def test_failover_signs_in_to_the_next_broker(tmp_path: Path) -> None:
    async with (
        mesh_with_users(tmp_path, 2) as mesh,
        await meshbus.connect(mesh.address, server="fo", credentials=mesh.alice) as conn,
    ):
        service = await conn.register(instance=7)
        first = conn.broker_name
        dying = next(b for b in mesh.brokers if b.name == first)
        dying.process.kill()
        await wait_until(lambda: _failed_over(conn), "the connector to fail over")
        assert conn.broker_name != first
        await service.send(service.address, b"after failover")
        await assert_next_is(service, b"after failover")


async def _failed_over(conn: meshbus.Connector) -> bool:
    return conn.failovers == 1


async def test_a_broker_without_users_takes_anyone_as_today(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    key_file = tmp_path / "k.creds"
    Credentials.generate("alice").write(key_file)
    async with (
        await meshbus.connect(broker.address, server="plain") as plain,
        await meshbus.connect(broker.address, server="keyed", credentials=key_file) as keyed,
    ):
        await plain.ping()
        await keyed.ping()
        data = await plain.stat()
        assert {link["user"] for link in data["links"]} == {None}
    link = await RawLink.open(broker.address)
    try:
        assert (await link.hello()).broker == broker.name  # WELCOME straight after HELLO
    finally:
        await link.close()


# -- the config file and the CLI ----------------------------------------------------------------


async def test_the_config_files_values_take_effect_and_a_flag_overrides_one(
    tmp_path: Path,
) -> None:
    key = broker_key(tmp_path, "from-file")
    config, alice, _ = write_config(
        tmp_path, key.settings, "max-connectors = 7", "max-operators = 3"
    )
    broker = await start_broker("--config", str(config), "--max-connectors", "9")
    try:
        data = await stat_as(broker.address, alice)
    finally:
        assert await broker.stop() == 0
    assert broker.name == "from-file"
    assert data["capacity"] == 9  # the command line wins


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max-conectors = 7\n", "unknown key 'max-conectors'"),
        ("max-connectors = { a = 1 }\n", "max-connectors is a string or a number"),
        ("listen = \n", "is not valid TOML"),
        (
            '[[users]]\nname = "ann"\ntoken_hash = "nope"\n',
            "user 'ann': a token hash is written token-v2:",
        ),
        ('[[users]]\nname = "ann"\n', "user 'ann' needs exactly one of public_key"),
        (
            '[[users]]\nname = "ann"\npublic_key = "ed25519:AAAA"\n',
            "user 'ann': an Ed25519 key is 32 bytes",
        ),
        (
            (users_entry("ann", token_hash=str(TokenKey.of("ann", "t"))) * 2),
            "two users are named 'ann'",
        ),
    ],
    ids=[
        "unknown-key",
        "bad-value",
        "bad-toml",
        "bad-hash",
        "no-credential",
        "bad-key",
        "same-name",
    ],
)
async def test_a_bad_config_file_is_refused_at_start_naming_the_file(
    tmp_path: Path, text: str, expected: str
) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(text)
    process = await start_broker_process("--listen", "127.0.0.1:0", "--config", str(config))
    out, err = await asyncio.wait_for(process.communicate(), 20)
    stderr = err.decode()
    assert process.returncode == 2, (out, stderr)
    assert expected in stderr
    assert str(config) in stderr
    assert "Traceback" not in stderr


async def test_keygen_output_works_end_to_end(tmp_path: Path) -> None:
    creds = tmp_path / "carol.creds"
    code, out, err = await run_cli("keygen", "--user", "carol", "--out", str(creds), "--allow-all")
    assert code == 0, err
    assert str(creds) in err
    assert (creds.stat().st_mode & 0o777) == 0o600
    config = tmp_path / "broker.toml"
    # dave's entry is as keygen prints it by default: every permission an empty list.
    dave = tmp_path / "dave.creds"
    code, dave_entry, err = await run_cli("keygen", "--user", "dave", "--out", str(dave))
    assert code == 0, err
    config.write_text(broker_key(tmp_path, "b1").settings + out + dave_entry)
    code, _, err = await run_cli("keygen", "--user", "carol", "--out", str(creds))
    assert code == 1
    assert "already exists" in err

    broker = await start_broker("--config", str(config))
    try:
        code, out, err = await run_cli(
            "stat", "--broker", broker.address, "--json", "--creds", str(creds)
        )
        assert code == 0, err
        assert '"user": "carol"' in out
        code, _, err = await run_cli("stat", "--broker", broker.address)
        assert code == 1
        assert "--creds" in err
        assert "Traceback" not in err
        code, _, err = await run_cli("stat", "--broker", broker.address, "--creds", str(dave))
        assert code == 1
        assert "permission denied" in err, err
        assert "operator" in err, err
    finally:
        assert await broker.stop() == 0


async def test_hash_token_output_works_end_to_end(tmp_path: Path) -> None:
    creds = tmp_path / "dan.creds"
    code, entry, err = await run_cli(
        "hash-token", "--user", "dan", "--out", str(creds), stdin=b"dans-token\n"
    )
    assert code == 0, err
    config = tmp_path / "broker.toml"
    write_private(config, (broker_key(tmp_path, "b1").settings + entry).encode())
    code, line, err = await run_cli("hash-token", "--generate")
    assert code == 0, err
    assert line.startswith('token_hash = "scrypt:')
    assert err.startswith('token = "')
    broker = await start_broker("--config", str(config))
    try:  # with the credentials file hash-token wrote
        async with await meshbus.connect(broker.address, server="dan", credentials=creds) as conn:
            await conn.ping()
    finally:
        assert await broker.stop() == 0
