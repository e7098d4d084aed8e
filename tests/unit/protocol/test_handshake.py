"""The sans-IO handshake: every transition, every refusal, every bad input.

No sockets: frames are fed the way a link would feed them -- whole, one byte at a
time through ``FrameDecoder``, and with the next frames right behind the handshake
frame (which stay in the decoder for the caller) -- and hypothesis throws arbitrary
bodies and frames at both sides, which may only ever answer with ``FrameError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshbus.protocol.codec import (
    ControlFrame,
    DataFrame,
    Frame,
    FrameDecoder,
    FrameError,
    decode_frame,
    encode_control,
    encode_data,
)
from meshbus.protocol.control import (
    MAX_SESSION,
    MAX_USER_NAME,
    NONCE_SIZE,
    ROLE_BROKER,
    ROLE_CONNECTOR,
    ROLE_OPERATOR,
    SIGNATURE_SIZE,
    TOKEN_PROOF_SIZE,
    Auth,
    BrokerInfo,
    Brokers,
    Bye,
    Challenge,
    Empty,
    Error,
    Hello,
    Welcome,
)
from meshbus.protocol.handshake import (
    BROKER_PROOF_CONTEXT,
    SIGN_IN_CONTEXT,
    AcceptingHandshake,
    AuthReceived,
    Challenged,
    DiallingHandshake,
    HandshakeState,
    HandshakeStateError,
    HelloReceived,
    HelloRefused,
    Welcomed,
    broker_proof_message,
    negotiated_max_frame,
    sign_in_message,
)
from meshbus.protocol.layout import MIN_MAX_FRAME, ControlType, ErrorCode

SESSION = bytes(range(16))
ADDRESS = bytes([1]) + b"game01" + bytes(5) + (1).to_bytes(4, "big")


def hello_frame(correlation: int = 7, **fields: object) -> ControlFrame:
    return ControlFrame(ControlType.HELLO, Hello(**fields), correlation)  # type: ignore[arg-type]


def welcome_frame(correlation: int = 1, **fields: object) -> ControlFrame:
    return ControlFrame(ControlType.WELCOME, Welcome(**fields), correlation)  # type: ignore[arg-type]


def only_frame(data: bytes) -> Frame:
    decoder = FrameDecoder()
    decoder.feed(data)
    frame = decoder.next_frame()
    assert frame is not None
    assert decoder.buffered == 0
    return frame


def deciding(hello: Hello | None = None, correlation: int = 7) -> AcceptingHandshake:
    accepting = AcceptingHandshake()
    accepting.receive(ControlFrame(ControlType.HELLO, hello or Hello(), correlation))
    return accepting


def awaiting_welcome(correlation: int = 1) -> DiallingHandshake:
    dialling = DiallingHandshake(Hello(name="game01", session=SESSION), correlation)
    dialling.hello()
    return dialling


# -- the accepting side ------------------------------------------------------------------


@pytest.mark.parametrize("role", [ROLE_CONNECTOR, ROLE_OPERATOR, ROLE_BROKER])
def test_a_valid_hello_is_taken_and_the_decision_is_the_callers(role: str) -> None:
    accepting = AcceptingHandshake()
    assert accepting.state is HandshakeState.AWAIT_HELLO
    hello = Hello(role=role, name="x", max_frame=4096, session=SESSION, slot=3, tag=9)
    event = accepting.receive(ControlFrame(ControlType.HELLO, hello, 42))
    assert event == HelloReceived(hello, 42, role)
    assert accepting.state is HandshakeState.DECIDING


def test_welcome_opens_the_link_and_answers_with_the_hellos_correlation() -> None:
    accepting = deciding(correlation=42)
    body = Welcome(broker="b1", slot=2, max_frame=4096, trace_every=10)
    frame = only_frame(accepting.welcome(body))
    assert frame == ControlFrame(ControlType.WELCOME, body, 42)
    assert accepting.state is HandshakeState.OPEN


@pytest.mark.parametrize(
    ("code", "message", "redirect"),
    [
        (ErrorCode.REDIRECT, "broker b1 is full (50 connectors)", "127.0.0.1:7401"),
        (ErrorCode.REDIRECT, "broker b1 is draining", ""),
        (ErrorCode.DUPLICATE_LINK, "b1 and b2 dialled each other", ""),
        (ErrorCode.NAME_IN_USE, "a broker named 'b1' is already in the mesh", ""),
    ],
)
def test_refuse_closes_with_an_error_frame_of_correlation_0(
    code: ErrorCode, message: str, redirect: str
) -> None:
    accepting = deciding(correlation=42)
    frame = only_frame(accepting.refuse(code, message, redirect))
    assert frame == ControlFrame(
        ControlType.ERROR, Error(code=code, message=message, redirect=redirect), 0
    )
    assert accepting.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    ("first", "code"),
    [
        (DataFrame(dst=ADDRESS, src=ADDRESS, payload=b"x"), ErrorCode.NOT_HANDSHAKEN),
        (ControlFrame(ControlType.PING, Empty(), 1), ErrorCode.NOT_HANDSHAKEN),
        (welcome_frame(), ErrorCode.NOT_HANDSHAKEN),
        (ControlFrame(999, None, 1), ErrorCode.NOT_HANDSHAKEN),
        (ControlFrame(ControlType.HELLO, Empty(), 1), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(protocol=2), ErrorCode.UNSUPPORTED_VERSION),
        (hello_frame(protocol=0), ErrorCode.UNSUPPORTED_VERSION),
        (hello_frame(role="admin"), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(role=""), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(max_frame=-1), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(slot=-1), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(slot=0x10000), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(tag=-1), ErrorCode.PROTOCOL_ERROR),
        (hello_frame(tag=1 << 32), ErrorCode.PROTOCOL_ERROR),
    ],
    ids=lambda v: getattr(v, "name", None) or type(v).__name__,
)
def test_a_bad_first_frame_fails_before_anything_is_sent_back(
    first: Frame, code: ErrorCode
) -> None:
    accepting = AcceptingHandshake()
    with pytest.raises(FrameError) as raised:
        accepting.receive(first)
    assert raised.value.code == code
    assert accepting.state is HandshakeState.CLOSED
    # Nothing can be sent back but the caller's own ERROR: there is no WELCOME to give.
    with pytest.raises(HandshakeStateError):
        accepting.welcome(Welcome())
    with pytest.raises(HandshakeStateError):
        accepting.refuse(ErrorCode.REDIRECT, "no")


def test_the_edges_of_every_range_are_accepted() -> None:
    accepting = AcceptingHandshake()
    event = accepting.receive(hello_frame(max_frame=0, slot=0xFFFF, tag=0xFFFFFFFF))
    assert (event.hello.max_frame, event.hello.slot, event.hello.tag) == (0, 0xFFFF, 0xFFFFFFFF)


def test_a_second_hello_on_an_open_link_is_refused_and_the_link_stays_open() -> None:
    accepting = deciding()
    accepting.welcome(Welcome())
    for _ in range(2):
        with pytest.raises(FrameError) as raised:
            accepting.receive(hello_frame(correlation=50))
        assert raised.value.code == ErrorCode.ALREADY_HANDSHAKEN
        assert accepting.state is HandshakeState.OPEN


@pytest.mark.parametrize(
    "misuse",
    [
        lambda a: a.welcome(Welcome()),  # no HELLO yet
        lambda a: a.refuse(ErrorCode.REDIRECT, "no"),
        lambda a: (a.receive(hello_frame()), a.receive(hello_frame())),  # decide first
        lambda a: (a.receive(hello_frame()), a.welcome(Welcome()), a.welcome(Welcome())),
        lambda a: (
            a.receive(hello_frame()),
            a.welcome(Welcome()),
            a.refuse(ErrorCode.REDIRECT, ""),
        ),
        lambda a: (
            a.receive(hello_frame()),
            a.refuse(ErrorCode.REDIRECT, ""),
            a.receive(hello_frame()),
        ),
        lambda a: (  # after the handshake, other frames are not the handshake's
            a.receive(hello_frame()),
            a.welcome(Welcome()),
            a.receive(ControlFrame(ControlType.PING, Empty(), 1)),
        ),
    ],
)
def test_accepting_calls_in_the_wrong_state_are_a_bug(
    misuse: Callable[[AcceptingHandshake], object],
) -> None:
    with pytest.raises(HandshakeStateError):
        misuse(AcceptingHandshake())


# -- the dialling side -------------------------------------------------------------------


def test_hello_is_the_first_frame_with_the_given_correlation() -> None:
    hello = Hello(role=ROLE_CONNECTOR, name="game01", max_frame=4096, session=SESSION, synced=True)
    dialling = DiallingHandshake(hello, correlation=5)
    assert dialling.state is HandshakeState.IDLE
    assert only_frame(dialling.hello()) == ControlFrame(ControlType.HELLO, hello, 5)
    assert dialling.state is HandshakeState.AWAIT_WELCOME


def test_a_welcome_that_answers_the_hello_opens_the_link() -> None:
    dialling = awaiting_welcome(correlation=5)
    body = Welcome(
        broker="b1",
        slot=0xFFFF,
        max_frame=MIN_MAX_FRAME,
        tag=0xFFFFFFFF,
        brokers=[BrokerInfo(name="b1", address="127.0.0.1:7400", slot=1)],
        trace_every=100,
    )
    assert dialling.receive(ControlFrame(ControlType.WELCOME, body, 5)) == Welcomed(body)
    assert dialling.state is HandshakeState.OPEN


@pytest.mark.parametrize(
    ("answer", "refused"),
    [
        (
            Error(code=ErrorCode.REDIRECT, message="full", redirect="127.0.0.1:7401"),
            HelloRefused(ErrorCode.REDIRECT, "full", "127.0.0.1:7401"),
        ),
        (
            Error(code=ErrorCode.NAME_IN_USE, message="mine"),
            HelloRefused(ErrorCode.NAME_IN_USE, "mine", ""),
        ),
        (
            Error(code=ErrorCode.UNSUPPORTED_VERSION, message="protocol 2"),
            HelloRefused(ErrorCode.UNSUPPORTED_VERSION, "protocol 2", ""),
        ),
        (
            Bye(reason="broker shutting down"),
            HelloRefused(
                ErrorCode.SHUTTING_DOWN, "the broker said goodbye: broker shutting down", ""
            ),
        ),
    ],
)
@pytest.mark.parametrize("correlation", [0, 1])
def test_an_error_or_a_goodbye_refuses_the_link(
    answer: Error | Bye, refused: HelloRefused, correlation: int
) -> None:
    dialling = awaiting_welcome()
    ctype = ControlType.ERROR if isinstance(answer, Error) else ControlType.BYE
    assert dialling.receive(ControlFrame(ctype, answer, correlation)) == refused
    assert dialling.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        (DataFrame(dst=ADDRESS, src=ADDRESS, payload=b"x"), ErrorCode.PROTOCOL_ERROR),
        (ControlFrame(ControlType.PONG, Empty(), 1), ErrorCode.PROTOCOL_ERROR),
        (ControlFrame(ControlType.BROKERS, Brokers(), 0), ErrorCode.PROTOCOL_ERROR),
        (ControlFrame(ControlType.HELLO, Hello(), 1), ErrorCode.PROTOCOL_ERROR),
        (ControlFrame(999, None, 1), ErrorCode.PROTOCOL_ERROR),
        (ControlFrame(ControlType.WELCOME, Empty(), 1), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(correlation=2), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(correlation=0), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(protocol=2), ErrorCode.UNSUPPORTED_VERSION),
        (welcome_frame(max_frame=MIN_MAX_FRAME - 1), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(max_frame=0), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(slot=-1), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(slot=0x10000), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(tag=-1), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(tag=1 << 32), ErrorCode.PROTOCOL_ERROR),
        (welcome_frame(trace_every=-1), ErrorCode.PROTOCOL_ERROR),
        (
            welcome_frame(brokers=[BrokerInfo(name="b", address="h:1", slot=0x10000)]),
            ErrorCode.PROTOCOL_ERROR,
        ),
        (
            welcome_frame(brokers=[BrokerInfo(name="b", address="h:1", connectors=-1)]),
            ErrorCode.PROTOCOL_ERROR,
        ),
        (
            welcome_frame(brokers=[BrokerInfo(name="b", address="h:1", capacity=1 << 32)]),
            ErrorCode.PROTOCOL_ERROR,
        ),
    ],
)
def test_anything_but_a_valid_answer_is_a_protocol_error(answer: Frame, code: ErrorCode) -> None:
    dialling = awaiting_welcome(correlation=1)
    with pytest.raises(FrameError) as raised:
        dialling.receive(answer)
    assert raised.value.code == code
    assert dialling.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    "misuse",
    [
        lambda d: d.receive(welcome_frame()),  # before the HELLO went out
        lambda d: (d.hello(), d.hello()),
        lambda d: (d.hello(), d.receive(welcome_frame()), d.receive(welcome_frame())),
        lambda d: (d.hello(), d.receive(welcome_frame()), d.hello()),
        lambda d: (
            d.hello(),
            d.receive(ControlFrame(ControlType.ERROR, Error(code=15), 0)),
            d.receive(welcome_frame()),
        ),
    ],
)
def test_dialling_calls_in_the_wrong_state_are_a_bug(
    misuse: Callable[[DiallingHandshake], object],
) -> None:
    with pytest.raises(HandshakeStateError):
        misuse(DiallingHandshake(Hello(), correlation=1))


# -- the sign-in: CHALLENGE and AUTH -------------------------------------------------------

NONCE = bytes(range(100, 100 + NONCE_SIZE))
SIGNATURE = bytes(range(SIGNATURE_SIZE))
TOKEN_PROOF = bytes(range(50, 50 + TOKEN_PROOF_SIZE))


class RecordingCredential:
    """A credential that answers with a fixed AUTH and keeps what it was asked to sign (the
    real signing is meshbus.Credentials', tested in test_auth.py)."""

    def __init__(self, auth: Auth) -> None:
        self.auth = auth
        self.signed: list[bytes] = []

    def answer(self, to_sign: bytes) -> Auth:
        self.signed.append(to_sign)
        return self.auth


def auth_frame(correlation: int = 7, **fields: object) -> ControlFrame:
    return ControlFrame(ControlType.AUTH, Auth(**fields), correlation)  # type: ignore[arg-type]


def awaiting_auth(correlation: int = 7) -> AcceptingHandshake:
    accepting = deciding(Hello(name="game01"), correlation)
    accepting.challenge(NONCE)
    return accepting


def test_a_challenge_carries_the_nonce_with_the_hellos_correlation() -> None:
    accepting = deciding(correlation=42)
    frame = only_frame(accepting.challenge(NONCE))
    assert frame == ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 42)
    assert accepting.state is HandshakeState.AWAIT_AUTH


@pytest.mark.parametrize(
    "auth",
    [Auth(user="alice", signature=SIGNATURE), Auth(user="bob", token_proof=TOKEN_PROOF)],
    ids=["key", "token"],
)
def test_an_auth_is_handed_over_with_the_context_and_nonce_it_must_sign(auth: Auth) -> None:
    accepting = awaiting_auth(correlation=7)
    event = accepting.receive(ControlFrame(ControlType.AUTH, auth, 7))
    assert event == AuthReceived(Hello(name="game01"), auth, SIGN_IN_CONTEXT + NONCE)
    assert event.signed != NONCE  # never the bare nonce
    assert accepting.state is HandshakeState.CHECKING


def test_after_the_check_the_welcome_opens_or_the_refusal_closes() -> None:
    accepting = awaiting_auth(correlation=9)
    accepting.receive(auth_frame(user="alice", signature=SIGNATURE))
    frame = only_frame(accepting.welcome(Welcome(broker="b1")))
    assert frame == ControlFrame(ControlType.WELCOME, Welcome(broker="b1"), 9)
    assert accepting.state is HandshakeState.OPEN

    refusing = awaiting_auth(correlation=9)
    refusing.receive(auth_frame(user="alice", token_proof=TOKEN_PROOF))
    frame = only_frame(refusing.refuse(ErrorCode.AUTH_FAILED, "no"))
    assert frame == ControlFrame(ControlType.ERROR, Error(code=ErrorCode.AUTH_FAILED, message="no"))
    assert refusing.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (DataFrame(dst=ADDRESS, src=ADDRESS, payload=b"x"), ErrorCode.AUTH_FAILED),
        (ControlFrame(ControlType.PING, Empty(), 8), ErrorCode.AUTH_FAILED),
        (hello_frame(correlation=8), ErrorCode.AUTH_FAILED),
        (ControlFrame(ControlType.REGISTER, None, 8), ErrorCode.AUTH_FAILED),
        (ControlFrame(ControlType.AUTH, None, 8), ErrorCode.PROTOCOL_ERROR),
        (auth_frame(user="alice"), ErrorCode.AUTH_FAILED),  # no credential
        (
            auth_frame(user="alice", signature=SIGNATURE, token_proof=TOKEN_PROOF),
            ErrorCode.AUTH_FAILED,
        ),
        (auth_frame(user="alice", signature=SIGNATURE[:-1]), ErrorCode.AUTH_FAILED),
        (auth_frame(user="alice", token_proof=TOKEN_PROOF[:-1]), ErrorCode.AUTH_FAILED),
    ],
    ids=[
        "data",
        "ping",
        "hello",
        "register",
        "no-body",
        "neither",
        "both",
        "short-signature",
        "short-proof",
    ],
)
def test_after_a_challenge_only_a_valid_auth_is_taken(frame: Frame, code: ErrorCode) -> None:
    accepting = awaiting_auth()
    with pytest.raises(FrameError) as raised:
        accepting.receive(frame)
    assert raised.value.code == code
    assert accepting.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    "misuse",
    [
        lambda a: a.challenge(NONCE),  # before the HELLO
        lambda a: (a.receive(hello_frame()), a.challenge(NONCE), a.challenge(NONCE)),
        lambda a: (a.receive(hello_frame()), a.challenge(NONCE), a.welcome(Welcome())),
        lambda a: (
            a.receive(hello_frame()),
            a.challenge(NONCE),
            a.refuse(ErrorCode.AUTH_FAILED, ""),
        ),
        lambda a: (a.receive(hello_frame()), a.welcome(Welcome()), a.challenge(NONCE)),
        lambda a: (
            a.receive(hello_frame()),
            a.challenge(NONCE),
            a.receive(auth_frame(user="u", token_proof=TOKEN_PROOF)),
            a.challenge(NONCE),
        ),
    ],
)
def test_sign_in_calls_in_the_wrong_state_are_a_bug(
    misuse: Callable[[AcceptingHandshake], object],
) -> None:
    with pytest.raises(HandshakeStateError):
        misuse(AcceptingHandshake())


def test_a_nonce_of_the_wrong_size_is_a_bug_of_the_caller() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        deciding().challenge(NONCE[:-1])


def test_a_challenged_side_with_a_credential_signs_the_context_and_the_nonce() -> None:
    credential = RecordingCredential(Auth(user="alice", signature=SIGNATURE))
    dialling = DiallingHandshake(Hello(), correlation=5, credential=credential)
    dialling.hello()
    event = dialling.receive(ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 5))
    assert isinstance(event, Challenged)
    assert only_frame(event.reply) == ControlFrame(ControlType.AUTH, credential.auth, 5)
    assert credential.signed == [sign_in_message(NONCE)]
    assert dialling.state is HandshakeState.AUTH_SENT
    assert dialling.receive(welcome_frame(correlation=5)) == Welcomed(Welcome())
    assert dialling.state is HandshakeState.OPEN


def test_a_refused_auth_refuses_the_link() -> None:
    credential = RecordingCredential(Auth(user="alice", token_proof=TOKEN_PROOF))
    dialling = DiallingHandshake(Hello(), correlation=1, credential=credential)
    dialling.hello()
    dialling.receive(ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 1))
    refusal = ControlFrame(ControlType.ERROR, Error(code=ErrorCode.AUTH_FAILED, message="no"))
    assert dialling.receive(refusal) == HelloRefused(ErrorCode.AUTH_FAILED, "no", "")
    assert dialling.state is HandshakeState.CLOSED


def test_a_challenged_side_without_a_credential_refuses_the_link_itself() -> None:
    dialling = awaiting_welcome(correlation=1)
    event = dialling.receive(ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 1))
    assert isinstance(event, HelloRefused)
    assert (event.code, event.local) == (ErrorCode.AUTH_FAILED, True)
    assert "requires authentication" in event.message
    assert dialling.state is HandshakeState.CLOSED


def test_a_credential_is_not_used_when_the_broker_welcomes_without_a_challenge() -> None:
    credential = RecordingCredential(Auth(user="alice", token_proof=TOKEN_PROOF))
    dialling = DiallingHandshake(Hello(), correlation=1, credential=credential)
    dialling.hello()
    assert isinstance(dialling.receive(welcome_frame()), Welcomed)
    assert credential.signed == []


@pytest.mark.parametrize(
    "answer",
    [
        ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 2),  # another correlation
        ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE[:8]), 1),
        ControlFrame(ControlType.CHALLENGE, None, 1),
    ],
    ids=["correlation", "short-nonce", "no-body"],
)
def test_a_bad_challenge_is_a_protocol_error(answer: Frame) -> None:
    credential = RecordingCredential(Auth(user="alice", token_proof=TOKEN_PROOF))
    dialling = DiallingHandshake(Hello(), correlation=1, credential=credential)
    dialling.hello()
    with pytest.raises(FrameError) as raised:
        dialling.receive(answer)
    assert raised.value.code == ErrorCode.PROTOCOL_ERROR
    assert credential.signed == []


def test_a_second_challenge_after_the_auth_is_a_protocol_error() -> None:
    credential = RecordingCredential(Auth(user="alice", token_proof=TOKEN_PROOF))
    dialling = DiallingHandshake(Hello(), correlation=1, credential=credential)
    dialling.hello()
    challenge = ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 1)
    dialling.receive(challenge)
    with pytest.raises(FrameError, match="expected WELCOME, got CHALLENGE"):
        dialling.receive(challenge)
    assert dialling.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    ("ctype", "fields"),
    [
        (ControlType.CHALLENGE, {"nonce": bytes(NONCE_SIZE - 1)}),
        (ControlType.CHALLENGE, {"nonce": bytes(NONCE_SIZE + 1)}),
        (ControlType.CHALLENGE, {}),
        (ControlType.AUTH, {"user": "", "token_proof": TOKEN_PROOF}),
        (ControlType.AUTH, {"user": "u" * (MAX_USER_NAME + 1), "token_proof": TOKEN_PROOF}),
        (ControlType.AUTH, {"user": "u", "signature": bytes(SIGNATURE_SIZE + 1)}),
        (ControlType.AUTH, {"user": "u", "token_proof": bytes(TOKEN_PROOF_SIZE + 1)}),
        (ControlType.AUTH, {"token_proof": TOKEN_PROOF}),
        (ControlType.CHALLENGE, {"nonce": NONCE, "proof": bytes(SIGNATURE_SIZE + 1)}),
        (ControlType.CHALLENGE, {"nonce": NONCE, "broker": "b" * (MAX_USER_NAME + 1)}),
        (ControlType.HELLO, {"nonce": bytes(NONCE_SIZE + 1)}),
        (ControlType.HELLO, {"session": bytes(MAX_SESSION + 1)}),
    ],
)
def test_sign_in_bodies_out_of_bounds_are_refused_at_decode(
    ctype: ControlType, fields: dict[str, object]
) -> None:
    with pytest.raises(FrameError) as raised:
        only_frame(_control_bytes(ctype, msgspec.msgpack.encode(fields), 1))
    assert raised.value.code == ErrorCode.PROTOCOL_ERROR


# -- brokers proving themselves to each other (mesh trust) -------------------------------

DIALLER_NONCE = bytes(range(200, 200 + NONCE_SIZE))
PROOF = bytes(range(1, 1 + SIGNATURE_SIZE))


def broker_hello(**fields: object) -> Hello:
    return Hello(role=ROLE_BROKER, name="b", nonce=DIALLER_NONCE, **fields)  # type: ignore[arg-type]


class RecordingVerifier:
    """A verifier that takes the proofs of ``trusted`` and keeps what it was asked."""

    def __init__(self, trusted: str = "a") -> None:
        self.trusted = trusted
        self.asked: list[tuple[str, bytes, bytes]] = []

    def verify(self, broker: str, signed: bytes, proof: bytes) -> bool:
        self.asked.append((broker, signed, proof))
        return broker == self.trusted and proof == PROOF


def peer_challenged(correlation: int = 7) -> AcceptingHandshake:
    accepting = deciding(broker_hello(), correlation)
    accepting.challenge(NONCE, broker="a", proof=PROOF)
    return accepting


def verifying(
    verifier: RecordingVerifier | None = None,
) -> tuple[DiallingHandshake, RecordingCredential, RecordingVerifier]:
    credential = RecordingCredential(Auth(user="b", signature=SIGNATURE))
    verifier = verifier or RecordingVerifier()
    dialling = DiallingHandshake(broker_hello(), 1, credential, verifier)
    dialling.hello()
    return dialling, credential, verifier


def challenge_frame(correlation: int = 1, **fields: object) -> ControlFrame:
    return ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE, **fields), correlation)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, NONCE_SIZE - 1])
def test_a_hello_nonce_is_empty_or_full_size(size: int) -> None:
    accepting = AcceptingHandshake()
    with pytest.raises(FrameError, match="nonce") as raised:
        accepting.receive(hello_frame(role=ROLE_BROKER, nonce=bytes(size)))
    assert raised.value.code == ErrorCode.PROTOCOL_ERROR
    assert accepting.state is HandshakeState.CLOSED


def test_a_brokers_challenge_carries_its_name_and_its_proof() -> None:
    accepting = deciding(broker_hello(), correlation=42)
    frame = only_frame(accepting.challenge(NONCE, broker="a", proof=PROOF))
    assert frame == ControlFrame(
        ControlType.CHALLENGE, Challenge(nonce=NONCE, broker="a", proof=PROOF), 42
    )
    assert accepting.state is HandshakeState.AWAIT_AUTH


def test_the_proof_signs_its_own_context_the_nonce_and_the_dialler() -> None:
    signed = broker_proof_message(DIALLER_NONCE, "b")
    assert signed == BROKER_PROOF_CONTEXT + DIALLER_NONCE + b"b"
    assert BROKER_PROOF_CONTEXT != SIGN_IN_CONTEXT
    assert not signed.startswith(SIGN_IN_CONTEXT)
    assert not sign_in_message(DIALLER_NONCE).startswith(BROKER_PROOF_CONTEXT)


@pytest.mark.parametrize(
    ("hello", "broker", "proof"),
    [
        (Hello(name="game01"), "a", PROOF),  # a connector's HELLO
        (Hello(role=ROLE_BROKER, name="b"), "a", PROOF),  # a broker's, without a nonce
        (broker_hello(), "a", PROOF[:-1]),
        (broker_hello(), "", PROOF),
        (broker_hello(), "a", b""),
    ],
    ids=["connector", "no-nonce", "short-proof", "no-name", "name-without-proof"],
)
def test_a_proof_that_answers_no_brokers_nonce_is_a_bug_of_the_caller(
    hello: Hello, broker: str, proof: bytes
) -> None:
    accepting = deciding(hello)
    with pytest.raises(ValueError, match="proof"):
        accepting.challenge(NONCE, broker=broker, proof=proof)
    assert accepting.state is HandshakeState.DECIDING


def test_after_a_brokers_challenge_the_helloing_brokers_signature_is_handed_over() -> None:
    accepting = peer_challenged(correlation=7)
    auth = Auth(user="b", signature=SIGNATURE)
    event = accepting.receive(ControlFrame(ControlType.AUTH, auth, 7))
    assert event == AuthReceived(broker_hello(), auth, sign_in_message(NONCE))
    assert accepting.state is HandshakeState.CHECKING


@pytest.mark.parametrize(
    ("auth", "words"),
    [
        (Auth(user="b", token_proof=TOKEN_PROOF), "not a token.s proof"),
        (Auth(user="c", signature=SIGNATURE), "broker 'b'"),
    ],
    ids=["token", "another-name"],
)
def test_after_a_brokers_challenge_only_that_brokers_signature_is_taken(
    auth: Auth, words: str
) -> None:
    accepting = peer_challenged()
    with pytest.raises(FrameError, match=words) as raised:
        accepting.receive(ControlFrame(ControlType.AUTH, auth, 7))
    assert raised.value.code == ErrorCode.AUTH_FAILED
    assert accepting.state is HandshakeState.CLOSED


def test_a_verifying_broker_checks_the_proof_then_signs_in_then_takes_the_welcome() -> None:
    dialling, credential, verifier = verifying()
    event = dialling.receive(challenge_frame(broker="a", proof=PROOF))
    assert isinstance(event, Challenged)
    assert verifier.asked == [("a", broker_proof_message(DIALLER_NONCE, "b"), PROOF)]
    assert credential.signed == [sign_in_message(NONCE)]
    assert only_frame(event.reply) == ControlFrame(ControlType.AUTH, credential.auth, 1)
    assert dialling.receive(welcome_frame(broker="a")) == Welcomed(Welcome(broker="a"))
    assert dialling.state is HandshakeState.OPEN


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (challenge_frame(broker="a", proof=bytes(SIGNATURE_SIZE)), "did not prove it"),
        (challenge_frame(broker="z", proof=PROOF), "'z' did not prove it"),
        (challenge_frame(), "has no proof"),
        (challenge_frame(broker="a"), "has no proof"),
        (welcome_frame(broker="a"), "without proving itself"),
    ],
    ids=["bad-proof", "unknown-broker", "no-proof", "name-only", "welcome-at-once"],
)
def test_a_verifying_broker_refuses_an_unproven_broker_and_sends_nothing(
    answer: Frame, words: str
) -> None:
    dialling, credential, _ = verifying()
    event = dialling.receive(answer)
    assert isinstance(event, HelloRefused)
    assert (event.code, event.local) == (ErrorCode.AUTH_FAILED, True)
    assert words in event.message
    assert credential.signed == []  # no AUTH was made
    assert dialling.state is HandshakeState.CLOSED


def test_a_welcome_naming_another_broker_than_the_one_proved_is_a_protocol_error() -> None:
    dialling, _, _ = verifying()
    dialling.receive(challenge_frame(broker="a", proof=PROOF))
    with pytest.raises(FrameError, match="proved 'a'") as raised:
        dialling.receive(welcome_frame(broker="c"))
    assert raised.value.code == ErrorCode.PROTOCOL_ERROR
    assert dialling.state is HandshakeState.CLOSED


def test_a_proof_of_the_wrong_size_is_a_protocol_error_verifier_or_not() -> None:
    answer = challenge_frame(broker="a", proof=PROOF[:-1])
    for dialling in (verifying()[0], awaiting_welcome(correlation=1)):
        with pytest.raises(FrameError, match="proof") as raised:
            dialling.receive(answer)
        assert raised.value.code == ErrorCode.PROTOCOL_ERROR


def test_a_connector_answers_a_challenge_with_a_proof_as_any_other() -> None:
    credential = RecordingCredential(Auth(user="alice", signature=SIGNATURE))
    dialling = DiallingHandshake(Hello(), correlation=1, credential=credential)
    dialling.hello()
    assert isinstance(dialling.receive(challenge_frame(broker="a", proof=PROOF)), Challenged)
    assert credential.signed == [sign_in_message(NONCE)]


@pytest.mark.parametrize(
    ("hello", "credential"),
    [
        (
            Hello(role=ROLE_BROKER, name="b"),
            RecordingCredential(Auth(user="b", token_proof=TOKEN_PROOF)),
        ),
        (broker_hello(), None),
    ],
    ids=["no-nonce", "no-credential"],
)
def test_a_verifier_needs_a_nonce_and_a_credential(
    hello: Hello, credential: RecordingCredential | None
) -> None:
    with pytest.raises(ValueError, match="nonce"):
        DiallingHandshake(hello, 1, credential, RecordingVerifier())


# -- over bytes: whole, byte by byte, with what follows ---------------------------------


def fed_whole(data: bytes, decoder: FrameDecoder) -> Iterator[Frame]:
    decoder.feed(data)
    while (frame := decoder.next_frame()) is not None:
        yield frame


def fed_byte_by_byte(data: bytes, decoder: FrameDecoder) -> Iterator[Frame]:
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        while (frame := decoder.next_frame()) is not None:
            yield frame


FEEDS = [fed_whole, fed_byte_by_byte]


@pytest.mark.parametrize("feed", FEEDS)
def test_a_whole_conversation_over_bytes(
    feed: Callable[[bytes, FrameDecoder], Iterator[Frame]],
) -> None:
    hello = Hello(role=ROLE_CONNECTOR, name="game01", max_frame=4096, session=SESSION)
    dialling = DiallingHandshake(hello, correlation=3)
    accepting = AcceptingHandshake()

    (first,) = feed(dialling.hello(), FrameDecoder())
    event = accepting.receive(first)
    assert event == HelloReceived(hello, 3, ROLE_CONNECTOR)
    welcome = Welcome(broker="b1", max_frame=negotiated_max_frame(event.hello.max_frame, 1 << 20))
    (answer,) = feed(accepting.welcome(welcome), FrameDecoder())
    assert dialling.receive(answer) == Welcomed(welcome)
    assert (dialling.state, accepting.state) == (HandshakeState.OPEN, HandshakeState.OPEN)
    assert welcome.max_frame == 4096


@pytest.mark.parametrize("feed", FEEDS)
def test_a_whole_conversation_with_a_sign_in_over_bytes(
    feed: Callable[[bytes, FrameDecoder], Iterator[Frame]],
) -> None:
    credential = RecordingCredential(Auth(user="alice", signature=SIGNATURE))
    dialling = DiallingHandshake(Hello(name="game01"), correlation=3, credential=credential)
    accepting = AcceptingHandshake()

    (first,) = feed(dialling.hello(), FrameDecoder())
    assert isinstance(accepting.receive(first), HelloReceived)
    (challenge,) = feed(accepting.challenge(NONCE), FrameDecoder())
    challenged = dialling.receive(challenge)
    assert isinstance(challenged, Challenged)
    (auth,) = feed(challenged.reply, FrameDecoder())
    event = accepting.receive(auth)
    assert isinstance(event, AuthReceived)
    assert (event.auth.user, event.signed) == ("alice", credential.signed[0])
    (answer,) = feed(accepting.welcome(Welcome(broker="b1")), FrameDecoder())
    assert dialling.receive(answer) == Welcomed(Welcome(broker="b1"))
    assert (dialling.state, accepting.state) == (HandshakeState.OPEN, HandshakeState.OPEN)


@pytest.mark.parametrize("feed", FEEDS)
def test_two_brokers_prove_themselves_to_each_other_over_bytes(
    feed: Callable[[bytes, FrameDecoder], Iterator[Frame]],
) -> None:
    credential = RecordingCredential(Auth(user="b", signature=SIGNATURE))
    verifier = RecordingVerifier()
    dialling = DiallingHandshake(broker_hello(), 1, credential, verifier)
    accepting = AcceptingHandshake()

    (first,) = feed(dialling.hello(), FrameDecoder())
    event = accepting.receive(first)
    assert isinstance(event, HelloReceived)
    assert event.hello.nonce == DIALLER_NONCE
    (challenge,) = feed(accepting.challenge(NONCE, broker="a", proof=PROOF), FrameDecoder())
    challenged = dialling.receive(challenge)
    assert isinstance(challenged, Challenged)
    (auth,) = feed(challenged.reply, FrameDecoder())
    checked = accepting.receive(auth)
    assert isinstance(checked, AuthReceived)
    assert (checked.auth.user, checked.signed) == ("b", credential.signed[0])
    (answer,) = feed(accepting.welcome(Welcome(broker="a")), FrameDecoder())
    assert dialling.receive(answer) == Welcomed(Welcome(broker="a"))
    assert (dialling.state, accepting.state) == (HandshakeState.OPEN, HandshakeState.OPEN)
    assert [broker for broker, _, _ in verifier.asked] == ["a"]


@pytest.mark.parametrize("feed", FEEDS)
def test_frames_after_the_hello_stay_for_the_caller(
    feed: Callable[[bytes, FrameDecoder], Iterator[Frame]],
) -> None:
    """A connector may send its first requests right behind the HELLO: the handshake
    takes one frame, and the rest is still in the link's decoder."""
    dialling = DiallingHandshake(Hello(), correlation=1)
    behind = encode_control(ControlType.PING, Empty(), 2) + encode_data(ADDRESS, ADDRESS, b"hi")
    decoder = FrameDecoder()
    frames = feed(dialling.hello() + behind, decoder)
    accepting = AcceptingHandshake()
    accepting.receive(next(frames))
    accepting.welcome(Welcome())
    assert list(frames) == [decode_frame(behind[:13]), decode_frame(behind[13:])]
    assert decoder.buffered == 0


@pytest.mark.parametrize("feed", FEEDS)
def test_frames_after_the_welcome_stay_for_the_caller(
    feed: Callable[[bytes, FrameDecoder], Iterator[Frame]],
) -> None:
    accepting = deciding(correlation=1)
    behind = encode_control(
        ControlType.BROKERS, Brokers(brokers=[BrokerInfo(name="b2", address="h:2")])
    )
    decoder = FrameDecoder()
    # Half of the next frame is still on its way.
    frames = feed(accepting.welcome(Welcome(broker="b1")) + behind[:-3], decoder)
    dialling = awaiting_welcome(correlation=1)
    assert isinstance(dialling.receive(next(frames)), Welcomed)
    assert list(frames) == []
    assert decoder.buffered == len(behind) - 3
    decoder.feed(behind[-3:])
    assert decoder.next_frame() == decode_frame(behind)


@pytest.mark.parametrize("feed", FEEDS)
def test_a_refusal_over_bytes_then_the_close(
    feed: Callable[[bytes, FrameDecoder], Iterator[Frame]],
) -> None:
    accepting = deciding(correlation=1)
    refusal = accepting.refuse(ErrorCode.REDIRECT, "full", "127.0.0.1:7401")
    (frame,) = feed(refusal, FrameDecoder())
    dialling = awaiting_welcome(correlation=1)
    assert dialling.receive(frame) == HelloRefused(ErrorCode.REDIRECT, "full", "127.0.0.1:7401")


@pytest.mark.parametrize(
    ("ours", "theirs", "limit"),
    [
        (1 << 20, 1 << 20, 1 << 20),
        (4096, 1 << 20, 4096),
        (1 << 20, 4096, 4096),
        (0, 1 << 20, MIN_MAX_FRAME),
        (100, 200, MIN_MAX_FRAME),
        (MIN_MAX_FRAME, MIN_MAX_FRAME + 1, MIN_MAX_FRAME),
    ],
)
def test_negotiated_max_frame_is_the_smaller_limit_never_below_the_minimum(
    ours: int, theirs: int, limit: int
) -> None:
    assert negotiated_max_frame(ours, theirs) == limit
    assert negotiated_max_frame(theirs, ours) == limit


# -- arbitrary input: FrameError, and nothing else ---------------------------------------

_HANDSHAKE_TYPES = st.sampled_from(
    [
        ControlType.HELLO,
        ControlType.WELCOME,
        ControlType.ERROR,
        ControlType.BYE,
        ControlType.PING,
        ControlType.CHALLENGE,
        ControlType.AUTH,
    ]
)
_ints = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
_msgpack_values = st.recursive(
    st.none() | st.booleans() | _ints | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_hello_like = st.fixed_dictionaries(
    {},
    optional={
        "protocol": _ints,
        "role": st.sampled_from([ROLE_CONNECTOR, ROLE_OPERATOR, ROLE_BROKER, "", "x"]),
        "max_frame": _ints,
        "slot": _ints,
        "tag": _ints,
        "broker": st.text(max_size=8),
        "trace_every": _ints,
        "code": _ints,
        "message": _msgpack_values,
        "nonce": st.binary(min_size=NONCE_SIZE - 1, max_size=NONCE_SIZE + 1),
        "user": st.text(max_size=4),
        "signature": st.binary(max_size=SIGNATURE_SIZE + 1),
        "token_proof": st.binary(max_size=TOKEN_PROOF_SIZE + 1),
        "proof": st.binary(min_size=SIGNATURE_SIZE - 1, max_size=SIGNATURE_SIZE + 1),
        "brokers": st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=4), "address": st.text(max_size=4)},
                optional={"slot": _ints, "connectors": _ints, "capacity": _ints},
            ),
            max_size=2,
        ),
    },
)
_bodies = st.one_of(
    st.binary(max_size=64),
    _msgpack_values.map(msgspec.msgpack.encode),
    _hello_like.map(msgspec.msgpack.encode),
)


def _control_bytes(ctype: int, body: bytes, correlation: int) -> bytes:
    header = (8 + len(body)).to_bytes(4, "big") + bytes([2, 1]) + ctype.to_bytes(2, "big")
    return header + correlation.to_bytes(4, "big") + body


def _decoded(data: bytes) -> Frame | None:
    """The frame, or None when the codec already refused it (a malformed body)."""
    decoder = FrameDecoder()
    decoder.feed(data)
    try:
        return decoder.next_frame()
    except FrameError:
        return None


@given(ctype=_HANDSHAKE_TYPES, body=_bodies, correlation=st.integers(0, 3))
def test_the_accepting_side_only_ever_raises_frame_error(
    ctype: int, body: bytes, correlation: int
) -> None:
    frame = _decoded(_control_bytes(ctype, body, correlation))
    if frame is None:
        return
    accepting = AcceptingHandshake()
    try:
        accepting.receive(frame)
    except FrameError:
        assert accepting.state is HandshakeState.CLOSED
        return
    assert accepting.state is HandshakeState.DECIDING
    accepting.welcome(Welcome())
    try:
        accepting.receive(frame)
    except FrameError:
        assert accepting.state is HandshakeState.OPEN
    except HandshakeStateError:
        pytest.fail("a HELLO passed twice is ALREADY_HANDSHAKEN, not a misuse")


@given(ctype=_HANDSHAKE_TYPES, body=_bodies, correlation=st.integers(0, 3))
def test_the_dialling_side_only_ever_raises_frame_error(
    ctype: int, body: bytes, correlation: int
) -> None:
    frame = _decoded(_control_bytes(ctype, body, correlation))
    if frame is None:
        return
    dialling = awaiting_welcome(correlation=1)
    try:
        dialling.receive(frame)
    except FrameError:
        assert dialling.state is HandshakeState.CLOSED
        return
    assert dialling.state in (HandshakeState.OPEN, HandshakeState.CLOSED)


@given(ctype=_HANDSHAKE_TYPES, body=_bodies, correlation=st.integers(0, 3))
def test_the_sign_in_only_ever_raises_frame_error(
    ctype: int, body: bytes, correlation: int
) -> None:
    frame = _decoded(_control_bytes(ctype, body, correlation))
    if frame is None:
        return
    accepting = awaiting_auth(correlation=1)
    try:
        assert isinstance(accepting.receive(frame), AuthReceived)
        assert accepting.state is HandshakeState.CHECKING
    except FrameError:
        assert accepting.state is HandshakeState.CLOSED
    credential = RecordingCredential(Auth(user="alice", token_proof=TOKEN_PROOF))
    dialling = DiallingHandshake(Hello(), correlation=1, credential=credential)
    dialling.hello()
    dialling.receive(ControlFrame(ControlType.CHALLENGE, Challenge(nonce=NONCE), 1))
    try:
        assert isinstance(dialling.receive(frame), Welcomed | HelloRefused)
    except FrameError:
        assert dialling.state is HandshakeState.CLOSED


@given(ctype=_HANDSHAKE_TYPES, body=_bodies, correlation=st.integers(0, 3))
def test_brokers_proving_themselves_only_ever_raise_frame_error(
    ctype: int, body: bytes, correlation: int
) -> None:
    frame = _decoded(_control_bytes(ctype, body, correlation))
    if frame is None:
        return
    accepting = peer_challenged(correlation=1)
    try:
        assert isinstance(accepting.receive(frame), AuthReceived)
    except FrameError:
        assert accepting.state is HandshakeState.CLOSED
    dialling, _, _ = verifying()
    try:
        event = dialling.receive(frame)
    except FrameError:
        assert dialling.state is HandshakeState.CLOSED
        return
    # Nothing opens a verifying broker's link before a proof passed.
    assert not isinstance(event, Welcomed)


@given(
    frame=st.one_of(
        st.builds(
            DataFrame,
            dst=st.binary(min_size=16, max_size=16),
            src=st.binary(min_size=16, max_size=16),
            payload=st.binary(max_size=8),
            flags=st.integers(0, 255),
        ),
        st.builds(
            ControlFrame,
            type=st.integers(0, 0xFFFF),
            body=st.none() | st.builds(Empty) | st.builds(Bye, reason=st.text(max_size=4)),
            correlation=st.integers(0, 0xFFFFFFFF),
        ),
        st.builds(
            ControlFrame,
            type=st.just(ControlType.HELLO),
            body=st.builds(
                Hello,
                protocol=_ints,
                role=st.text(max_size=10),
                max_frame=_ints,
                slot=_ints,
                tag=_ints,
            ),
            correlation=st.integers(0, 0xFFFFFFFF),
        ),
        st.builds(
            ControlFrame,
            type=st.sampled_from([ControlType.WELCOME, ControlType.ERROR]),
            body=st.builds(
                Welcome,
                protocol=_ints,
                max_frame=_ints,
                slot=_ints,
                tag=_ints,
                trace_every=_ints,
            )
            | st.builds(Error, code=_ints, message=st.text(max_size=4)),
            correlation=st.integers(0, 2),
        ),
    )
)
def test_arbitrary_frames_get_an_event_or_a_frame_error(frame: Frame) -> None:
    accepting = AcceptingHandshake()
    try:
        assert isinstance(accepting.receive(frame), HelloReceived)
    except FrameError:
        pass
    dialling = awaiting_welcome(correlation=1)
    try:
        assert isinstance(dialling.receive(frame), Welcomed | HelloRefused)
    except FrameError:
        pass
