"""The HELLO / WELCOME handshake, with its sign-in (CHALLENGE / AUTH), as a sans-IO
state machine: frames in, events out, bytes to send out.

Like the codec beside it, this module does no I/O: no sockets, no asyncio, no
clock, no randomness, no callbacks. The caller reads bytes, decodes them into
frames (``FrameDecoder``), hands the handshake's frames to ``receive`` and writes
the bytes that ``hello``, ``challenge``, ``welcome`` and ``refuse`` return (and a
``Challenged`` event's ``reply``). Bytes that arrived after the handshake frame
stay in the caller's decoder: the handshake never sees them. Checking a
credential is the caller's too (meshbus.broker.security.users): the handshake hands over
what was signed and what came back.

Rules it keeps:

1. The first frame on a link is a HELLO, from the side that dialled. The
   accepting side refuses anything else with ``NOT_HANDSHAKEN`` (fatal).
2. A HELLO is checked in full before anything is sent back: its protocol
   version (``UNSUPPORTED_VERSION``), its role (``PROTOCOL_ERROR`` for one this
   side does not know), every integer the accepting side uses (``max_frame``
   >= 0, ``slot`` 0..65535, ``tag`` 0..2**32-1) and its ``nonce`` (empty or
   ``NONCE_SIZE`` bytes; ``PROTOCOL_ERROR``). A frame that breaks a rule raises
   ``FrameError`` carrying the code to report; the link is then CLOSED.
3. The accepting side decides (its capacity, duplicate links, names, whether it
   wants to know who is there: none of that is the handshake's business) and
   answers with ``welcome``, ``refuse`` or ``challenge``. WELCOME and CHALLENGE
   carry the HELLO's correlation; a refusal is an ERROR with correlation 0, as
   every ERROR before a close is (docs/protocol.md §6).
4. Sign-in: a CHALLENGE carries a nonce of ``NONCE_SIZE`` bytes that the caller
   drew. The only frame the accepting side then takes is one AUTH naming a user
   with exactly one credential -- a ``SIGNATURE_SIZE``-byte signature or a
   ``TOKEN_PROOF_SIZE``-byte token's proof; anything else is ``AUTH_FAILED``
   (fatal). Both cover ``sign_in_message(nonce)``: a fixed context string and the
   nonce, never the bare nonce, so a signature made for this purpose is good for
   nothing else, and neither is good on a link with another nonce. The
   caller checks the credential and answers with ``welcome`` or ``refuse``.
   Nothing the caller sends before that says more than a refusal must (a
   redirect's address): no broker list, no routes.
5. Between brokers whose mesh trusts only its brokers, both sides prove themselves.
   The dialler's HELLO carries a fresh nonce; the accepting side answers with a
   CHALLENGE that also carries its name (``broker``) and ``proof``: its signature
   of ``broker_proof_message(hello nonce, hello name)`` -- a context string of its
   own, so a broker's proof is never a sign-in and no sign-in is a proof. The
   AUTH that answers such a CHALLENGE must carry a signature (no token's proof) and name
   the HELLO's broker; anything else is ``AUTH_FAILED`` (fatal). The caller checks
   the signature against the brokers it trusts.
6. The dialling side takes exactly one answer to its HELLO: a WELCOME that
   answers it (same correlation, protocol 1, integers in range) opens the link;
   an ERROR, or a BYE from a broker that is stopping, refuses it; a CHALLENGE
   (same correlation, a nonce of ``NONCE_SIZE`` bytes) is answered with AUTH when
   the side has a credential -- after which only the WELCOME, ERROR or BYE may
   come -- and refuses the link (``AUTH_FAILED``, no frame sent) when it has
   none. A credential given to a broker that WELCOMEs without a CHALLENGE is
   simply not used. Any other frame is a ``PROTOCOL_ERROR``.
7. A dialling broker given a ``PeerVerifier`` (its mesh trusts only its brokers)
   sends nothing of its own before the other side proved itself: a CHALLENGE whose
   proof the verifier does not take for the ``broker`` it names (or that has no
   proof), and a WELCOME without a CHALLENGE, refuse the link (``AUTH_FAILED``,
   ``local``: no frame sent). A WELCOME after the AUTH must name the broker that
   proved itself (``PROTOCOL_ERROR`` otherwise).
8. A second HELLO on an open link is refused with ``ALREADY_HANDSHAKEN``, which
   is not fatal: the link stays OPEN.
9. Calling a method in a state that does not allow it raises
   ``HandshakeStateError``: a bug in the caller, never a peer's doing.

Transitions (``HandshakeState``)::

    accepting side (AcceptingHandshake)
      AWAIT_HELLO --receive(a valid HELLO)--------> DECIDING   HelloReceived
      AWAIT_HELLO --receive(anything else)--------> CLOSED     FrameError
      DECIDING    --welcome(body)-----------------> OPEN       the WELCOME frame
      DECIDING    --refuse(code, message)---------> CLOSED     the ERROR frame
      DECIDING    --challenge(nonce)--------------> AWAIT_AUTH the CHALLENGE frame
      DECIDING    --challenge(nonce, broker=,
                    proof=), to a broker's HELLO
                    with a nonce------------------> AWAIT_AUTH the CHALLENGE frame
      AWAIT_AUTH  --receive(a valid AUTH)---------> CHECKING   AuthReceived
      AWAIT_AUTH  --receive(anything else)--------> CLOSED     FrameError(AUTH_FAILED)
      CHECKING    --welcome(body)-----------------> OPEN       the WELCOME frame
      CHECKING    --refuse(code, message)---------> CLOSED     the ERROR frame
      OPEN        --receive(HELLO)----------------> OPEN       FrameError(ALREADY_HANDSHAKEN)

    dialling side (DiallingHandshake)
      IDLE          --hello()---------------------> AWAIT_WELCOME  the HELLO frame
      AWAIT_WELCOME --receive(a valid WELCOME),
                      without a verifier----------> OPEN           Welcomed
      AWAIT_WELCOME --receive(a valid WELCOME),
                      with one--------------------> CLOSED         HelloRefused(AUTH_FAILED)
      AWAIT_WELCOME --receive(ERROR or BYE)-------> CLOSED         HelloRefused
      AWAIT_WELCOME --receive(a valid CHALLENGE),
                      with a credential, and a
                      proof the verifier takes
                      (if there is one)-----------> AUTH_SENT      Challenged (the AUTH)
      AWAIT_WELCOME --receive(a valid CHALLENGE),
                      without a credential, or
                      with a verifier and no
                      proof it takes--------------> CLOSED         HelloRefused(AUTH_FAILED)
      AWAIT_WELCOME --receive(anything else)------> CLOSED         FrameError
      AUTH_SENT     --receive(a valid WELCOME,
                      naming the broker proved)---> OPEN           Welcomed
      AUTH_SENT     --receive(ERROR or BYE)-------> CLOSED         HelloRefused
      AUTH_SENT     --receive(anything else)------> CLOSED         FrameError

Every other (state, call) pair raises ``HandshakeStateError``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from meshbus.protocol.codec import ControlFrame, Frame, FrameError, describe, encode_control
from meshbus.protocol.control import (
    NONCE_SIZE,
    ROLE_BROKER,
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    SIGNATURE_SIZE,
    TOKEN_PROOF_SIZE,
    Auth,
    Bye,
    Challenge,
    Error,
    Hello,
    Welcome,
)
from meshbus.protocol.layout import MIN_MAX_FRAME, PROTOCOL_VERSION, ControlType, ErrorCode

ROLES = frozenset({ROLE_CONNECTOR, ROLE_OPERATOR, ROLE_BROKER})

# What an AUTH signature covers besides the nonce: the purpose, so that no signature made
# for something else (and no nonce a broker might choose to look like something else)
# can pass for a sign-in. The version lets a later sign-in change what it binds.
SIGN_IN_CONTEXT = b"meshbus sign-in v1\x00"
# What a broker's proof (CHALLENGE.proof) covers besides the dialler's nonce and name: a
# context of its own, so that a proof is never a sign-in, nor a sign-in a proof.
BROKER_PROOF_CONTEXT = b"meshbus broker proof v1\x00"

# The largest frame the accepting side takes before the handshake is done (docs/protocol.md
# §2): the biggest AUTH is under 1 KiB (a MAX_USER_NAME-character user at 4 bytes a
# character, a signature or a token's proof) and a HELLO is names, an address, a session
# and a nonce. A client must not send anything else before WELCOME, so a connection that
# has not said who it is never makes the broker hold a buffer of up to --max-frame.
MAX_HANDSHAKE_FRAME = 8 * 1024

_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFFFFFF


def sign_in_message(nonce: bytes) -> bytes:
    """The bytes an AUTH signature signs: the sign-in context, then the CHALLENGE's nonce."""
    return SIGN_IN_CONTEXT + nonce


def broker_proof_message(nonce: bytes, dialler: str) -> bytes:
    """The bytes a CHALLENGE's proof signs: the broker proof context, the dialling
    broker's HELLO nonce (fixed size, so the name after it cannot shift into it), then
    the name it claims."""
    return BROKER_PROOF_CONTEXT + nonce + dialler.encode()


class HandshakeState(enum.Enum):
    IDLE = "idle"  # dialling side, before its HELLO
    AWAIT_HELLO = "await-hello"  # accepting side, before the first frame
    AWAIT_WELCOME = "await-welcome"  # dialling side, HELLO sent
    DECIDING = "deciding"  # accepting side, HELLO taken, WELCOME or refusal not sent yet
    AWAIT_AUTH = "await-auth"  # accepting side, CHALLENGE sent
    CHECKING = "checking"  # accepting side, AUTH taken, WELCOME or refusal not sent yet
    AUTH_SENT = "auth-sent"  # dialling side, AUTH sent, waiting for WELCOME
    OPEN = "open"
    CLOSED = "closed"


class HandshakeStateError(RuntimeError):
    """A handshake method called in a state that does not allow it: a bug in the caller,
    not something a peer did (a peer's mistakes are ``FrameError``)."""


class Credential(Protocol):
    """What the dialling side answers a CHALLENGE with (``meshbus.Credentials``)."""

    def answer(self, to_sign: bytes) -> Auth:
        """The AUTH body: the user and a signature of ``to_sign``, or a token's proof
        of it."""
        ...


class PeerVerifier(Protocol):
    """What a dialling broker checks the other broker's proof with: the brokers it
    trusts (meshbus.broker.security.trust)."""

    def verify(self, broker: str, signed: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is the signature of ``signed`` by the trusted ``broker``."""
        ...


@dataclass(frozen=True)
class HelloReceived:
    """The accepting side got a valid HELLO; answer it with ``welcome``, ``refuse`` or
    ``challenge``."""

    hello: Hello
    correlation: int
    role: str  # ROLE_CONNECTOR, ROLE_OPERATOR or ROLE_BROKER


@dataclass(frozen=True)
class AuthReceived:
    """The accepting side got an AUTH answering its CHALLENGE; check it, then ``welcome``
    or ``refuse``. Exactly one of ``auth.signature`` (``SIGNATURE_SIZE`` bytes) and
    ``auth.token_proof`` (``TOKEN_PROOF_SIZE`` bytes) is set, to check against
    ``signed``."""

    hello: Hello
    auth: Auth
    signed: bytes  # sign_in_message of the nonce this side sent


@dataclass(frozen=True)
class Welcomed:
    """The dialling side's HELLO was accepted: the link is open."""

    welcome: Welcome


@dataclass(frozen=True)
class HelloRefused:
    """The dialling side's HELLO was refused; the peer closes the link. With code
    ``REDIRECT``, ``redirect`` names a broker that takes connectors ("" if none). With
    ``AUTH_FAILED`` the broker did not take the credential, or (``local``) it asked for
    one and this side has none, or it is a broker that did not prove itself to a
    verifying one: nothing was sent, and the caller closes the link."""

    code: int
    message: str
    redirect: str
    local: bool = False


@dataclass(frozen=True)
class Challenged:
    """The broker asked who is there; send ``reply`` (the AUTH frame) and wait on."""

    reply: bytes


def negotiated_max_frame(ours: int, theirs: int) -> int:
    """The frame size limit of a link: the smaller of the two sides' limits, and never
    below ``MIN_MAX_FRAME`` (docs/protocol.md §2)."""
    return max(MIN_MAX_FRAME, min(ours, theirs))


class AcceptingHandshake:
    """The handshake of a link this side accepted (the broker's side)."""

    def __init__(self) -> None:
        self.state = HandshakeState.AWAIT_HELLO
        self._correlation = 0
        self._hello = Hello()
        self._signed = b""
        self._peer_challenged = False  # the CHALLENGE carried this side's broker proof

    def receive(self, frame: Frame) -> HelloReceived | AuthReceived:
        """The first frame of the link, the AUTH after a CHALLENGE, or a HELLO on an open
        link (refused, not fatal)."""
        state = self.state
        if state is HandshakeState.OPEN:
            if isinstance(frame, ControlFrame) and frame.type == ControlType.HELLO:
                raise FrameError(
                    ErrorCode.ALREADY_HANDSHAKEN, "HELLO was already received on this link"
                )
            raise HandshakeStateError(
                f"the handshake is over; {_name(frame)} is not the handshake's to handle"
            )
        if state is HandshakeState.AWAIT_AUTH:
            self.state = HandshakeState.CLOSED  # until the AUTH passes every check
            auth = _checked_auth(frame)
            if self._peer_challenged:
                _check_broker_auth(auth, self._hello.name)
            self.state = HandshakeState.CHECKING
            return AuthReceived(self._hello, auth, self._signed)
        _expect(state, (HandshakeState.AWAIT_HELLO,), "receive")
        self.state = HandshakeState.CLOSED  # until the HELLO passes every check
        if not isinstance(frame, ControlFrame):
            raise FrameError(ErrorCode.NOT_HANDSHAKEN, "data frame before the HELLO handshake")
        if frame.type != ControlType.HELLO:
            raise FrameError(ErrorCode.NOT_HANDSHAKEN, "the first frame on a link must be HELLO")
        hello = frame.body
        if not isinstance(hello, Hello):
            raise FrameError(ErrorCode.PROTOCOL_ERROR, "HELLO without a HELLO body")
        _check_protocol(hello.protocol, "HELLO")
        if hello.role not in ROLES:
            raise FrameError(ErrorCode.PROTOCOL_ERROR, f"unknown HELLO role {hello.role!r}")
        _check_range("HELLO", "max_frame", hello.max_frame, 0, None)
        _check_range("HELLO", "slot", hello.slot, 0, _U16_MAX)
        _check_range("HELLO", "tag", hello.tag, 0, _U32_MAX)
        if len(hello.nonce) not in (0, NONCE_SIZE):
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"a HELLO nonce is {NONCE_SIZE} bytes or none, not {len(hello.nonce)}",
            )
        self._correlation = frame.correlation
        self._hello = hello
        self.state = HandshakeState.DECIDING
        return HelloReceived(hello, frame.correlation, hello.role)

    def challenge(self, nonce: bytes, *, broker: str = "", proof: bytes = b"") -> bytes:
        """Ask who is there before deciding: the CHALLENGE frame carrying ``nonce``
        (``NONCE_SIZE`` fresh random bytes, drawn by the caller), with the HELLO's
        correlation. To a broker's HELLO with a nonce, ``broker`` (this side's name) and
        ``proof`` (its signature of ``broker_proof_message`` of that nonce and the
        HELLO's name) prove this side first; the AUTH must then be that broker's."""
        _expect(self.state, (HandshakeState.DECIDING,), "challenge")
        if len(nonce) != NONCE_SIZE:
            raise ValueError(f"a CHALLENGE nonce is {NONCE_SIZE} bytes, not {len(nonce)}")
        if proof or broker:
            if len(proof) != SIGNATURE_SIZE or not broker:
                raise ValueError(
                    f"a broker's proof is {SIGNATURE_SIZE} bytes, with the broker's name"
                )
            if self._hello.role != ROLE_BROKER or not self._hello.nonce:
                raise ValueError("a proof answers the HELLO of a broker that sent a nonce")
        self.state = HandshakeState.AWAIT_AUTH
        self._signed = sign_in_message(nonce)
        self._peer_challenged = bool(proof)
        body = Challenge(nonce=nonce, broker=broker, proof=proof)
        return encode_control(ControlType.CHALLENGE, body, self._correlation)

    def welcome(self, body: Welcome) -> bytes:
        """Accept the HELLO (and the AUTH, if there was one): the WELCOME frame to send,
        with the HELLO's correlation."""
        _expect(self.state, _DECIDING, "welcome")
        self.state = HandshakeState.OPEN
        return encode_control(ControlType.WELCOME, body, self._correlation)

    def refuse(self, code: ErrorCode, message: str, redirect: str = "") -> bytes:
        """Refuse the HELLO (or the AUTH): the ERROR frame to send before closing the link."""
        _expect(self.state, _DECIDING, "refuse")
        self.state = HandshakeState.CLOSED
        return encode_control(
            ControlType.ERROR, Error(code=int(code), message=message, redirect=redirect)
        )


_DECIDING = (HandshakeState.DECIDING, HandshakeState.CHECKING)


def _checked_auth(frame: Frame) -> Auth:
    """The AUTH that answers a CHALLENGE, or FrameError(AUTH_FAILED) saying what came."""
    if not isinstance(frame, ControlFrame) or frame.type != ControlType.AUTH:
        raise FrameError(
            ErrorCode.AUTH_FAILED,
            f"this broker requires authentication: {_name(frame)} came where the AUTH "
            "answering its CHALLENGE was due",
        )
    auth = frame.body
    if not isinstance(auth, Auth):
        raise FrameError(ErrorCode.PROTOCOL_ERROR, "AUTH without an AUTH body")
    if bool(auth.signature) == bool(auth.token_proof):
        raise FrameError(
            ErrorCode.AUTH_FAILED,
            "an AUTH carries exactly one credential, a signature or a token's proof; "
            f"this one has {'both' if auth.token_proof else 'neither'}",
        )
    if auth.signature and len(auth.signature) != SIGNATURE_SIZE:
        raise FrameError(
            ErrorCode.AUTH_FAILED,
            f"an AUTH signature is {SIGNATURE_SIZE} bytes (Ed25519), not {len(auth.signature)}",
        )
    if auth.token_proof and len(auth.token_proof) != TOKEN_PROOF_SIZE:
        raise FrameError(
            ErrorCode.AUTH_FAILED,
            f"an AUTH token's proof is {TOKEN_PROOF_SIZE} bytes, not {len(auth.token_proof)}",
        )
    return auth


def _check_broker_auth(auth: Auth, dialler: str) -> None:
    """A broker answering a broker's CHALLENGE proves itself with its key, as the broker
    its HELLO named."""
    if not auth.signature:
        raise FrameError(
            ErrorCode.AUTH_FAILED,
            "a broker proves itself with a signature of its key, not a token's proof",
        )
    if auth.user != dialler:
        raise FrameError(
            ErrorCode.AUTH_FAILED,
            f"the AUTH is user {auth.user!r}'s, but the HELLO came from broker {dialler!r}; "
            "a broker signs in as itself (its --broker-key is for its --name)",
        )


class DiallingHandshake:
    """The handshake of a link this side dialled: a connector, an operator, or a broker
    dialling a peer. ``credential`` answers a CHALLENGE; without one, a broker that asks
    for it refuses the link. ``verifier`` (a broker whose mesh trusts only its brokers)
    checks the other broker's proof before this side answers anything: then ``hello``
    carries a nonce and ``credential`` is the broker's key."""

    def __init__(
        self,
        hello: Hello,
        correlation: int = 1,
        credential: Credential | None = None,
        verifier: PeerVerifier | None = None,
    ) -> None:
        if verifier is not None and (len(hello.nonce) != NONCE_SIZE or credential is None):
            raise ValueError(
                f"a verifying broker's HELLO carries a {NONCE_SIZE}-byte nonce, and it has a "
                "credential to answer with"
            )
        self.state = HandshakeState.IDLE
        self._hello = hello
        self._correlation = correlation
        self._credential = credential
        self._verifier = verifier
        self._proved = ""  # the broker whose proof passed

    def hello(self) -> bytes:
        """The HELLO frame to send first."""
        _expect(self.state, (HandshakeState.IDLE,), "hello")
        self.state = HandshakeState.AWAIT_WELCOME
        return encode_control(ControlType.HELLO, self._hello, self._correlation)

    def receive(self, frame: Frame) -> Welcomed | HelloRefused | Challenged:
        """The answer to the HELLO, or to the AUTH."""
        state = self.state
        _expect(state, (HandshakeState.AWAIT_WELCOME, HandshakeState.AUTH_SENT), "receive")
        self.state = HandshakeState.CLOSED  # until the answer passes every check
        if isinstance(frame, ControlFrame):
            body = frame.body
            if frame.type == ControlType.ERROR and isinstance(body, Error):
                return HelloRefused(body.code, body.message, body.redirect)
            if frame.type == ControlType.BYE and isinstance(body, Bye):
                return HelloRefused(
                    ErrorCode.SHUTTING_DOWN, f"the broker said goodbye: {body.reason}", ""
                )
            if frame.type == ControlType.WELCOME and isinstance(body, Welcome):
                self._check_welcome(frame.correlation, body)
                if self._verifier is not None and not self._proved:
                    return _unproven(
                        f"broker {body.broker!r} WELCOMEd this broker without proving itself "
                        "(it does not authenticate its peers); give it --broker-key and the "
                        "mesh's [[brokers]]"
                    )
                if self._proved and body.broker != self._proved:
                    raise FrameError(
                        ErrorCode.PROTOCOL_ERROR,
                        f"the WELCOME names broker {body.broker!r}; the CHALLENGE proved "
                        f"{self._proved!r}",
                    )
                self.state = HandshakeState.OPEN
                return Welcomed(body)
            if (
                frame.type == ControlType.CHALLENGE
                and isinstance(body, Challenge)
                and state is HandshakeState.AWAIT_WELCOME
            ):
                return self._answer(frame.correlation, body)
        expected = "WELCOME" if state is HandshakeState.AUTH_SENT else "WELCOME or CHALLENGE"
        raise FrameError(ErrorCode.PROTOCOL_ERROR, f"expected {expected}, got {_name(frame)}")

    def _answer(self, correlation: int, challenge: Challenge) -> Challenged | HelloRefused:
        self._check_correlation("CHALLENGE", correlation)
        if len(challenge.nonce) != NONCE_SIZE:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"a CHALLENGE nonce is {NONCE_SIZE} bytes, not {len(challenge.nonce)}",
            )
        if len(challenge.proof) not in (0, SIGNATURE_SIZE):
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"a CHALLENGE proof is {SIGNATURE_SIZE} bytes or none, not {len(challenge.proof)}",
            )
        if self._verifier is not None:
            hello = self._hello
            signed = broker_proof_message(hello.nonce, hello.name)
            if not challenge.proof or not challenge.broker:
                return _unproven(
                    "the broker asked this broker to sign in without proving itself first "
                    "(its CHALLENGE has no proof); give it --broker-key"
                )
            if not self._verifier.verify(challenge.broker, signed, challenge.proof):
                return _unproven(
                    f"the broker calling itself {challenge.broker!r} did not prove it: "
                    "no broker of that name with that key is in this broker's [[brokers]]"
                )
            self._proved = challenge.broker
        if self._credential is None:
            return HelloRefused(
                ErrorCode.AUTH_FAILED,
                "the broker requires authentication, and no credentials were given",
                "",
                local=True,
            )
        auth = self._credential.answer(sign_in_message(challenge.nonce))
        self.state = HandshakeState.AUTH_SENT
        return Challenged(encode_control(ControlType.AUTH, auth, self._correlation))

    def _check_correlation(self, what: str, correlation: int) -> None:
        if correlation != self._correlation:
            raise FrameError(
                ErrorCode.PROTOCOL_ERROR,
                f"{what} with correlation {correlation} does not answer the HELLO "
                f"(correlation {self._correlation})",
            )

    def _check_welcome(self, correlation: int, welcome: Welcome) -> None:
        self._check_correlation("WELCOME", correlation)
        _check_protocol(welcome.protocol, "WELCOME")
        # The accepting side never answers with less than the smallest limit (rule 2 of
        # docs/protocol.md §2); a smaller one would leave this side unable to send.
        _check_range("WELCOME", "max_frame", welcome.max_frame, MIN_MAX_FRAME, None)
        _check_range("WELCOME", "slot", welcome.slot, 0, _U16_MAX)
        _check_range("WELCOME", "tag", welcome.tag, 0, _U32_MAX)
        _check_range("WELCOME", "trace_every", welcome.trace_every, 0, _U32_MAX)
        for info in welcome.brokers:
            _check_range("WELCOME", "brokers.slot", info.slot, 0, _U16_MAX)
            _check_range("WELCOME", "brokers.connectors", info.connectors, 0, _U32_MAX)
            _check_range("WELCOME", "brokers.capacity", info.capacity, 0, _U32_MAX)


def _unproven(message: str) -> HelloRefused:
    """This broker refuses the link itself, having sent nothing since its HELLO."""
    return HelloRefused(ErrorCode.AUTH_FAILED, message, "", local=True)


def _expect(state: HandshakeState, wanted: tuple[HandshakeState, ...], call: str) -> None:
    if state not in wanted:
        names = " or ".join(w.name for w in wanted)
        raise HandshakeStateError(
            f"{call}() needs the handshake in state {names}; it is {state.name}"
        )


def _check_protocol(protocol: int, what: str) -> None:
    if protocol != PROTOCOL_VERSION:
        raise FrameError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"the peer's {what} speaks protocol {protocol}; this side speaks {PROTOCOL_VERSION}",
        )


def _check_range(what: str, field: str, value: int, low: int, high: int | None) -> None:
    if value < low or (high is not None and value > high):
        bounds = f"{low}..{high}" if high is not None else f"at least {low}"
        raise FrameError(
            ErrorCode.PROTOCOL_ERROR, f"{what} {field} {value} is out of range ({bounds})"
        )


def _name(frame: Frame) -> str:
    if isinstance(frame, ControlFrame):
        return describe(frame.type)
    return "a data frame"
