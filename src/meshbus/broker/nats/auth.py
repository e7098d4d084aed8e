"""Who a NATS client is, and what it may publish and subscribe to (docs/nats.md,
"Signing in" and "Permissions").

A broker with ``[[users]]`` asks every NATS client to sign in as one of them, with
what a NATS client library sends in its CONNECT:

- ``user`` and ``pass``: a token user's name and its token (the one in its
  credentials file). The token crosses the connection itself, as NATS passwords do:
  use TLS. It is checked against the user's stored key with one scrypt (about 10 ms),
  in a worker thread of its own, one check at a time, so the loop never waits for it
  and a flood of bad passwords costs one core at most.
- ``auth_token`` written ``NAME:TOKEN``: the same, for clients given a token alone.
- ``nkey`` and ``sig``: a key user's public key as a NATS user nkey (``U...``), and
  its Ed25519 signature of the nonce this connection's INFO carried (base64, URL-safe
  or standard). Checked on the loop, about 0.1 ms.
- none of them, over TLS with a client certificate the broker's CA signed whose common
  name is a certificate user's (``certificate = "CN"``): that user, as for a connector.

Anything else -- wrong, missing, a ``jwt`` -- is ``Authorization Violation``. Every
check costs the same whether the user exists or not (meshbus.broker.security.users).

A signed-in client's permissions are its user's, read for subjects: publishing to
``S`` takes ``send`` to permit ``multicast:S``; subscribing to ``S`` (as written,
wildcards and all) takes ``join`` to permit ``multicast:S``; and a message whose
subject ``join`` denies is not delivered to a subscription whose wildcard matched it
(as nats-server keeps a deny out of a wildcard subscription).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import secrets
import ssl

from meshbus.auth import nkey_public_raw
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.security.signin import SignIn
from meshbus.broker.security.users import User, same_credential
from meshbus.protocol.nats import ConnectCredentials

__all__ = ["NatsSignIn", "SubjectPermissions"]

# nats-server's nonce: 11 random bytes, base64 (URL-safe, no padding).
_NONCE_BYTES = 11
# Answers remembered per connection; past this many it starts over (a publisher of many
# distinct subjects cannot grow it without limit).
MEMO_SIZE = 1024


class SubjectPermissions:
    """One user's permissions, read for subjects: ``may_publish``, ``may_subscribe``,
    ``may_deliver``. A plain table; its answers are memoised (bounded)."""

    __slots__ = ("_delivered", "_permissions", "_published")

    def __init__(self, permissions: Permissions) -> None:
        self._permissions = permissions
        self._published: dict[bytes, bool] = {}
        self._delivered: dict[bytes, bool] = {}

    @property
    def user(self) -> str:
        return self._permissions.user

    def reads(self, permissions: Permissions) -> bool:
        """Whether these are ``permissions`` read for subjects (a reload replaces a
        link's permissions with new ones)."""
        return self._permissions is permissions

    def denial(self, action: str, permission: str) -> str:
        """The message of a refusal (``Permissions.denial``)."""
        return self._permissions.denial(action, permission)

    def may_publish(self, subject: bytes) -> bool:
        known = self._published.get(subject)
        if known is None:
            if len(self._published) >= MEMO_SIZE:
                self._published.clear()
            known = self._published[subject] = self._permissions.send.permits(_name(subject))
        return known

    def may_subscribe(self, subject: bytes) -> bool:
        """Whether ``subject``, as the SUB wrote it (wildcards and all), may be subscribed."""
        return self._permissions.join.permits(_name(subject))

    def may_deliver(self, subject: bytes) -> bool:
        """Whether a message of the literal ``subject`` may reach a subscription of this
        user's that matched it: no deny pattern of ``join`` names it."""
        known = self._delivered.get(subject)
        if known is None:
            if len(self._delivered) >= MEMO_SIZE:
                self._delivered.clear()
            known = self._delivered[subject] = not self._permissions.join.denies(_name(subject))
        return known


def _name(subject: bytes) -> str:
    """What a subject is checked as: the multicast address of its name."""
    return "multicast:" + subject.decode("utf-8", "surrogateescape")


def _signature(text: str) -> bytes | None:
    """A ``sig`` as NATS clients write it: URL-safe base64 without padding (nats.go,
    nats.js) or standard base64 (nats.py)."""
    padded = text + "=" * (-len(text) % 4)
    for decode in (base64.urlsafe_b64decode, base64.standard_b64decode):
        try:
            return decode(padded.encode("ascii"))
        except (binascii.Error, ValueError):
            continue
    return None


class NatsSignIn:
    """The sign-in of NATS clients: the users are the broker's (``SignIn``, reloaded on
    SIGHUP), the TLS context the broker's listener's. Owns the worker thread that checks
    passwords."""

    def __init__(
        self,
        sign_in: SignIn,
        *,
        tls: ssl.SSLContext | None,
        tls_verify: bool,
        timeout: float,
    ) -> None:
        """``tls``: the context a client's connection is upgraded with after its INFO
        (None: plain TCP); ``tls_verify``: a client must show a certificate signed by the
        broker's CA; ``timeout``: how long a client has, from its accept, for its TLS
        handshake and its signed-in CONNECT."""
        self._sign_in = sign_in
        self.tls = tls
        self.tls_verify = tls_verify
        self.timeout = timeout
        self._passwords: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def required(self) -> bool:
        """Whether NATS clients must sign in: the broker has users."""
        return self._sign_in.required

    def new_nonce(self) -> str:
        """What this connection's INFO asks an nkey to sign, as nats-server makes it."""
        return base64.urlsafe_b64encode(secrets.token_bytes(_NONCE_BYTES)).decode().rstrip("=")

    def user_of(self, credentials: ConnectCredentials, nonce: str, certificate: str) -> User | None:
        """The user that ``credentials`` prove on the loop -- an nkey's signature of
        ``nonce``, or no credentials and a verified client certificate whose common name
        is ``certificate`` -- or None. A password is not checked here (``password``)."""
        users = self._sign_in.users
        if credentials.nkey:
            try:
                raw = nkey_public_raw(credentials.nkey)
            except ValueError:
                return None
            signature = _signature(credentials.sig)
            if signature is None:
                return None
            return users.check_key_signature(raw, nonce.encode(), signature)
        if credentials.user or credentials.password or credentials.auth_token:
            return None
        name = self._sign_in.certificate_user(certificate)
        return None if name is None else users.get(name)

    @staticmethod
    def password(credentials: ConnectCredentials) -> tuple[str, str] | None:
        """The (user, token) a CONNECT signs in with, for ``check_password``; None when it
        carries no password (or an nkey, which wins)."""
        if credentials.nkey:
            return None
        if credentials.user:
            return credentials.user, credentials.password
        user, colon, token = credentials.auth_token.partition(":")
        return (user, token) if colon else None

    async def check_password(self, user: str, token: str) -> User | None:
        """The user, if ``token`` is ``user``'s: one scrypt, in the worker thread."""
        if self._passwords is None:
            self._passwords = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="nats-passwords"
            )
        users = self._sign_in.users
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._passwords, users.check_password, user, token)

    def permissions_of(self, user: User) -> SubjectPermissions:
        """What ``user`` may publish and subscribe to."""
        return SubjectPermissions(self._sign_in.permissions_of(user.name) or Permissions(user.name))

    def recheck(self, user: User) -> SubjectPermissions | None:
        """After a SIGHUP: the permissions of a client signed in as ``user``, or None when
        the user is gone or its credential changed (the client is then closed)."""
        now = self._sign_in.users.get(user.name)
        if now is None or not same_credential(now, user):
            return None
        return self.permissions_of(now)

    def stop(self) -> None:
        if self._passwords is not None:
            self._passwords.shutdown(wait=False, cancel_futures=True)
