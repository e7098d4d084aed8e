"""The NATS client protocol parser and encoders (meshbus.protocol.nats), in the style of
nats-server's test/proto_test.go: raw protocol text in, operations out -- fed whole, one
byte at a time, and with bytes of the next operation behind it -- and the errors
nats-server gives, with whether it says -ERR before it closes."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshbus.protocol.nats import (
    Connect,
    ConnectCredentials,
    ConnectOptions,
    NatsEvent,
    NatsParser,
    NatsProtocolViolation,
    Ping,
    Pong,
    Publish,
    ServerInfo,
    Subscribe,
    Unsubscribe,
    encode_err,
    encode_hmsg,
    encode_info,
    encode_msg,
    encode_msgs,
    no_responders_header,
)

HEADERS_ON = b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'


def events_of(parser: NatsParser) -> list[NatsEvent]:
    found = []
    while (event := parser.next_event()) is not None:
        found.append(event)
    return found


def parse_whole(data: bytes, **limits: int) -> list[NatsEvent]:
    parser = NatsParser(**limits)
    parser.feed(data)
    return events_of(parser)


def parse_bytewise(data: bytes, **limits: int) -> list[NatsEvent]:
    parser = NatsParser(**limits)
    found = []
    for i in range(len(data)):
        parser.feed(data[i : i + 1])
        found.extend(events_of(parser))
    return found


def both_ways(data: bytes, **limits: int) -> list[NatsEvent]:
    """The events of ``data`` fed whole, checked equal to those fed a byte at a time."""
    whole = parse_whole(data, **limits)
    assert parse_bytewise(data, **limits) == whole
    return whole


# -- operations -------------------------------------------------------------------------


def test_basics() -> None:
    assert both_ways(b"PING\r\nPONG\r\nSUB foo 1\r\nPUB foo 5\r\nhello\r\n") == [
        Ping(),
        Pong(),
        Subscribe(b"foo", b"", b"1"),
        Publish(b"foo", b"", 0, b"hello"),
    ]


@pytest.mark.parametrize(
    ("text", "event"),
    [
        (b"pub foo 2\r\nok\r\n", Publish(b"foo", b"", 0, b"ok")),
        (b"Pub\tfoo\tbar 2\r\nok\r\n", Publish(b"foo", b"bar", 0, b"ok")),
        (b"PUB foo  _INBOX.x.1   0\r\n\r\n", Publish(b"foo", b"_INBOX.x.1", 0, b"")),
        (b"sub foo.* q 22\r\n", Subscribe(b"foo.*", b"q", b"22")),
        (b"unsub 22\r\n", Unsubscribe(b"22", 0)),
        (b"UNSUB 22 5\r\n", Unsubscribe(b"22", 5)),
        (b"UNSUB 22 x\r\n", Unsubscribe(b"22", 0)),  # nats-server: no number, unsub now
        (b"ping\n", Ping()),  # a bare LF ends a line too
        (b"PING anything\r\n", Ping()),
        (b"pong\r\n", Pong()),
        (b'INFO {"x": 1}\r\n+OK\r\n+ok\r\nPING\r\n', Ping()),  # read past, as nats-server
    ],
)
def test_each_operation_case_insensitive(text: bytes, event: NatsEvent) -> None:
    assert both_ways(text) == [event]


def test_payload_is_binary_and_may_hold_crlf() -> None:
    payload = bytes(range(256)) + b"\r\nPUB x 1\r\n"
    text = b"PUB bin %d\r\n%b\r\nPING\r\n" % (len(payload), payload)
    assert both_ways(text) == [Publish(b"bin", b"", 0, payload), Ping()]


def test_hpub_keeps_the_header_block_byte_for_byte() -> None:
    headers = b"NATS/1.0\r\nA: 1\r\nmixed-Case:  x y \r\n\r\n"
    data = headers + b"body"
    text = HEADERS_ON + b"HPUB s r %d %d\r\n%b\r\n" % (len(headers), len(data), data)
    events = both_ways(text)
    assert events[1] == Publish(b"s", b"r", len(headers), data)


def test_connect_lays_its_fields_over_the_defaults() -> None:
    parser = NatsParser()
    assert parser.options == ConnectOptions(verbose=True, pedantic=True, echo=True)
    first = {"verbose": False, "pedantic": False, "name": "svc", "lang": "go", "user": "al"}
    parser.feed(b"CONNECT " + json.dumps(first).encode() + b"\r\n")
    assert events_of(parser) == [
        Connect(
            ConnectOptions(verbose=False, pedantic=False, name="svc", lang="go"),
            ConnectCredentials(user="al"),
        )
    ]
    parser.feed(b'connect\t{"echo":false,"headers":true,"no_responders":true,"protocol":1}\r\n')
    [event] = events_of(parser)
    assert isinstance(event, Connect)
    assert event.options == ConnectOptions(
        verbose=False, pedantic=False, echo=False, headers=True, no_responders=True,
        protocol=1, name="svc", lang="go",
    )  # fmt: skip
    assert event.credentials == ConnectCredentials()  # a CONNECT's own, never laid over


def test_connect_carries_its_credentials() -> None:
    parser = NatsParser()
    fields = {"user": "u", "pass": "p", "auth_token": "t", "nkey": "UA", "sig": "s", "jwt": "j"}
    parser.feed(b"CONNECT " + json.dumps(fields).encode() + b"\r\n")
    [event] = events_of(parser)
    assert isinstance(event, Connect)
    assert event.credentials == ConnectCredentials(
        user="u", password="p", auth_token="t", nkey="UA", sig="s", jwt="j"
    )


def test_credentials_of_the_wrong_type_close_quietly() -> None:
    parser = NatsParser()
    parser.feed(b'CONNECT {"pass": 7}\r\n')
    with pytest.raises(NatsProtocolViolation) as caught:
        parser.next_event()
    assert caught.value.error_text is None


def test_trailing_bytes_stay_for_the_next_feed() -> None:
    parser = NatsParser()
    parser.feed(b"PUB a 3\r\nabc\r\nPUB b 10\r\n01234")
    assert events_of(parser) == [Publish(b"a", b"", 0, b"abc")]
    assert parser.buffered == 5
    parser.feed(b"56789\r\nSU")
    assert events_of(parser) == [Publish(b"b", b"", 0, b"0123456789")]
    parser.feed(b"B x 1\r\n")
    assert events_of(parser) == [Subscribe(b"x", b"", b"1")]


# -- errors: which say -ERR, which close quietly -----------------------------------------


def violation(data: bytes, **limits: int) -> NatsProtocolViolation:
    """The error ``data`` ends in, the same fed whole and a byte at a time."""
    errors = []
    for parse in (parse_whole, parse_bytewise):
        with pytest.raises(NatsProtocolViolation) as caught:
            parse(data, **limits)
        errors.append(caught.value.error_text)
    assert errors[0] == errors[1]
    return caught.value


@pytest.mark.parametrize(
    ("text", "error_text"),
    [
        (b"ZZZ", "Unknown Protocol Operation"),  # at once, no line end needed
        (b"PUBX foo 1\r\n", "Unknown Protocol Operation"),
        (b"\r\n", "Unknown Protocol Operation"),
        (b" PING\r\n", "Unknown Protocol Operation"),
        (b"MSG foo 1 1\r\n", "Unknown Protocol Operation"),  # a server's operation
        (b"-ERR 'x'\r\n", None),
        (b"-ERR\r\n", "Unknown Protocol Operation"),
        (b"INFO\r\n", "Unknown Protocol Operation"),
        (b"PUB foo 3\r\nabcd\r\n", "Unknown Protocol Operation"),  # longer than its size
        (b"PUB foo 1048577\r\n", "Maximum Payload Violation"),
        (b"PUB foo", None),
        (b"PUB foo\r\n", None),
        (b"PUB foo bar baz 1\r\n", None),
        (b"PUB foo -1\r\n", None),
        (b"PUB foo +1\r\n", None),
        (b"PUB foo 1234567890\r\n", None),  # ten digits: more than nats-server reads
        (b"SUB foo\r\n", None),
        (b"SUB a b c d\r\n", None),
        (b"UNSUB\r\n", "Unknown Protocol Operation"),
        (b"UNSUB 1 2 3\r\n", None),
        (b"HPUB foo 0 0\r\n\r\n", None),  # headers not turned on by a CONNECT
        (b"CONNECT {nope}\r\n", None),
        (b'CONNECT {"verbose": "yes"}\r\n', None),
        (b"CONNECT []\r\n", None),
        (b'CONNECT {"protocol": 2}\r\n', "invalid client protocol"),
        (b'CONNECT {"no_responders": true}\r\n', "no responders requires headers support"),
        (HEADERS_ON + b"HPUB foo 5 4\r\n", None),  # header larger than the whole
        (HEADERS_ON + b"HPUB foo 4\r\n", None),
    ],
)
def test_errors(text: bytes, error_text: str | None) -> None:
    if text == b"PUB foo":  # incomplete: no error yet, either way
        assert both_ways(text) == []
        return
    assert violation(text).error_text == error_text


def test_max_payload_is_the_parsers() -> None:
    assert both_ways(b"PUB foo 10\r\n0123456789\r\n", max_payload=10)
    assert violation(b"PUB foo 11\r\n", max_payload=10).error_text == "Maximum Payload Violation"


def test_max_control_line_even_before_the_line_ends() -> None:
    line = b"SUB " + b"a" * 100 + b" 1"
    assert both_ways(line + b"\r\n", max_control_line=len(line))
    error = violation(line + b"\r\n", max_control_line=len(line) - 1)
    assert error.error_text == "maximum control line exceeded"
    # A flood with no line end is refused once it passes the limit, not held.
    parser = NatsParser(max_control_line=64)
    parser.feed(b"SUB " + b"x" * 61)
    assert parser.next_event() is None
    parser.feed(b"xx")
    with pytest.raises(NatsProtocolViolation, match="control line"):
        parser.next_event()


@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_fail_cleanly_and_alike(data: bytes) -> None:
    """Any bytes give the same events (or the same error) whole as byte by byte, and
    nothing but a NatsProtocolViolation escapes."""
    outcomes = []
    for parse in (parse_whole, parse_bytewise):
        try:
            outcomes.append(("events", parse(data, max_control_line=64, max_payload=64)))
        except NatsProtocolViolation as exc:
            outcomes.append(("error", exc.error_text))
    assert outcomes[0] == outcomes[1]


FRAGMENTS = st.sampled_from(
    [b"PUB a 3\r\n", b"pub b r 0\r\n", b"abc", b"\r\n", b"\n", b"SUB a.* q 1\r\n", b"UNSUB 1 2",
     b"PING", b"PONG\r\n", b"HPUB h 4 6\r\n", b"\r\n\r\n", b" ", b"3", b"99999", HEADERS_ON,
     b'CONNECT {"headers":false}\r\n', b"x", b"PUB a 3\r\nabc\r\n", b"PUB a r 1\r\nz\r\n"]
)  # fmt: skip


@given(st.lists(FRAGMENTS, max_size=12).map(b"".join))
def test_protocol_like_bytes_parse_alike_whole_and_bytewise(data: bytes) -> None:
    outcomes = []
    for parse in (parse_whole, parse_bytewise):
        try:
            outcomes.append(("events", parse(data, max_control_line=64, max_payload=8)))
        except NatsProtocolViolation as exc:
            outcomes.append(("error", exc.error_text))
    assert outcomes[0] == outcomes[1]


# -- runs of PUBs (next_publishes) --------------------------------------------------------


def events_with_runs(parser: NatsParser, limit: int) -> list[NatsEvent]:
    """The events of what was fed, the PUBs taken in runs of at most ``limit`` (as a
    client on the fast way reads them) and the rest one at a time."""
    found: list[NatsEvent] = []
    while True:
        run = parser.next_publishes(limit)
        found.extend(Publish(*message) for message in run)
        if run:
            continue
        event = parser.next_event()
        if event is None:
            return found
        found.append(event)


def parse_in_chunks(data: bytes, cuts: list[int], limit: int, **limits: int) -> list[NatsEvent]:
    parser = NatsParser(**limits)
    found: list[NatsEvent] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        parser.feed(data[start:cut])
        start = max(start, cut)
        found.extend(events_with_runs(parser, limit))
    return found


ODD_ONES = [
    b"PING\r\n",
    b"PUB run.x 4\r\nabcd\r\n",  # the same subject, another size
    b"PUB run.y 3\r\nabc\r\n",  # a line of the same length
    b"PUB run.x 3\r\nabcd\r\n",  # longer than its size: the run stops, then an error
]


def test_a_run_is_the_pubs_up_to_anything_else() -> None:
    parser = NatsParser()
    parser.feed(
        b"PUB a 3\r\nabc\r\nPUB a 3\r\nxyz\r\nPUB b r 0\r\n\r\n"
        b"PING\r\nPUB c 1\r\nz\r\nPUB d 4\r\nab"
    )
    assert parser.next_publishes(2) == [(b"a", b"", 0, b"abc"), (b"a", b"", 0, b"xyz")]
    assert parser.next_publishes(10) == [(b"b", b"r", 0, b"")]
    assert parser.next_publishes(10) == []  # PING is next_event's
    assert parser.next_event() == Ping()
    assert parser.next_publishes(10) == [(b"c", b"", 0, b"z")]
    assert parser.next_publishes(10) == []  # d's payload is not all here
    parser.feed(b"cd\r\n")
    assert parser.next_publishes(10) == [(b"d", b"", 0, b"abcd")]
    assert parser.buffered == 0


def outcome(parse: Callable[[], list[NatsEvent]]) -> tuple[str, object]:
    """The events of ``parse``, or the -ERR text of the error it ended in."""
    try:
        return ("events", parse())
    except NatsProtocolViolation as exc:
        return ("error", exc.error_text)


@pytest.mark.parametrize(
    "data",
    [
        b"pub a 1\r\nx\r\n",  # lower case
        HEADERS_ON + b"HPUB a 12 12\r\nNATS/1.0\r\n\r\n\r\n",
        b"PUB a 1\r\nxy\r\n",  # longer than its size
        b"PUB a 9\r\n123456789\r\n",  # past max_payload
    ],
)
def test_a_run_leaves_what_it_does_not_take_to_next_event(data: bytes) -> None:
    parser = NatsParser(max_payload=8)
    parser.feed(data)
    assert parser.next_publishes(10) == []
    assert outcome(lambda: parse_in_chunks(data, [], 10, max_payload=8)) == outcome(
        lambda: parse_whole(data, max_payload=8)
    )


def test_a_repeated_line_carries_each_message_its_own_payload() -> None:
    line = b"PUB same.subject _INBOX.r 2\r\n"
    parser = NatsParser()
    parser.feed(b"".join(line + b"%02d\r\n" % i for i in range(50)))
    run = parser.next_publishes(100)
    assert [data for _, _, _, data in run] == [b"%02d" % i for i in range(50)]
    assert {(subject, reply) for subject, reply, _, _ in run} == {(b"same.subject", b"_INBOX.r")}
    # Lines alike but for a byte, and of one length: each read for what it says.
    parser.feed(b"PUB ab 2\r\nxy\r\nPUB ac 2\r\nxy\r\nPUB ac r 1\r\nz\r\n")
    assert parser.next_publishes(100) == [
        (b"ab", b"", 0, b"xy"), (b"ac", b"", 0, b"xy"), (b"ac", b"r", 0, b"z")
    ]  # fmt: skip
    # The same subject, another size: the line differs, and is read again.
    parser.feed(b"PUB same.subject _INBOX.r 3\r\nabc\r\n")
    assert parser.next_publishes(100) == [(b"same.subject", b"_INBOX.r", 0, b"abc")]


@given(
    st.integers(0, 60),
    st.lists(st.tuples(st.integers(0, 60), st.sampled_from(ODD_ONES)), max_size=3),
    st.lists(st.integers(0, 1500), max_size=3),
    st.integers(1, 80),
    st.binary(min_size=3, max_size=3),
)
def test_a_run_of_one_line_repeated_reads_as_one_message_at_a_time(
    repeats: int, odd: list[tuple[int, bytes]], cuts: list[int], limit: int, fill: bytes
) -> None:
    """Long runs of one PUB line (taken a column at a time), broken anywhere by another
    operation or a line alike but for its size, and cut anywhere by the reads: the same
    events as the whole read one at a time. Payloads hold the line's own bytes."""
    messages = [b"PUB run.x 3\r\n%b\r\n" % (fill if i % 2 else b"PUB") for i in range(repeats)]
    for at, operation in odd:
        messages.insert(min(at, len(messages)), operation)
    data = b"".join(messages)
    assert outcome(lambda: parse_in_chunks(data, cuts, limit)) == outcome(lambda: parse_whole(data))


def test_a_message_longer_than_the_reads_is_gathered_and_read_after() -> None:
    payload = bytes(range(256)) * 64
    data = b"PUB big %d\r\n" % len(payload) + payload + b"\r\nPUB small 2\r\nok\r\n"
    parser = NatsParser()
    found: list[NatsEvent] = []
    for i in range(0, len(data), 100):  # reads far shorter than the message
        parser.feed(data[i : i + 100])
        found.extend(events_with_runs(parser, 8))
    assert found == [Publish(b"big", b"", 0, payload), Publish(b"small", b"", 0, b"ok")]
    assert all(type(event.data) is bytes for event in found if isinstance(event, Publish))


@given(
    st.lists(FRAGMENTS, max_size=16).map(b"".join),
    st.lists(st.integers(0, 200), max_size=6),
    st.integers(1, 4),
)
def test_runs_give_the_events_one_at_a_time_would(data: bytes, cuts: list[int], limit: int) -> None:
    """PUBs in runs, the bytes cut anywhere: the same events, or the same error, as the
    whole fed at once and read one event at a time."""
    assert outcome(
        lambda: parse_in_chunks(data, cuts, limit, max_control_line=64, max_payload=8)
    ) == outcome(lambda: parse_whole(data, max_control_line=64, max_payload=8))


# -- the server's side --------------------------------------------------------------------


def test_encoders() -> None:
    assert encode_msg(b"foo", b"1", b"", b"hello") == b"MSG foo 1 5\r\nhello\r\n"
    assert encode_msg(b"foo", b"1", b"_INBOX.a", b"") == b"MSG foo 1 _INBOX.a 0\r\n\r\n"
    data = b"NATS/1.0\r\nA: 1\r\n\r\nbody"
    assert encode_hmsg(b"s", b"9", b"r", 18, data) == b"HMSG s 9 r 18 22\r\n" + data + b"\r\n"
    assert encode_hmsg(b"s", b"9", b"", 18, data) == b"HMSG s 9 18 22\r\n" + data + b"\r\n"
    assert encode_err("Invalid Subject") == b"-ERR 'Invalid Subject'\r\n"
    header = no_responders_header(b"svc.a")
    assert header.startswith(b"NATS/1.0 503\r\n")
    assert header.endswith(b"\r\n\r\n")


def test_a_run_encodes_as_its_messages_one_by_one() -> None:
    header = b"NATS/1.0\r\nA: 1\r\n\r\n"
    run = [
        (b"s", b"", 0, b"ab"),
        (b"s", b"", 0, b"cd"),  # the same line as the last
        (b"s", b"", 0, b"efg"),  # another size
        (b"s", b"r", 0, b"x"),
        (b"s", b"", len(header), header + b"body"),
        (b"s", b"r", len(header), header),
        (b"s", b"", 0, b""),
    ]
    for headers in (True, False):
        one_by_one = [
            encode_hmsg(b"s", b"7", reply, size, data)
            if size and headers
            else encode_msg(b"s", b"7", reply, data[size:])
            for _, reply, size, data in run
        ]
        assert encode_msgs(b"s", b"7", run, headers) == (
            b"".join(one_by_one),
            sum(len(data) for *_, data in run),
        )
    # A peer's rows are read alike (their flags are not the encoder's business).
    rows = [(b"s", b"", 0, b"ab", True, []), (b"s", b"r", 0, b"", False, [b"q"])]
    assert encode_msgs(b"s", b"7", rows, True)[0] == b"MSG s 7 2\r\nab\r\nMSG s 7 r 0\r\n\r\n"
    assert encode_msgs(b"s", b"7", [], True) == (b"", 0)


def test_info_carries_what_clients_read() -> None:
    info = ServerInfo(
        server_id="ID", server_name="b1", version="2.10.0", go="python3.11.7",
        host="127.0.0.1", port=4222,
        max_payload=1024, client_id=7, client_ip="127.0.0.1",
    )  # fmt: skip
    line = encode_info(info)
    assert line.startswith(b"INFO {")
    assert line.endswith(b"}\r\n")
    fields = json.loads(line[5:])
    assert fields["proto"] == 1
    assert fields["go"] == "python3.11.7"
    assert fields["headers"] is True
    assert fields["max_payload"] == 1024
    assert fields["client_id"] == 7
    assert "connect_urls" not in fields  # omitted when empty, as nats-server does
    for optional in ("auth_required", "tls_required", "tls_verify", "nonce", "ldm"):
        assert optional not in fields


def test_info_of_a_server_with_auth_tls_in_lame_duck_mode() -> None:
    info = ServerInfo(
        server_id="ID", server_name="b1", version="2.10.0", go="python3.11.7",
        host="127.0.0.1", port=4222,
        max_payload=1024, client_id=7, client_ip="127.0.0.1", auth_required=True,
        tls_required=True, nonce="abc", ldm=True, connect_urls=["127.0.0.1:4223"],
    )  # fmt: skip
    fields = json.loads(encode_info(info)[5:])
    assert fields["auth_required"] is True
    assert fields["tls_required"] is True
    assert fields["nonce"] == "abc"
    assert fields["ldm"] is True
    assert fields["connect_urls"] == ["127.0.0.1:4223"]
