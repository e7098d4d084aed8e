"""The mesh trusts only its brokers: which peers a broker links to, and the proofs both
sides of a link between brokers give (docs/security.md, "The mesh trusts only its
brokers").

Trust is on when the config lists brokers (``[[brokers]]``) or has users
(``BrokerConfig.mesh_trust``). Then the broker has a key pair of its own, whose user
is its name, and a link between two brokers opens only once each proved itself with
it (meshbus.protocol.handshake, rule 5): the dialler sends a fresh nonce in its HELLO;
the accepting broker signs it with the dialler's name (its CHALLENGE's proof) before
it asks anything; the dialler checks that proof against ``[[brokers]]`` and only then
signs the CHALLENGE's nonce (its AUTH); the accepting broker checks that signature
against ``[[brokers]]`` too, and only then does the mesh hear of the link (the
duplicate-link rule, WELCOME, the route snapshot). With trust off nothing here runs:
a broker takes any peer, as it always did.

Nonces come from ``secrets``, never from the broker's seeded rng (a simulation replays
those).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import msgspec

from meshbus.auth import public_key_from_text
from meshbus.broker.config import BrokerConfig
from meshbus.errors import InvalidArgument
from meshbus.protocol.control import NONCE_SIZE, Hello
from meshbus.protocol.handshake import AuthReceived, DiallingHandshake, broker_proof_message


def _new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


class MeshTrust:
    def __init__(
        self, config: BrokerConfig, *, new_nonce: Callable[[], bytes] = _new_nonce
    ) -> None:
        """InvalidArgument, in one line, when trust is on and the broker has no key pair to
        prove itself with. ``new_nonce`` draws the nonce of each HELLO this broker sends."""
        self.on = config.mesh_trust
        self._brokers = config.brokers
        self._key = config.broker_key
        self._new_nonce = new_nonce
        if not self.on:
            return
        if not self._brokers:
            # Users and no [[brokers]]: a broker on its own, which links to no broker and
            # so proves itself to none -- it needs no key, and has nobody to join.
            if config.seeds:
                raise InvalidArgument(
                    "this broker has [[users]] and --seed, but its config lists no "
                    "[[brokers]]: it links only to brokers that prove themselves with a key "
                    "[[brokers]] lists; list the mesh's brokers (meshbus keygen --broker) "
                    "and give each its --broker-key"
                )
            return
        if self._key is None:
            raise InvalidArgument(
                "this broker's config lists [[brokers]], the only brokers its mesh trusts, "
                "so it needs a key pair of its own: give --broker-key FILE (meshbus keygen "
                "--broker --user NAME writes one) and list it in [[brokers]] too"
            )
        if self._key.public_key is None:
            raise InvalidArgument(
                f"the broker key of {self._key.user!r} holds a token; a broker proves "
                f"itself with a key pair (meshbus keygen --user {self._key.user})"
            )

    def check_name(self, name: str) -> None:
        """InvalidArgument unless the broker's key is for ``name`` (its user is the name)
        and, when ``[[brokers]]`` lists ``name``, is the key listed there."""
        key = self._key
        if not self.on or key is None or key.public_key is None:
            return
        if key.user != name:
            raise InvalidArgument(
                f"the broker key is user {key.user!r}'s, but this broker is named {name!r}: "
                f"give --name {key.user}, or make its key with meshbus keygen --user {name}"
            )
        listed = self._brokers.get(name)
        listed_key = listed.public_key if listed is not None else None
        ours = public_key_from_text(key.public_key).public_bytes_raw()
        if listed_key is not None and listed_key.public_bytes_raw() != ours:
            raise InvalidArgument(
                f"the broker key of {name!r} is not the public_key [[brokers]] lists for "
                f"{name!r}; the other brokers would refuse it"
            )

    # -- the accepting side -----------------------------------------------------------

    def refusal(self, hello: Hello) -> str:
        """Why a broker's HELLO is refused before any CHALLENGE, or "" to challenge it."""
        if not self._brokers:
            return (
                "this broker links to no broker: it has [[users]] and lists no [[brokers]]; "
                "list the mesh's brokers (name and public_key) in every broker's config"
            )
        if not hello.nonce:
            return (
                "this broker links only to the brokers its [[brokers]] lists, each proving "
                f"itself: give broker {hello.name!r} its key pair (--broker-key) and the "
                "mesh's [[brokers]]"
            )
        return ""

    def proof(self, hello: Hello) -> bytes:
        """This broker's proof for the CHALLENGE answering ``hello``: its signature of the
        dialler's nonce and name."""
        assert self._key is not None
        return self._key.answer(broker_proof_message(hello.nonce, hello.name)).signature

    def auth_refusal(self, event: AuthReceived) -> str:
        """Why the AUTH of a dialling broker does not prove it, or "" when it does: a
        signature, as the HELLO's broker, by the key ``[[brokers]]`` lists for it."""
        auth = event.auth
        if self._brokers.check_signature(auth.user, event.signed, auth.signature):
            return ""
        return (
            f"authentication failed: broker {auth.user!r} did not prove itself with a key "
            "this broker's [[brokers]] lists; add its public_key (meshbus keygen prints it) "
            "to the [[brokers]] of every broker of the mesh"
        )

    # -- the dialling side ------------------------------------------------------------

    def dialling(self, hello: Hello) -> DiallingHandshake:
        """The handshake of a link this broker dials: with trust on, its HELLO carries a
        fresh nonce, the other broker's proof is checked (``verify``) before anything
        else is sent, and this broker's key answers the CHALLENGE."""
        if not self.on:
            return DiallingHandshake(hello)
        # A broker that dials is one with [[brokers]], and so with a key (__init__): one
        # with users alone has no seed to dial and refuses every peer.
        assert self._key is not None
        with_nonce = msgspec.structs.replace(hello, nonce=self._new_nonce())
        return DiallingHandshake(with_nonce, credential=self._key, verifier=self)

    def verify(self, broker: str, signed: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is ``broker``'s signature of ``signed``, by the key
        ``[[brokers]]`` lists for it (meshbus.protocol.handshake.PeerVerifier)."""
        return self._brokers.check_signature(broker, signed, proof)
