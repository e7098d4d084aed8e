"""Credentials, token hashes and the broker's user table: signing, checking, and every
way a credentials file or a config's [[users]] can be wrong."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import meshbus
from meshbus.auth import (
    TOKEN_N,
    Credentials,
    TokenHash,
    TokenKey,
    decode_key,
    encode_key,
    public_key_from_text,
    resolve_credentials,
    users_entry,
)
from meshbus.broker.security.users import User, UserTable
from meshbus.protocol.control import NONCE_SIZE
from meshbus.protocol.handshake import SIGN_IN_CONTEXT, sign_in_message

NONCE = bytes(range(NONCE_SIZE))
SIGNED = sign_in_message(NONCE)


def table(*users: User) -> UserTable:
    return UserTable(users)


def key_user(name: str, credentials: Credentials) -> User:
    assert credentials.public_key is not None
    return User(name, public_key=public_key_from_text(credentials.public_key))


# -- key pairs ------------------------------------------------------------------------------


def test_a_signature_of_the_users_key_passes_and_nothing_else_does() -> None:
    alice = Credentials.generate("alice")
    mallory = Credentials.generate("alice")  # the right name, another key
    users = table(key_user("alice", alice))
    good = alice.answer(SIGNED)
    assert (good.user, good.token_proof, len(good.signature)) == ("alice", b"", 64)
    assert users.check_signature("alice", SIGNED, good.signature)
    assert not users.check_signature("alice", SIGNED, mallory.answer(SIGNED).signature)
    # Bound to the nonce and to the purpose: another nonce, or the bare nonce, fails.
    assert not users.check_signature("alice", sign_in_message(bytes(NONCE_SIZE)), good.signature)
    assert not users.check_signature("alice", SIGNED, alice.answer(NONCE).signature)
    assert SIGNED.startswith(SIGN_IN_CONTEXT)


def test_an_unknown_user_fails_even_with_a_valid_signature() -> None:
    alice = Credentials.generate("alice")
    users = table(key_user("alice", alice))
    assert not users.check_signature("bob", SIGNED, alice.answer(SIGNED).signature)


def test_a_token_user_never_passes_with_a_signature() -> None:
    alice = Credentials.generate("alice")
    users = table(User("alice", token_hash=TokenKey.of("alice", "secret")))
    assert not users.check_signature("alice", SIGNED, alice.answer(SIGNED).signature)


def test_keys_round_trip_through_their_text() -> None:
    raw = bytes(range(32))
    assert decode_key(encode_key(raw)) == raw
    for bad, why in [
        ("rsa:AAAA", "ed25519:"),
        ("ed25519:not base64!", "base64"),
        ("ed25519:" + encode_key(bytes(31))[8:], "32 bytes"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_key(bad)


# -- tokens ---------------------------------------------------------------------------------


def test_a_token_hash_matches_its_token_only_and_round_trips() -> None:
    stored = TokenHash.of("s3cret")
    text = str(stored)
    assert text.startswith(f"scrypt:{TOKEN_N}:8:1:")
    assert TokenHash.parse(text) == stored
    assert stored.matches("s3cret")
    assert not stored.matches("s3cret ")
    assert TokenHash.of("s3cret").salt != stored.salt  # a salt per hash


def test_token_checks_by_user() -> None:
    users = table(User("bob", token_hash=TokenKey.of("bob", "t0k3n")))
    bob = Credentials("bob", token="t0k3n")
    proof = bob.answer(SIGNED).token_proof
    assert users.check_token("bob", SIGNED, proof)
    assert not users.check_token(
        "bob", SIGNED, Credentials("bob", token="wrong").answer(SIGNED).token_proof
    )
    assert not users.check_token("eve", SIGNED, proof)
    # The token's key is salted with its user's name: eve's proof of bob's token fails.
    eve = Credentials("eve", token="t0k3n").answer(SIGNED).token_proof
    assert not users.check_token("bob", SIGNED, eve)


def test_a_tokens_proof_is_bound_to_the_nonce_and_never_holds_the_token() -> None:
    """The replay of the issue: a proof recorded for one CHALLENGE is worthless on a link
    with another nonce, and nothing of the token crosses the wire."""
    users = table(User("bob", token_hash=TokenKey.of("bob", "t0k3n")))
    auth = Credentials("bob", token="t0k3n").answer(SIGNED)
    other = sign_in_message(bytes(NONCE_SIZE))
    assert users.check_token("bob", SIGNED, auth.token_proof)
    assert not users.check_token("bob", other, auth.token_proof)
    assert b"t0k3n" not in auth.token_proof
    assert len(auth.token_proof) == 32


def test_the_stored_key_makes_no_proof() -> None:
    """A copy of the broker's config lets nobody sign in: the stored key is a digest of
    the key a proof needs."""
    stored = TokenKey.of("bob", "t0k3n")
    users = table(User("bob", token_hash=stored))
    from meshbus.auth import token_proof

    assert not users.check_token("bob", SIGNED, token_proof(stored.stored, SIGNED))
    assert TokenKey.parse(str(stored)) == stored
    assert str(stored).startswith("token-v2:")


def test_a_key_user_never_passes_with_a_token() -> None:
    users = table(key_user("alice", Credentials.generate("alice")))
    assert not users.check_token("alice", SIGNED, bytes(32))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (f"scrypt:{TOKEN_N}:8:1:AA==:AA==", "older meshbus.*meshbus hash-token --user NAME"),
        ("nope", "token-v2:<base64>"),
        ("token-v2:!!", "base64"),
        ("token-v2:AAAA", "32 bytes"),
    ],
)
def test_a_bad_token_key_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TokenKey.parse(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("bcrypt:1:2:3:AA==:AA==", "scrypt:N:r:p"),
        ("scrypt:4096:8:1:AA==", "scrypt:N:r:p"),
        ("scrypt:x:8:1:AA==:AA==", "integers"),
        ("scrypt:1000:8:1:AA==:AA==", "power of 2"),
        (f"scrypt:{2**20}:8:1:AA==:AA==", "power of 2"),
        ("scrypt:4096:0:1:AA==:AA==", "r is"),
        ("scrypt:4096:8:99:AA==:AA==", "r is"),
        ("scrypt:4096:8:1:!!:AA==", "base64"),
        ("scrypt:4096:8:1:AA==:AA==", "32-byte hash"),
    ],
)
def test_a_bad_token_hash_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TokenHash.parse(text)


# -- credentials files ------------------------------------------------------------------------


def test_a_key_credentials_file_round_trips_with_mode_0600(tmp_path: Path) -> None:
    alice = Credentials.generate("alice")
    path = tmp_path / "alice.toml"
    alice.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Credentials.load(path)
    assert (loaded.user, loaded.public_key) == ("alice", alice.public_key)
    assert loaded.answer(SIGNED) == alice.answer(SIGNED)  # Ed25519 is deterministic
    with pytest.raises(FileExistsError):
        Credentials.generate("alice").write(path)
    assert Credentials.load(path).public_key == alice.public_key


def test_a_token_credentials_file(tmp_path: Path) -> None:
    path = tmp_path / "bob.toml"
    path.write_text('user = "bob"\ntoken = "t0k3n"\n')
    bob = Credentials.load(path)
    assert bob.public_key is None
    answer = bob.answer(SIGNED)
    assert (answer.user, answer.signature) == ("bob", b"")
    assert table(User("bob", token_hash=TokenKey.of("bob", "t0k3n"))).check_token(
        "bob", SIGNED, answer.token_proof
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("user = ", "not valid TOML"),
        ('user = "a"\n', "exactly one of private_key and token"),
        ('user = "a"\ntoken = "t"\nprivate_key = "ed25519:AA=="\n', "exactly one"),
        ('user = "a"\npassword = "t"\n', "unknown key 'password'"),
        ('user = 5\ntoken = "t"\n', "all strings"),
        ('user = ""\ntoken = "t"\n', "1 to 128 characters"),
        ('user = "a"\nprivate_key = "ed25519:AAAA"\n', "32 bytes"),
    ],
)
def test_a_bad_credentials_file_names_the_file_and_the_fault(
    tmp_path: Path, text: str, why: str
) -> None:
    path = tmp_path / "creds.toml"
    path.write_text(text)
    with pytest.raises(meshbus.InvalidArgument, match=why) as raised:
        Credentials.load(path)
    assert str(path) in str(raised.value)


def test_a_missing_credentials_file_is_an_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(meshbus.InvalidArgument, match="cannot read the credentials file"):
        Credentials.load(tmp_path / "nope.toml")


def test_meshbus_creds_is_used_when_no_credentials_are_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.toml"
    Credentials.generate("carol").write(path)
    monkeypatch.delenv("MESHBUS_CREDS", raising=False)
    assert resolve_credentials(None) is None
    monkeypatch.setenv("MESHBUS_CREDS", os.fspath(path))
    resolved = resolve_credentials(None)
    assert resolved is not None
    assert resolved.user == "carol"
    given = Credentials("dave", token="t")
    assert resolve_credentials(given) is given  # an explicit one wins


# -- the config's [[users]] ---------------------------------------------------------------------


def test_users_from_a_config() -> None:
    alice = Credentials.generate("alice")
    entries = [
        {"name": "alice", "public_key": alice.public_key},
        {"name": "bob", "token_hash": str(TokenKey.of("bob", "t"))},
    ]
    users = UserTable.from_config(entries, "broker.toml")
    assert [u.name for u in users] == ["alice", "bob"]
    assert users.check_signature("alice", SIGNED, alice.answer(SIGNED).signature)


def test_the_entry_keygen_prints_is_one_the_broker_reads() -> None:
    import tomllib

    alice = Credentials.generate("alice")
    entry = tomllib.loads(users_entry("alice", public_key=alice.public_key))
    users = UserTable.from_config(entry["users"], "pasted")
    assert users.check_signature("alice", SIGNED, alice.answer(SIGNED).signature)


@pytest.mark.parametrize(
    ("entries", "why"),
    [
        ([{"name": "a", "public_key": "ed25519:AAAA"}], "user 'a': an Ed25519 key is 32 bytes"),
        ([{"name": "a", "token_hash": "nope"}], "user 'a': a token hash is written"),
        ([{"name": "a"}], "user 'a' needs exactly one of public_key .* none"),
        (
            [{"name": "a", "public_key": "x", "token_hash": "y"}],
            "user 'a' needs exactly one of public_key .* has public_key and token_hash",
        ),
        (
            [{"name": "a", "token_hash": "T"}, {"name": "a", "token_hash": "T"}],
            "two users are named 'a'",
        ),
        ([{"name": "a", "token_hash": "T", "role": "admin"}], "user 'a' has unknown field 'role'"),
        ([{"name": "a", "certificate": ""}], "user 'a': certificate is the common name"),
        ([{"public_key": "x"}], r"\[\[users\]\] number 1 has no name"),
        (["a"], r"\[\[users\]\] number 1 is not a table"),
        ({"name": "a"}, r"users is an array of tables"),
    ],
)
def test_a_bad_users_entry_names_the_file_and_the_user(entries: object, why: str) -> None:
    token_hash = str(TokenKey.of("a", "t"))
    if isinstance(entries, list):
        entries = [
            {k: (token_hash if v == "T" else v) for k, v in e.items()} if isinstance(e, dict) else e
            for e in entries
        ]
    with pytest.raises(meshbus.InvalidArgument, match=why) as raised:
        UserTable.from_config(entries, "/etc/meshbus/broker.toml")
    assert str(raised.value).startswith("/etc/meshbus/broker.toml: ")


@pytest.mark.parametrize(
    "key",
    [
        "x25519:c2VjcmV0IGtleSBtYXRlcmlhbCwgbmV2ZXIgcHJpbnRlZA==",  # another prefix
        "c2VjcmV0IGtleSBtYXRlcmlhbCwgbmV2ZXIgcHJpbnRlZA==",  # none
        "ed25519:c2VjcmV0IGtleSBtYXRlcmlhbCwgbmV2ZXIgcHJpbnRl!",  # not base64
        "ed25519:c2VjcmV0IGtleSBtYXRlcmlhbA==",  # too short
    ],
)
def test_a_malformed_private_key_is_never_printed(tmp_path: Path, key: str) -> None:
    """The error names the file and the fault, and holds no part of the key: a
    misspelt private key is still a private key."""
    path = tmp_path / "creds.toml"
    path.write_text(f'user = "a"\nprivate_key = "{key}"\n')
    with pytest.raises(meshbus.InvalidArgument) as raised:
        Credentials.load(path)
    message = str(raised.value).replace(str(path), "")
    secret = key.split(":")[-1]
    assert not any(secret[i : i + 5] in message for i in range(len(secret) - 4)), message


# -- NATS nkeys (docs/nats.md, "Signing in") --------------------------------------------------

# A seed of the bytes 0..31 and its public key, as the nkeys package writes them.
_NKEY_SEED = "SUAAAAICAMCAKBQHBAEQUCYMBUHA6EARCIJRIFIWC4MBSGQ3DQOR4H776Y"
_NKEY_PUBLIC = "UAB2CB576PHBBPQ5ODORRZ2LYCMWPZGWGCN2KDK7DXOIMZASKUY3RLKK"


def test_nkeys_are_the_nats_text_of_the_same_key_pair() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshbus.auth import nkey_public, nkey_public_raw, nkey_seed

    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    public = key.public_key().public_bytes_raw()
    assert nkey_seed(bytes(range(32))) == _NKEY_SEED
    assert nkey_public(public) == _NKEY_PUBLIC
    assert nkey_public_raw(_NKEY_PUBLIC) == public
    assert Credentials("a", private_key=key).nkey_seed == _NKEY_SEED
    assert Credentials("a", token="t").nkey_seed is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (_NKEY_PUBLIC[:-1], "56 characters"),
        ("S" + _NKEY_PUBLIC[1:], "not a user's"),
        (_NKEY_PUBLIC[:-2] + "A" + _NKEY_PUBLIC[-1], "checksum"),
        ("1" * 56, "base32"),
    ],
)
def test_an_nkey_that_is_not_a_users_is_refused(text: str, why: str) -> None:
    from meshbus.auth import nkey_public_raw

    with pytest.raises(ValueError, match=why):
        nkey_public_raw(text)
