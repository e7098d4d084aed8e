"""The mesh trusts only its brokers, with real broker processes: brokers with keys link,
carry messages and re-link after a kill -9; a raw link that says it is a broker gets a
CHALLENGE and an ERROR, never the mesh; a broker the mesh does not list, or one that does
not prove itself, is not linked to; and a signed-in connector's session is its user's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import Credentials, users_entry
from meshbus.protocol import ControlFrame, ControlType, ErrorCode, encode_control
from meshbus.protocol.control import (
    NONCE_SIZE,
    ROLE_BROKER,
    AddressBody,
    Challenge,
    Error,
    Hello,
    Register,
    Welcome,
)
from meshbus.protocol.handshake import sign_in_message
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import (
    BrokerKey,
    RawLink,
    assert_next_is,
    broker_key,
    launch_broker,
    start_broker_process,
    stat,
    wait_until,
)
from tests.integration.test_auth import run_cli

FAST = ("--heartbeat-interval", "0.2")


@dataclass
class TrustedMesh:
    brokers: list[BrokerProcess]
    keys: list[BrokerKey]
    config: Path


def trusting_config(directory: Path, keys: list[BrokerKey], extra: str = "") -> Path:
    config = directory / "mesh.toml"
    config.write_text(extra + "".join(key.entry for key in keys))
    return config


@pytest.fixture
async def trusted3(tmp_path: Path) -> AsyncIterator[TrustedMesh]:
    keys = [broker_key(tmp_path, name) for name in ("a", "b", "c")]
    config = trusting_config(tmp_path, keys)
    first = await start_broker("--config", str(config), *keys[0].args, *FAST)
    rest = await asyncio.gather(
        *(
            start_broker("--config", str(config), *key.args, "--seed", first.address, *FAST)
            for key in keys[1:]
        )
    )
    brokers = [first, *rest]
    try:
        yield TrustedMesh(brokers, keys, config)
    finally:
        codes = await stop_all(brokers)
        assert all(code in (0, -9) for code in codes), codes


async def linked_to_all(brokers: list[BrokerProcess]) -> bool:
    names = {b.name for b in brokers}
    for broker in brokers:
        if set((await stat(broker, detail=False))["peers"]) != names - {broker.name}:
            return False
    return True


async def test_brokers_with_keys_form_a_mesh_carry_messages_and_relink_after_a_kill(
    trusted3: TrustedMesh,
) -> None:
    a, b, c = trusted3.brokers
    assert await linked_to_all(trusted3.brokers)
    assert (await stat(a, detail=False))["mesh_trust"] is True
    async with (
        await meshbus.connect(a.address, server="s", failover=False) as on_a,
        await meshbus.connect(c.address, server="r", failover=False) as on_c,
    ):
        sender, receiver = await on_a.register(), await on_c.register()
        await sender.send(receiver.address, b"across")
        await assert_next_is(receiver, b"across")

        b.process.kill()  # kill -9
        await b.process.wait()
        restarted = await launch_broker(
            "--config", str(trusted3.config), *trusted3.keys[1].args, *FAST, listen=b.address
        )
        trusted3.brokers[1] = restarted
        await wait_until(lambda: linked_to_all(trusted3.brokers), "the restarted broker linked")
        async with await meshbus.connect(restarted.address, server="m", failover=False) as on_b:
            middle = await on_b.register()
            await sender.send(middle.address, b"to the restarted one")
            await assert_next_is(middle, b"to the restarted one")


async def test_an_unproven_broker_hello_gets_a_challenge_then_an_error_and_the_link_stays(
    trusted3: TrustedMesh,
) -> None:
    a, b, _ = trusted3.brokers
    before = {p["name"]: p["link_id"] for p in (await stat(a, detail=False))["peer_links"]}
    # Without a nonce: refused at once.
    bare = await RawLink.open(a.address)
    await bare.send(encode_control(ControlType.HELLO, Hello(role=ROLE_BROKER, name="b"), 1))
    (refusal,) = await bare.read_until_closed()
    assert isinstance(refusal, ControlFrame)
    assert isinstance(refusal.body, Error)
    assert refusal.body.code == ErrorCode.AUTH_FAILED
    await bare.close()
    # In b's name, with a nonce and another key: a CHALLENGE, then only the refusal.
    impostor = await RawLink.open(a.address)
    hello = Hello(role=ROLE_BROKER, name="b", nonce=os.urandom(NONCE_SIZE), listen=b.address)
    await impostor.send(encode_control(ControlType.HELLO, hello, 1))
    challenge = await impostor.read_control()
    assert isinstance(challenge.body, Challenge), challenge
    assert challenge.body.broker == "a"
    forged = Credentials.generate("b").answer(sign_in_message(challenge.body.nonce))
    await impostor.send(encode_control(ControlType.AUTH, forged, 1))
    (error,) = await impostor.read_until_closed()  # no WELCOME, ROUTES, BROKERS or READY
    assert isinstance(error, ControlFrame)
    assert isinstance(error.body, Error)
    assert error.body.code == ErrorCode.AUTH_FAILED
    await impostor.close()
    # The real link to b is the one it was, and carries traffic.
    after = {p["name"]: p["link_id"] for p in (await stat(a, detail=False))["peer_links"]}
    assert after == before
    async with (
        await meshbus.connect(a.address, server="s", failover=False) as on_a,
        await meshbus.connect(b.address, server="r", failover=False) as on_b,
    ):
        sender, receiver = await on_a.register(), await on_b.register()
        await sender.send(receiver.address, b"still linked")
        await assert_next_is(receiver, b"still linked")


async def joining(*args: str) -> tuple[int | None, str]:
    """A broker that must not start: its exit code and its stderr."""
    process = await start_broker_process("--listen", "127.0.0.1:0", *args)
    _, err = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, err.decode()


async def test_a_broker_whose_key_the_mesh_does_not_list_cannot_join(
    trusted3: TrustedMesh, tmp_path: Path
) -> None:
    a = trusted3.brokers[0]
    stranger = broker_key(tmp_path, "d")
    # Its own config lists the mesh and itself; the mesh's does not list it.
    config = tmp_path / "d.toml"
    config.write_text("".join(key.entry for key in [*trusted3.keys, stranger]))
    code, err = await joining("--config", str(config), *stranger.args, "--seed", a.address)
    assert code == 1, err
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("Error: could not join the mesh:"), err
    assert "'d' did not prove itself with a key" in line
    assert "Traceback" not in err
    assert await linked_to_all(trusted3.brokers)  # the mesh unchanged


async def test_a_trusting_broker_does_not_link_to_one_that_does_not_prove_itself(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    key = broker_key(tmp_path, "t")
    config = trusting_config(tmp_path, [key])
    code, err = await joining("--config", str(config), *key.args, "--seed", broker.address)
    assert code == 1, err
    assert "without proving itself" in err
    assert "Traceback" not in err
    assert (await stat(broker, detail=False))["peers"] == []


async def test_a_broker_with_users_and_no_brokers_refuses_a_peer(tmp_path: Path) -> None:
    """A broker on its own with users needs no key of its own (it proves itself to
    nobody), takes no peer, and cannot be given a seed to join."""
    alice = Credentials.generate("alice")
    config = tmp_path / "users.toml"
    config.write_text(users_entry("alice", public_key=alice.public_key, allow_all=True))
    with_users = await start_broker("--config", str(config))
    try:
        code, err = await joining("--seed", with_users.address)
        assert code == 1, err
        assert "lists no [[brokers]]" in err
        code, err = await joining("--config", str(config), "--seed", with_users.address)
        assert code == 1, err
        assert "has [[users]] and --seed, but its config lists no [[brokers]]" in err
        assert "Traceback" not in err
        async with await meshbus.connect(
            with_users.address, operator=True, credentials=alice
        ) as op:
            data = await op.stat()
        assert data["peers"] == []
        assert data["mesh_trust"] is True
    finally:
        assert await with_users.stop() == 0


@pytest.mark.parametrize(
    ("flags", "expected", "exit_code"),
    [
        ((), "give it --name and --broker-key FILE", 2),
        (("--name", "u"), "give it --name and --broker-key FILE", 2),
        (("--name", "other", "--broker-key", "{key}"), "give --name u", 1),
    ],
    ids=["no-key", "no-key-with-name", "key-of-another-name"],
)
async def test_a_broker_whose_config_lists_brokers_needs_a_name_and_its_key_at_start(
    tmp_path: Path, flags: tuple[str, ...], expected: str, exit_code: int
) -> None:
    key = broker_key(tmp_path, "u")
    config = tmp_path / "brokers.toml"
    config.write_text(key.entry)
    args = [flag.format(key=key.path) for flag in flags]
    code, err = await joining("--config", str(config), *args)
    assert code == exit_code, err
    assert expected in err
    assert "Traceback" not in err


# -- sessions are their users' -------------------------------------------------------------


async def sign_in(address: str, who: Credentials, session: bytes) -> RawLink:
    link = await RawLink.open(address)
    await link.send(encode_control(ControlType.HELLO, Hello(name=who.user, session=session), 1))
    challenge = await link.read_control()
    assert isinstance(challenge.body, Challenge), challenge
    auth = who.answer(sign_in_message(challenge.body.nonce))
    await link.send(encode_control(ControlType.AUTH, auth, 1))
    welcome = await link.read_control()
    assert isinstance(welcome.body, Welcome), welcome
    return link


async def test_another_user_replaying_a_session_cannot_take_its_fixed_address(
    tmp_path: Path,
) -> None:
    alice, mallory = Credentials.generate("alice"), Credentials.generate("mallory")
    key = broker_key(tmp_path, "u")
    config = tmp_path / "users.toml"
    config.write_text(
        users_entry("alice", public_key=alice.public_key, allow_all=True)
        + users_entry("mallory", public_key=mallory.public_key, allow_all=True)
    )
    broker = await start_broker("--config", str(config), *key.args)
    session = os.urandom(16)
    try:
        owner = await sign_in(broker.address, alice, session)
        await owner.register("login", 1)
        thief = await sign_in(broker.address, mallory, session)
        await thief.send(
            encode_control(ControlType.REGISTER, Register(server="login", instance=1), 9)
        )
        answer = await thief.read_control()
        assert isinstance(answer.body, Error), answer
        assert answer.body.code == ErrorCode.ADDRESS_IN_USE
        # Alice's own failover with the same session takes it back, as before.
        again = await sign_in(broker.address, alice, session)
        await again.send(
            encode_control(ControlType.REGISTER, Register(server="login", instance=1), 9)
        )
        taken = await again.read_control()
        assert isinstance(taken.body, AddressBody), taken
        for link in (owner, thief, again):
            await link.close()
    finally:
        assert await broker.stop() == 0


async def test_keygen_broker_output_makes_a_mesh(tmp_path: Path) -> None:
    """``meshbus keygen --broker``: the key file is a --broker-key, and what it prints is
    the [[brokers]] entry."""
    entries = []
    for name in ("k1", "k2"):
        code, entry, err = await run_cli(
            "keygen", "--broker", "--user", name, "--out", str(tmp_path / f"{name}.key")
        )
        assert code == 0, err
        assert entry.startswith("[[brokers]]\n")
        entries.append(entry)
    config = tmp_path / "mesh.toml"
    config.write_text("".join(entries))

    def flags(name: str) -> tuple[str, ...]:
        key = str(tmp_path / f"{name}.key")
        return ("--config", str(config), "--name", name, "--broker-key", key)

    first = await start_broker(*flags("k1"))
    brokers = [first]
    try:
        brokers.append(await start_broker(*flags("k2"), "--seed", first.address))
        assert (await stat(first, detail=False))["peers"] == ["k2"]
    finally:
        assert await stop_all(brokers) == [0, 0]
