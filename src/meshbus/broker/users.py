"""The users a broker knows, and checking that a link's AUTH proves one of them.

A plain table, read from the ``[[users]]`` of the broker's config file
(``meshbus broker --config``): each user has a name and exactly one credential, an
Ed25519 public key or a token hash (meshbus.auth has their text forms), and what it
may do (its permissions). The config's ``[[brokers]]`` -- the brokers of the mesh,
each a name and a public key, and nothing else -- are a table of this kind too
(meshbus.broker.trust checks their proofs with it).

A check never tells a caller more than yes or no, and costs the same whether the
user exists or not (a decoy key and a decoy hash stand in for a missing one), so
neither the answer nor its timing says who exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from meshbus.auth import TokenHash, check_user_name, public_key_from_text
from meshbus.broker.permissions import BadPermissions, Permissions
from meshbus.errors import InvalidArgument


@dataclass(frozen=True)
class User:
    """One user: ``name`` and exactly one of ``public_key``, ``token_hash`` and
    ``certificate`` (the common name of the client certificate that proves the user,
    under mutual TLS)."""

    name: str
    public_key: Ed25519PublicKey | None = None
    token_hash: TokenHash | None = None
    certificate: str | None = None
    # What the user may do (its [users.permissions] table); None: nothing.
    permissions: Permissions | None = None


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

    def check_token(self, name: str, token: str) -> bool:
        """Whether ``token`` is ``name``'s token. One scrypt, about 10 ms: run it in a
        worker thread, never on the event loop."""
        user = self._users.get(name)
        stored = user.token_hash if user is not None else None
        matched = (stored or self._decoy_hash).matches(token)
        return matched and stored is not None

    @cached_property
    def _decoy_key(self) -> Ed25519PublicKey:
        return Ed25519PrivateKey.generate().public_key()

    @cached_property
    def _decoy_hash(self) -> TokenHash:
        return TokenHash.of("")

    @classmethod
    def from_config(cls, entries: object, source: str) -> UserTable:
        """The table of a config file's ``[[users]]`` (``source`` names the file).
        InvalidArgument names the file and the user for anything wrong: a bad key or
        hash, two users with one name, both credentials or neither, an unknown field."""
        if not isinstance(entries, list):
            raise InvalidArgument(f"{source}: users is an array of tables, [[users]]")
        users = [_user_from_entry(entry, source, index) for index, entry in enumerate(entries, 1)]
        try:
            return cls(users)
        except ValueError as exc:
            raise InvalidArgument(f"{source}: {exc}; user names are unique") from None

    @classmethod
    def brokers_from_config(cls, entries: object, source: str) -> UserTable:
        """The table of a config file's ``[[brokers]]``: each a ``name`` and a
        ``public_key``, nothing else (a broker proves itself with its key pair only).
        InvalidArgument names the file and the broker, as ``from_config`` does."""
        if not isinstance(entries, list):
            raise InvalidArgument(f"{source}: brokers is an array of tables, [[brokers]]")
        brokers = []
        for index, entry in enumerate(entries, 1):
            fields, name = _named_entry(entry, source, "brokers", index)
            where = f"{source}: broker {name!r}"
            if set(fields) != {"name", "public_key"}:
                raise InvalidArgument(
                    f"{where} has exactly a name and a public_key (meshbus keygen --user "
                    f"{name} prints it); it has {', '.join(sorted(fields))}"
                )
            text = fields["public_key"]
            try:
                if not isinstance(text, str):
                    raise ValueError("public_key is a string")
                brokers.append(User(name, public_key=public_key_from_text(text)))
            except ValueError as exc:
                raise InvalidArgument(f"{where}: {exc}") from None
        try:
            return cls(brokers)
        except ValueError as exc:
            raise InvalidArgument(f"{source}: {exc}; broker names are unique") from None


_FIELDS = frozenset({"name", "public_key", "token_hash", "certificate", "permissions"})
_CREDENTIALS = ("public_key", "token_hash", "certificate")


def _named_entry(
    entry: object, source: str, section: str, index: int
) -> tuple[Mapping[str, Any], str]:
    """An entry of ``[[section]]`` and its name, checked as a user name is."""
    where = f"{source}: [[{section}]] number {index}"
    if not isinstance(entry, Mapping):
        raise InvalidArgument(f"{where} is not a table")
    fields: Mapping[str, Any] = entry
    name = fields.get("name")
    if not isinstance(name, str):
        raise InvalidArgument(f'{where} has no name (name = "...")')
    try:
        check_user_name(name)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    return fields, name


def _user_from_entry(entry: object, source: str, index: int) -> User:
    fields, name = _named_entry(entry, source, "users", index)
    where = f"{source}: user {name!r}"
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise InvalidArgument(
            f"{where} has unknown field {unknown[0]!r} (a user has name, and public_key, "
            "token_hash or certificate)"
        )
    given = [key for key in _CREDENTIALS if key in fields]
    if len(given) != 1:
        raise InvalidArgument(
            f"{where} needs exactly one of public_key (meshbus keygen prints it), "
            "token_hash (meshbus hash-token) and certificate (a client certificate's "
            f"common name); it has {' and '.join(given) if given else 'none'}"
        )
    (credential,) = given
    text = fields[credential]
    try:
        permissions = Permissions.from_table(fields.get("permissions", {}), name)
    except BadPermissions as exc:
        raise InvalidArgument(f"{source}: {exc}") from None
    try:
        if not isinstance(text, str):
            raise ValueError(f"{credential} is a string")
        if credential == "public_key":
            return User(name, public_key=public_key_from_text(text), permissions=permissions)
        if credential == "token_hash":
            return User(name, token_hash=TokenHash.parse(text), permissions=permissions)
        if not text:
            raise ValueError("certificate is the common name (CN) of the user's certificate")
        return User(name, certificate=text, permissions=permissions)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
