"""Signing in: the nonce of each CHALLENGE, and checking the AUTH that answers it.

Both credentials are checked on the event loop: a key's signature in about 0.1 ms, a
token's proof in microseconds (two HMACs and a SHA-256: the token's scrypt is the
client's to do, meshbus.auth).

The sign-in owns the users (the config file's ``[[users]]``). A SIGHUP reloads them
(``reload``; docs/security.md, "Reloading"): the file is read again by the function
the broker was given, and applied whole or not at all.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshbus.broker.core.endpoint import CloseReason
from meshbus.broker.core.registry import LinkRegistry
from meshbus.broker.security.permissions import Permissions
from meshbus.broker.security.users import UserTable, same_credential
from meshbus.errors import InvalidArgument
from meshbus.protocol.control import NONCE_SIZE, Auth
from meshbus.protocol.layout import ErrorCode

log = logging.getLogger("meshbus.broker")


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


@dataclass
class Reloads:
    """The reloads of the users (``meshbus stat``)."""

    applied: int = 0  # SIGHUPs whose file was applied
    failed: int = 0  # SIGHUPs whose file had errors: nothing changed
    applied_at: float = 0.0  # when the last one was applied (Unix time; 0: never)


class SignIn:
    def __init__(
        self,
        users: UserTable,
        links: LinkRegistry,
        *,
        reread: Callable[[], UserTable] | None = None,
        reloaded: Callable[[], None] = lambda: None,
        new_nonce: Callable[[], bytes] = _new_nonce,
    ) -> None:
        """``reread`` reads the users from the config file again (InvalidArgument for
        anything wrong in it); None: the broker has no config file to reload.
        ``reloaded`` is called after a reload was applied, for what holds rights beyond
        a link (the streams' captures).
        ``new_nonce`` draws each CHALLENGE's nonce (``secrets``: never the broker's
        seeded rng, whose choices a simulation replays)."""
        self._users = users
        self._links = links
        self._reread = reread
        self._reloaded = reloaded
        self.new_nonce = new_nonce
        self.reloads = Reloads()

    @property
    def users(self) -> UserTable:
        """The users of the moment (a reload replaces them)."""
        return self._users

    @property
    def required(self) -> bool:
        """Whether connectors and operators must sign in: the broker has users."""
        return bool(self._users)

    def certificate_user(self, common_name: str) -> str | None:
        """The user a verified client certificate names (its subject's common name), if
        one of the users is proved by that certificate; such a link is not challenged."""
        user = self._users.by_certificate(common_name) if common_name else None
        return None if user is None else user.name

    def permissions_of(self, user: str | None) -> Permissions | None:
        """What a link signed in as ``user`` may do: its [users.permissions], nothing
        without them; None (everything) on a broker without users."""
        if user is None:
            return None
        entry = self._users.get(user)
        found = entry.permissions if entry is not None else None
        return found if found is not None else Permissions(user)

    def may_capture(self, user: str, group: bytes) -> bool:
        """Whether a stream added by ``user`` may capture ``group`` now (a user that is
        gone may capture nothing); on a broker without users, everything."""
        permissions = self.permissions_of(user) if self.required else None
        return permissions is None or permissions.may_capture(group)

    def check(self, auth: Auth, signed: bytes) -> bool:
        """Whether the AUTH's signature or token's proof of ``signed`` proves its user."""
        if auth.signature:
            return self._users.check_signature(auth.user, signed, auth.signature)
        return self._users.check_token(auth.user, signed, auth.token_proof)

    def reload(self) -> None:
        """SIGHUP: read the users again and apply them, or, when the file has any error,
        log it and change nothing. An open link of a user that is still there, with the
        same credential, gets the user's new permissions at once (``Link.reauthorize``);
        one of a user that is gone, or whose credential changed, is closed with an
        ERROR saying so."""
        if self._reread is None:
            log.warning("SIGHUP: nothing to reload, the broker was started without --config")
            return
        try:
            users = self._reread()
            if bool(users) != bool(self._users):
                raise InvalidArgument(
                    "a reload cannot add the first user or remove the last one (that turns "
                    "the sign-in and the mesh's trust on or off): restart the broker"
                )
        except InvalidArgument as exc:
            self.reloads.failed += 1
            log.error(
                "config not reloaded; the users and permissions stay as they were",
                extra={"errors": str(exc)},
            )
            return
        before, self._users = self._users, users
        kept = closed = 0
        for link in [*self._links.connectors, *self._links.operators]:
            name = link.user
            if name is None:
                continue
            now, then = users.get(name), before.get(name)
            if now is None:
                why = f"user {name!r} was removed from this broker's config"
            elif then is None or not same_credential(now, then):
                why = f"the credential of user {name!r} changed in this broker's config"
            else:
                link.reauthorize(self.permissions_of(name))
                kept += 1
                continue
            link.fail(ErrorCode.AUTH_FAILED, f"{why}; this link is closed", CloseReason.REVOKED)
            closed += 1
        self.reloads.applied += 1
        self.reloads.applied_at = time.time()
        self._reloaded()
        log.info(
            "config reloaded",
            extra={"users": len(list(users)), "links_kept": kept, "links_closed": closed},
        )
