"""Who a client is to a broker: key pairs, tokens, and the files that hold them.

docs/security.md ("Authentication") has the whole story. In short: a broker with
users answers HELLO with a CHALLENGE (a fresh nonce); the client answers with AUTH
-- its user name and either an Ed25519 signature of the sign-in context and the
nonce (a key pair: the private key never leaves the client) or a bearer token
(for development): never the token itself, but a proof bound to the nonce, so a
recorded sign-in is worthless on another link (``TokenKey``; the broker keeps a digest
of a key derived from the token, from which no proof can be made).

Both ends use this module: ``Credentials`` (public, ``meshbus.Credentials``) is the
client's side, and the text forms -- ``ed25519:<base64>`` keys and
``token-v2:<base64>`` token keys -- are what the broker's config file
(meshbus.broker.security.users) and ``meshbus keygen`` / ``meshbus hash-token`` read and write.
``scrypt:N:r:p:<salt>:<hash>`` token hashes are the monitor's (``--monitor-token-hash``):
over HTTP the token itself is sent.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from meshbus.errors import InvalidArgument
from meshbus.private_files import write_private
from meshbus.protocol.control import MAX_USER_NAME, TOKEN_PROOF_SIZE, Auth

KEY_PREFIX = "ed25519:"
_KEY_SIZE = 32  # an Ed25519 key, public or private, as raw bytes

# scrypt for stored tokens: N = 2**12, r = 8, p = 1 costs about 10 ms and 4 MiB per check
# (2 cores, 2026). The broker checks tokens in a worker thread (hashlib.scrypt lets go of
# the GIL), never on its event loop. A hash may name other parameters; these bounds keep
# a config file from making one check take seconds or gigabytes.
SCRYPT = "scrypt"
TOKEN_N = 2**12
TOKEN_R = 8
TOKEN_P = 1
_MAX_N = 2**16
_MAX_R = 32
_MAX_P = 16
_SCRYPT_MAXMEM = 256 * 1024 * 1024
_SALT_SIZE = 16
_HASH_SIZE = 32
# A generated token: 32 random bytes, URL-safe text.
_TOKEN_BYTES = 32
MAX_TOKEN = 1024

# Where ``meshbus.connect`` and the CLI look for a credentials file when given none.
CREDS_ENV = "MESHBUS_CREDS"


def encode_key(raw: bytes) -> str:
    """``ed25519:<base64 of the 32 raw bytes>``."""
    return KEY_PREFIX + base64.b64encode(raw).decode("ascii")


def decode_key(text: str) -> bytes:
    """The 32 raw bytes of an ``ed25519:<base64>`` key; ValueError saying what is wrong."""
    if not text.startswith(KEY_PREFIX):
        # Never a character of it in the message: it may be a private key, misspelt.
        raise ValueError(
            f"a key is written {KEY_PREFIX}<base64 of 32 bytes>; this one does not start "
            f"with {KEY_PREFIX!r}"
        )
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"the key after {KEY_PREFIX!r} is not valid base64 ({exc})") from None
    if len(raw) != _KEY_SIZE:
        raise ValueError(f"an Ed25519 key is {_KEY_SIZE} bytes; this one is {len(raw)}")
    return raw


def public_key_from_text(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(decode_key(text))


def check_user_name(name: str) -> str:
    """``name`` if it can be a user's name (1..128 characters, no control characters);
    ValueError otherwise."""
    if not 1 <= len(name) <= MAX_USER_NAME:
        raise ValueError(f"a user name is 1 to {MAX_USER_NAME} characters; got {len(name)}")
    if not name.isprintable():
        raise ValueError(f"a user name has no control characters; got {name!r}")
    return name


def check_token(token: str) -> str:
    if not 1 <= len(token) <= MAX_TOKEN:
        raise ValueError(f"a token is 1 to {MAX_TOKEN} characters; got {len(token)}")
    return token


def new_token() -> str:
    """A strong random token (256 bits)."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


@dataclass(frozen=True)
class TokenHash:
    """A token as a broker stores it: ``scrypt:N:r:p:<salt b64>:<hash b64>``."""

    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @classmethod
    def of(cls, token: str) -> TokenHash:
        """The hash of ``token`` with a new random salt and this module's parameters."""
        salt = secrets.token_bytes(_SALT_SIZE)
        return cls(TOKEN_N, TOKEN_R, TOKEN_P, salt, _scrypt(token, salt, TOKEN_N, TOKEN_R, TOKEN_P))

    @classmethod
    def parse(cls, text: str) -> TokenHash:
        """ValueError saying which part of ``text`` is wrong."""
        parts = text.split(":")
        if len(parts) != 6 or parts[0] != SCRYPT:
            raise ValueError(
                "a token hash is written scrypt:N:r:p:<salt base64>:<hash base64> "
                "(meshbus hash-token prints one)"
            )
        try:
            n, r, p = (int(part) for part in parts[1:4])
        except ValueError:
            raise ValueError("the N, r and p of a token hash are integers") from None
        if not (2 <= n <= _MAX_N and n & (n - 1) == 0):
            raise ValueError(f"scrypt N is a power of 2 from 2 to {_MAX_N}; got {n}")
        if not (1 <= r <= _MAX_R and 1 <= p <= _MAX_P):
            raise ValueError(f"scrypt r is 1..{_MAX_R} and p 1..{_MAX_P}; got r={r}, p={p}")
        try:
            salt = base64.b64decode(parts[4], validate=True)
            digest = base64.b64decode(parts[5], validate=True)
        except binascii.Error:
            raise ValueError("the salt and hash of a token hash are base64") from None
        if not salt or len(digest) != _HASH_SIZE:
            raise ValueError(f"a token hash has a salt and a {_HASH_SIZE}-byte hash")
        return cls(n, r, p, salt, digest)

    def matches(self, token: str) -> bool:
        """Whether ``token`` hashes to this (in constant time). Slow on purpose: one
        scrypt, about 10 ms -- the broker calls it in a worker thread."""
        computed = _scrypt(token, self.salt, self.n, self.r, self.p)
        return hmac.compare_digest(computed, self.digest)

    def __str__(self) -> str:
        return f"{SCRYPT}:{self.n}:{self.r}:{self.p}:{_b64(self.salt)}:{_b64(self.digest)}"


# A user's token as a broker stores it (docs/security.md, "A token's proof"), after the
# SCRAM scheme (RFC 5802): from the token, salted with the user's name, scrypt makes a
# client key; the broker stores only its SHA-256 digest, the stored key. The client
# proves it knows the client key by sending it masked with an HMAC of the CHALLENGE's
# nonce keyed by the stored key: the broker unmasks it and checks its digest. A recording
# of one sign-in is of no use on a link with another nonce, and the stored key (a copy of
# the broker's config) makes no proof. The salt is the user's name, not a random one the
# client would have to be sent before it answers: the sign-in has one round trip.
TOKEN_KEY_PREFIX = "token-v2:"
_TOKEN_SALT = b"meshbus token v2\x00"
_CLIENT_KEY = b"meshbus client key"


def client_key(user: str, token: str) -> bytes:
    """The key a token user proves it holds: scrypt (about 10 ms, on the client only)."""
    salt = _TOKEN_SALT + user.encode("utf-8")
    salted = _scrypt(token, salt, TOKEN_N, TOKEN_R, TOKEN_P)
    return hmac.digest(salted, _CLIENT_KEY, "sha256")


def _mask(stored: bytes, signed: bytes) -> bytes:
    return hmac.digest(stored, signed, "sha256")


def token_proof(key: bytes, signed: bytes) -> bytes:
    """What a token user's AUTH carries for the CHALLENGE whose sign-in message is
    ``signed``: its client key, masked with an HMAC of ``signed``."""
    mask = _mask(hashlib.sha256(key).digest(), signed)
    return bytes(a ^ b for a, b in zip(key, mask, strict=True))


@dataclass(frozen=True)
class TokenKey:
    """A user's token as a broker stores it: ``token-v2:<base64 of the stored key>``."""

    stored: bytes

    @classmethod
    def of(cls, user: str, token: str) -> TokenKey:
        return cls(hashlib.sha256(client_key(user, token)).digest())

    @classmethod
    def parse(cls, text: str) -> TokenKey:
        """ValueError saying what is wrong with ``text``; an old ``scrypt:`` hash (whose
        sign-in sent the token itself) is told to be made again."""
        if text.startswith(SCRYPT + ":"):
            raise ValueError(
                "this token_hash is of an older meshbus, whose sign-in sent the token itself; "
                "hash the token again for this user: meshbus hash-token --user NAME (the "
                "token and the client's credentials file stay as they are)"
            )
        if not text.startswith(TOKEN_KEY_PREFIX):
            raise ValueError(
                f"a token hash is written {TOKEN_KEY_PREFIX}<base64> "
                "(meshbus hash-token --user NAME prints one)"
            )
        try:
            stored = base64.b64decode(text[len(TOKEN_KEY_PREFIX) :], validate=True)
        except binascii.Error:
            raise ValueError(f"the key after {TOKEN_KEY_PREFIX!r} is not valid base64") from None
        if len(stored) != TOKEN_PROOF_SIZE:
            raise ValueError(f"a token key is {TOKEN_PROOF_SIZE} bytes; this one is {len(stored)}")
        return cls(stored)

    def proves(self, signed: bytes, proof: bytes) -> bool:
        """Whether ``proof`` answers the CHALLENGE whose sign-in message is ``signed``
        (microseconds: fine on the event loop)."""
        if len(proof) != TOKEN_PROOF_SIZE:
            return False
        mask = _mask(self.stored, signed)
        key = bytes(a ^ b for a, b in zip(proof, mask, strict=True))
        return hmac.compare_digest(hashlib.sha256(key).digest(), self.stored)

    def __str__(self) -> str:
        return TOKEN_KEY_PREFIX + _b64(self.stored)


def password_matches(stored: TokenKey, user: str, token: str) -> bool:
    """Whether ``token`` is the token of ``user`` whose stored key is ``stored``: a NATS
    client's ``pass`` (or ``auth_token``) is the token itself, sent over the connection
    (docs/nats.md, "Signing in"). Slow on purpose, one scrypt (about 10 ms): the broker
    calls it in a worker thread, never on its event loop."""
    computed = hashlib.sha256(client_key(user, token)).digest()
    return hmac.compare_digest(computed, stored.stored)


# NATS nkeys (docs/nats.md, "Signing in"): an Ed25519 key in NATS's text form -- a prefix
# byte saying what the key is, the 32 raw bytes, a CRC-16/XMODEM of both (little
# endian), in base32 without padding. A user's public key starts with U, its seed
# (the private key) with SU. The same key pair signs a meshbus CHALLENGE and a NATS
# server's nonce.
_NKEY_USER = 20 << 3  # "U"
_NKEY_SEED = 18 << 3  # "S"
_NKEY_PUBLIC_SIZE = 1 + _KEY_SIZE + 2
_NKEY_PUBLIC_TEXT = 56  # base32 of 35 bytes, no padding


def _nkey_text(raw: bytes) -> str:
    crc = binascii.crc_hqx(raw, 0).to_bytes(2, "little")
    return base64.b32encode(raw + crc).decode("ascii").rstrip("=")


def nkey_public(raw: bytes) -> str:
    """The NATS user nkey (``U...``) of a 32-byte Ed25519 public key."""
    return _nkey_text(bytes([_NKEY_USER]) + raw)


def nkey_seed(raw: bytes) -> str:
    """The NATS user seed (``SU...``) of a 32-byte Ed25519 private key: what a NATS
    client signs with (nats.js ``nkeyAuthenticator``, nats.py ``nkeys_seed_str``)."""
    prefix = bytes([_NKEY_SEED | _NKEY_USER >> 5, (_NKEY_USER & 31) << 3])
    return _nkey_text(prefix + raw)


def nkey_public_raw(text: str) -> bytes:
    """The 32 raw bytes of a NATS user nkey (``U...``); ValueError saying what is wrong."""
    if len(text) != _NKEY_PUBLIC_TEXT:
        raise ValueError(f"a user nkey is {_NKEY_PUBLIC_TEXT} characters; got {len(text)}")
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except binascii.Error:
        raise ValueError("a user nkey is base32") from None
    if len(raw) != _NKEY_PUBLIC_SIZE or raw[0] != _NKEY_USER:
        raise ValueError("this nkey is not a user's (it does not start with U)")
    if binascii.crc_hqx(raw[:-2], 0).to_bytes(2, "little") != raw[-2:]:
        raise ValueError("the nkey's checksum is wrong")
    return raw[1:-2]


def _scrypt(token: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        token.encode("utf-8"), salt=salt, n=n, r=r, p=p, maxmem=_SCRYPT_MAXMEM, dklen=_HASH_SIZE
    )


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(text)


class Credentials:
    """Who a client is to a broker that has users: a user name and either a private key
    (recommended) or a token. ``meshbus.connect(credentials=...)`` and ``--creds`` take
    one (or the path of a credentials file, ``Credentials.load``).

    ``private_key`` is an ``Ed25519PrivateKey`` or its text ``ed25519:<base64>``; the key
    only signs the broker's challenge, and never leaves this process. ``token`` is a
    shared secret, for development (docs/security.md): it never leaves this process
    either, but a proof made from it and the broker's challenge does."""

    def __init__(
        self,
        user: str,
        *,
        private_key: Ed25519PrivateKey | str | None = None,
        token: str | None = None,
    ) -> None:
        try:
            self.user = check_user_name(user)
            if (private_key is None) == (token is None):
                raise ValueError("give exactly one of private_key and token")
            if isinstance(private_key, str):
                private_key = Ed25519PrivateKey.from_private_bytes(decode_key(private_key))
            self._key = private_key
            self._token = None if token is None else check_token(token)
            self._client_key: bytes | None = None
        except ValueError as exc:
            raise InvalidArgument(f"credentials for user {user!r}: {exc}") from None

    def __repr__(self) -> str:
        kind = "key" if self._key is not None else "token"
        return f"<Credentials {self.user!r} ({kind})>"

    @classmethod
    def generate(cls, user: str) -> Credentials:
        """A new key pair for ``user``."""
        return cls(user, private_key=Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Credentials:
        """Read a credentials file (TOML): ``user``, and ``private_key = "ed25519:..."``
        or ``token = "..."``. InvalidArgument names the file and what is wrong."""
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except OSError as exc:
            raise InvalidArgument(
                f"cannot read the credentials file {path}: {exc.strerror or exc}"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"the credentials file {path} is not valid TOML: {exc}") from None
        unknown = sorted(set(data) - {"user", "private_key", "token"})
        if unknown:
            raise InvalidArgument(
                f"the credentials file {path} has unknown key {unknown[0]!r} "
                "(it holds user, and private_key or token)"
            )
        user, key, token = data.get("user"), data.get("private_key"), data.get("token")
        if not isinstance(user, str) or not all(
            v is None or isinstance(v, str) for v in (key, token)
        ):
            raise InvalidArgument(
                f"the credentials file {path} holds user, and private_key or token, all strings"
            )
        try:
            return cls(user, private_key=key, token=token)
        except InvalidArgument as exc:
            raise InvalidArgument(f"the credentials file {path}: {exc}") from None

    @property
    def public_key(self) -> str | None:
        """``ed25519:<base64>`` of the public key (for the broker's config); None for a
        token."""
        if self._key is None:
            return None
        return encode_key(self._key.public_key().public_bytes_raw())

    @property
    def nkey_seed(self) -> str | None:
        """The private key as a NATS user seed (``SU...``), for a NATS client signing in
        to a broker's NATS listener with this user's key pair (docs/nats.md); None for a
        token."""
        if self._key is None:
            return None
        return nkey_seed(self._key.private_bytes_raw())

    def answer(self, to_sign: bytes) -> Auth:
        """The AUTH for a broker's CHALLENGE: ``to_sign`` signed, or the token's proof of
        it (the token's scrypt is done once, at the first sign-in)."""
        if self._key is not None:
            return Auth(user=self.user, signature=self._key.sign(to_sign))
        if self._client_key is None:
            assert self._token is not None
            self._client_key = client_key(self.user, self._token)
        return Auth(user=self.user, token_proof=token_proof(self._client_key, to_sign))

    def file_text(self) -> str:
        """The credentials file that ``load`` reads back (keep it private: mode 0600)."""
        lines = [f"user = {toml_string(self.user)}"]
        if self._key is not None:
            lines.append(f"private_key = {toml_string(encode_key(self._key.private_bytes_raw()))}")
        else:
            assert self._token is not None
            lines.append(f"token = {toml_string(self._token)}")
        return "\n".join(lines) + "\n"

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the credentials file, readable by its owner only (0600); refuses to
        overwrite a file (FileExistsError)."""
        write_private(path, self.file_text().encode("utf-8"))


# The permissions of a new [[users]] entry: each one spelled out, so the operator sees
# what there is to grant (docs/security.md, "Permissions"); ``streams.*`` are the keys of
# its inline table ``streams``.
_PERMISSIONS = {
    "register": 'server names, e.g. ["game*"]',
    "send": 'addresses, e.g. ["game*:*", "multicast:chat.*", "anycast:login"]',
    "request": "addresses, as send",
    "join": 'groups, e.g. ["multicast:chat.*"]',
    "streams.add": "",
    "streams.delete": "",
    "streams.read": "",
    "streams.consume": "",
    "operator": '"stat", "stat-detail", "drain", "telemetry", "consumers"',
}
PERMISSION_KEYS = tuple(_PERMISSIONS)


def users_entry(
    user: str,
    *,
    public_key: str | None = None,
    token_hash: str | None = None,
    allow_all: bool = False,
    allow: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The ``[[users]]`` table to paste into a broker's config file, with its permissions
    table: nothing granted (every permission an empty list, to fill in), with
    ``allow_all`` everything (for development), or what ``allow`` grants: patterns by
    permission (a key of PERMISSION_KEYS; ValueError for another)."""
    allow = allow or {}
    unknown = [key for key in allow if key not in _PERMISSIONS]
    if unknown:
        raise ValueError(
            f"unknown permission {unknown[0]!r}; the permissions are {', '.join(_PERMISSIONS)}"
        )

    def granted(key: str) -> str:
        patterns = ["*"] if allow_all else allow.get(key, ())
        return "[" + ", ".join(toml_string(pattern) for pattern in patterns) + "]"

    lines = ["[[users]]", f"name = {toml_string(user)}"]
    if public_key is not None:
        lines.append(f"public_key = {toml_string(public_key)}")
    if token_hash is not None:
        lines.append(f"token_hash = {toml_string(token_hash)}")
    lines.append("[users.permissions]  # what is not allowed here is denied")
    for key, what in _PERMISSIONS.items():
        if not key.startswith("streams."):
            lines.append(f"{key} = {granted(key)}  # {what}")
        elif key == "streams.add":
            operations = ", ".join(
                f"{k.removeprefix('streams.')} = {granted(k)}"
                for k in _PERMISSIONS
                if k.startswith("streams.")
            )
            lines.append(f"streams = {{ {operations} }}  # stream names")
    return "\n".join(lines) + "\n"


def brokers_entry(name: str, public_key: str) -> str:
    """The ``[[brokers]]`` table that lets broker ``name`` into a mesh that trusts only its
    brokers: its name and its public key, nothing else."""
    return f"[[brokers]]\nname = {toml_string(name)}\npublic_key = {toml_string(public_key)}\n"


def resolve_credentials(
    credentials: Credentials | str | os.PathLike[str] | None,
) -> Credentials | None:
    """What ``meshbus.connect`` signs in with: ``credentials`` (or the file it names), or
    the file ``MESHBUS_CREDS`` names when it is None; None when neither is given."""
    if credentials is None:
        path = os.environ.get(CREDS_ENV)
        if not path:
            return None
        credentials = Path(path)
    if isinstance(credentials, Credentials):
        return credentials
    return Credentials.load(credentials)
