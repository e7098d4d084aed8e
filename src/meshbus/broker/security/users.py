"""The users a broker knows, and checking that a link's AUTH proves one of them.

A plain table, read from the ``[[users]]`` of the broker's config file
(``meshbus broker --config``): each user has a name and exactly one credential, an
Ed25519 public key or a token's stored key (meshbus.auth has their text forms), and what it
may do (its permissions). The config's ``[[brokers]]`` -- the brokers of the mesh,
each a name and a public key, and nothing else -- are a table of this kind too
(meshbus.broker.security.trust checks their proofs with it).

A check never tells a caller more than yes or no, and costs the same whether the
user exists or not (a decoy key stands in for a missing one), so
neither the answer nor its timing says who exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from meshbus.auth import TokenKey, check_user_name, password_matches, public_key_from_text
from meshbus.broker.security.permissions import BadPermissions, Permissions
from meshbus.broker.security.quotas import BadQuotas, Quotas
from meshbus.errors import InvalidArgument
from meshbus.protocol.control import TOKEN_PROOF_SIZE


@dataclass(frozen=True)
class User:
    """One user: ``name`` and exactly one of ``public_key``, ``token_hash`` and
    ``certificate`` (the common name of the client certificate that proves the user,
    under mutual TLS)."""

    name: str
    public_key: Ed25519PublicKey | None = None
    token_hash: TokenKey | None = None
    certificate: str | None = None
    # What the user may do (its [users.permissions] table); None: nothing.
    permissions: Permissions | None = None
    # How much it may hold on the broker (its [users.quotas] table; meshbus.broker.security.quotas).
    quotas: Quotas = field(default_factory=Quotas)


def same_credential(a: User, b: User) -> bool:
    """Whether ``a`` and ``b`` are proved by the same credential (a reload keeps the links
    of a user whose credential did not change)."""

    def raw(key: Ed25519PublicKey | None) -> bytes | None:
        return None if key is None else key.public_bytes_raw()

    return (raw(a.public_key), a.token_hash, a.certificate) == (
        raw(b.public_key),
        b.token_hash,
        b.certificate,
    )


class EntryError(InvalidArgument):
    """What is wrong with one entry of a config file's ``[[users]]`` or ``[[brokers]]``. The
    message names the file and the entry; ``key`` says where it is in the file, as a path
    of TOML keys whose arrays of tables count from 1 (``users[2].permissions.send``: the
    send key of the second [[users]]), for meshbus.broker.config_lines to find its line."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class BadEntries(InvalidArgument):
    """Every bad entry of a ``[[users]]`` or ``[[brokers]]`` array (``errors``, in file
    order); the message is the first one's."""

    def __init__(self, errors: list[EntryError]) -> None:
        super().__init__(str(errors[0]))
        self.errors = errors


class UserTable:
    def __init__(self, users: Iterable[User] = ()) -> None:
        self._users: dict[str, User] = {}
        for user in users:
            if user.name in self._users:
                raise ValueError(f"two users are named {user.name!r}")
            self._users[user.name] = user

    def __bool__(self) -> bool:
        return bool(self._users)

    def __iter__(self) -> Iterator[User]:
        return iter(self._users.values())

    def get(self, name: str) -> User | None:
        return self._users.get(name)

    def by_certificate(self, common_name: str) -> User | None:
        """The user whose ``certificate`` is ``common_name``: the subject of a client
        certificate the link's TLS handshake verified against the broker's CA."""
        return self._by_certificate.get(common_name)

    @cached_property
    def _by_certificate(self) -> dict[str, User]:
        return {u.certificate: u for u in self._users.values() if u.certificate is not None}

    def by_public_key(self, raw: bytes) -> User | None:
        """The user whose key pair has the 32-byte public key ``raw`` (a NATS client
        names itself by its nkey, not by a user name)."""
        return self._by_public_key.get(raw)

    @cached_property
    def _by_public_key(self) -> dict[bytes, User]:
        return {
            u.public_key.public_bytes_raw(): u
            for u in self._users.values()
            if u.public_key is not None
        }

    def check_password(self, name: str, token: str) -> User | None:
        """The token user ``name`` if ``token`` is its token (a NATS client sends the
        token itself), else None. Slow on purpose, one scrypt (about 10 ms), whether the
        user exists or not: call it in a worker thread."""
        user = self._users.get(name)
        stored = user.token_hash if user is not None else None
        proved = password_matches(stored or self._decoy_token, name, token)
        return user if proved and stored is not None else None

    def check_key_signature(self, raw: bytes, signed: bytes, signature: bytes) -> User | None:
        """The user whose public key is ``raw`` if ``signature`` is its signature of
        ``signed``, else None (about 0.1 ms; a decoy key stands in for a missing user)."""
        user = self.by_public_key(raw)
        key = user.public_key if user is not None else None
        try:
            (key or self._decoy_key).verify(signature, signed)
        except InvalidSignature:
            return None
        return user

    def check_signature(self, name: str, signed: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is ``name``'s signature of ``signed`` (about 0.1 ms: fine
        on the event loop)."""
        user = self._users.get(name)
        key = user.public_key if user is not None else None
        try:
            (key or self._decoy_key).verify(signature, signed)
        except InvalidSignature:
            return False
        return key is not None

    def check_token(self, name: str, signed: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is ``name``'s token's proof of ``signed`` (two HMACs and a
        SHA-256: fine on the event loop)."""
        user = self._users.get(name)
        stored = user.token_hash if user is not None else None
        proved = (stored or self._decoy_token).proves(signed, proof)
        return proved and stored is not None

    @cached_property
    def _decoy_key(self) -> Ed25519PublicKey:
        return Ed25519PrivateKey.generate().public_key()

    @cached_property
    def _decoy_token(self) -> TokenKey:
        return TokenKey(bytes(TOKEN_PROOF_SIZE))

    @classmethod
    def from_config(cls, entries: object, source: str) -> UserTable:
        """The table of a config file's ``[[users]]`` (``source`` names the file).
        BadEntries lists every bad entry, each naming the file and the user: a bad key or
        hash, two users with one name, both credentials or neither, an unknown field, bad
        permissions or quotas."""
        return cls(_entries(entries, source, _USERS, _user_from_entry))

    @classmethod
    def brokers_from_config(cls, entries: object, source: str) -> UserTable:
        """The table of a config file's ``[[brokers]]``: each a ``name`` and a
        ``public_key``, nothing else (a broker proves itself with its key pair only).
        BadEntries lists every bad entry, as ``from_config`` does."""
        return cls(_entries(entries, source, _BROKERS, _broker_from_entry))

    def same_as(self, other: UserTable) -> bool:
        """Whether both tables have the same names, each with the same credential."""
        return self._users.keys() == other._users.keys() and all(
            same_credential(user, other._users[user.name]) for user in self
        )


_USERS, _BROKERS = "users", "brokers"


def _entries(
    entries: object,
    source: str,
    section: str,
    read: Callable[[object, str, int], User],
) -> list[User]:
    """Every entry of the array of tables ``section``, read by ``read``; BadEntries with
    all that is wrong (each entry is checked on its own, and its first fault reported)."""
    if not isinstance(entries, list):
        message = f"{source}: {section} is an array of tables, [[{section}]]"
        raise BadEntries([EntryError(message, section)])
    read_ones: list[User] = []
    errors: list[EntryError] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries, 1):
        try:
            user = read(entry, source, index)
        except EntryError as exc:
            errors.append(exc)
            continue
        if user.name in seen:
            message = f"{source}: two {section} are named {user.name!r}; names are unique"
            errors.append(EntryError(message, f"{section}[{index}].name"))
        seen.add(user.name)
        read_ones.append(user)
    if errors:
        raise BadEntries(errors)
    return read_ones


_FIELDS = frozenset({"name", "public_key", "token_hash", "certificate", "permissions", "quotas"})
_CREDENTIALS = ("public_key", "token_hash", "certificate")


def _named_entry(
    entry: object, source: str, section: str, index: int
) -> tuple[Mapping[str, Any], str]:
    """An entry of ``[[section]]`` and its name, checked as a user name is."""
    where = f"{source}: [[{section}]] number {index}"
    key = f"{section}[{index}]"
    if not isinstance(entry, Mapping):
        raise EntryError(f"{where} is not a table", key)
    fields: Mapping[str, Any] = entry
    name = fields.get("name")
    if not isinstance(name, str):
        raise EntryError(f'{where} has no name (name = "...")', key)
    try:
        check_user_name(name)
    except ValueError as exc:
        raise EntryError(f"{where}: {exc}", f"{key}.name") from None
    return fields, name


def _user_from_entry(entry: object, source: str, index: int) -> User:
    fields, name = _named_entry(entry, source, _USERS, index)
    where = f"{source}: user {name!r}"
    key = f"{_USERS}[{index}]"
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise EntryError(
            f"{where} has unknown field {unknown[0]!r} (a user has name, public_key, "
            "token_hash or certificate, and permissions and quotas)",
            f"{key}.{unknown[0]}",
        )
    given = [field for field in _CREDENTIALS if field in fields]
    if len(given) != 1:
        raise EntryError(
            f"{where} needs exactly one of public_key (meshbus keygen prints it), "
            "token_hash (meshbus hash-token) and certificate (a client certificate's "
            f"common name); it has {' and '.join(given) if given else 'none'}",
            key if not given else f"{key}.{given[1]}",
        )
    (credential,) = given
    text = fields[credential]
    try:
        permissions = Permissions.from_table(fields.get("permissions", {}), name)
        quotas = Quotas.from_table(fields.get("quotas", {}), name)
    except (BadPermissions, BadQuotas) as exc:
        raise EntryError(f"{source}: {exc}", f"{key}.{exc.key}") from None
    try:
        if not isinstance(text, str):
            raise ValueError(f"{credential} is a string")
        if credential == "public_key":
            user = User(name, public_key=public_key_from_text(text))
        elif credential == "token_hash":
            user = User(name, token_hash=TokenKey.parse(text))
        elif not text:
            raise ValueError("certificate is the common name (CN) of the user's certificate")
        else:
            user = User(name, certificate=text)
    except ValueError as exc:
        raise EntryError(f"{where}: {exc}", f"{key}.{credential}") from None
    return replace(user, permissions=permissions, quotas=quotas)


def _broker_from_entry(entry: object, source: str, index: int) -> User:
    fields, name = _named_entry(entry, source, _BROKERS, index)
    where = f"{source}: broker {name!r}"
    key = f"{_BROKERS}[{index}]"
    if set(fields) != {"name", "public_key"}:
        raise EntryError(
            f"{where} has exactly a name and a public_key (meshbus keygen --user "
            f"{name} prints it); it has {', '.join(sorted(fields))}",
            key,
        )
    text = fields["public_key"]
    try:
        if not isinstance(text, str):
            raise ValueError("public_key is a string")
        return User(name, public_key=public_key_from_text(text))
    except ValueError as exc:
        raise EntryError(f"{where}: {exc}", f"{key}.public_key") from None
