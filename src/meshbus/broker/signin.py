"""Signing in: the nonce of each CHALLENGE, and checking the AUTH that answers it.

A key's signature is checked on the event loop (about 0.1 ms). A token is checked
with scrypt (about 10 ms, meshbus.auth), in one worker thread: hashlib.scrypt lets
go of the GIL, so the loop never waits on it. The checks queue behind each other
in that one thread, so a flood of bad tokens takes one core and never the loop;
the queue is bounded by the links that may be handshaking at once
(``--max-handshaking``), and a check whose link closed meanwhile (the handshake
timeout) is skipped when its turn comes.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from meshbus.broker.users import UserTable
from meshbus.protocol.control import NONCE_SIZE, Auth


def _new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


# Tells a session bound by meshbus apart from any other BLAKE2b digest (16 bytes at most).
_SESSION_PERSON = b"meshbus session"


def bound_session(user: str, session: bytes) -> bytes:
    """The session a broker with users gives a connector that signed in as ``user`` and
    sent ``session``: a BLAKE2b digest of both, of the same length (HELLO.session is at
    most 64 bytes, BLAKE2b's longest digest). An address belongs to the session that
    registered it, and a connector may take back its session's addresses (failover, a
    move); bound to the user, a session id that leaked (or was guessed) lets no other
    user take them. Every broker derives the same, so failover works as before; an empty
    session stays empty (it never takes anything over)."""
    if not session:
        return session
    # A user name has no control characters: the zero byte ends it unambiguously.
    data = user.encode() + b"\x00" + session
    return hashlib.blake2b(data, digest_size=len(session), person=_SESSION_PERSON).digest()


class SignIn:
    def __init__(self, users: UserTable, *, new_nonce: Callable[[], bytes] = _new_nonce) -> None:
        """``new_nonce`` draws each CHALLENGE's nonce (``secrets``: never the broker's
        seeded rng, whose choices a simulation replays)."""
        self._users = users
        self.new_nonce = new_nonce
        self._tokens: ThreadPoolExecutor | None = None

    @property
    def required(self) -> bool:
        """Whether connectors and operators must sign in: the broker has users."""
        return bool(self._users)

    def certificate_user(self, common_name: str) -> str | None:
        """The user a verified client certificate names (its subject's common name), if
        one of the users is proved by that certificate; such a link is not challenged."""
        user = self._users.by_certificate(common_name) if common_name else None
        return None if user is None else user.name

    def check_key(self, auth: Auth, signed: bytes) -> bool:
        return self._users.check_signature(auth.user, signed, auth.signature)

    def check_token(self, auth: Auth, wanted: Callable[[], bool]) -> asyncio.Future[bool]:
        """The token's check, done in the worker thread; False without checking when
        ``wanted`` (read from that thread) says the link is gone by its turn."""
        if self._tokens is None:
            self._tokens = ThreadPoolExecutor(1, thread_name_prefix="meshbus-token-check")
        users = self._users

        def check() -> bool:
            return wanted() and users.check_token(auth.user, auth.token)

        return asyncio.get_running_loop().run_in_executor(self._tokens, check)

    def close(self) -> None:
        """Drop the checks not started (the broker is stopping)."""
        if self._tokens is not None:
            self._tokens.shutdown(wait=False, cancel_futures=True)
