"""The NATS client protocol, the server's side, sans-IO: bytes from a NATS client in,
typed operations out (``NatsParser``); the server's operations as bytes
(``encode_info``, ``encode_msg``, ``encode_hmsg``, ``encode_err``, ``PING``, ...).

This is the protocol of docs.nats.io's "Client Protocol" as nats-server speaks it,
so that every language's NATS client can talk to a broker (docs/nats.md). Like the
rest of meshbus.protocol it does no I/O, keeps no clock and calls nobody back: the
caller feeds what it read and pulls events one at a time, so an event is acted on
before the next one is parsed (a CONNECT that turns headers on is in force for the
HPUB right behind it in the same read).

Rules it keeps, each as nats-server does:

1. Verbs are case-insensitive (``pub`` is ``PUB``). A line ends with CRLF or a bare
   LF; a message's payload ends with exactly CRLF.
2. A control line (the verb, its blanks and its arguments; CRLF not counted) is at
   most ``max_control_line`` bytes -- nats-server counts the arguments alone, so this
   is the few bytes of a verb stricter. A longer one, even before its end arrived, is
   ``-ERR 'maximum control line exceeded'`` and the connection closes.
3. Bytes that cannot begin a client operation are ``-ERR 'Unknown Protocol
   Operation'`` and close, as soon as they arrive -- a line is not waited for. A
   client's ``INFO`` and ``+OK`` are read past; its ``-ERR`` closes without a word.
4. Every number on the wire is at most 9 ASCII digits (nothing else: no sign, no
   blank, no ``_``). A PUB or HPUB whose size passes ``max_payload`` is ``-ERR
   'Maximum Payload Violation'`` and closes; an HPUB header size above its total is a
   protocol violation. A PUB, HPUB, SUB or UNSUB with the wrong number of arguments,
   or a size that is no number, closes the connection without an ``-ERR`` (nats-server
   logs it and closes).
5. CONNECT's JSON is laid over the options in force, whose defaults are nats-server's
   (verbose and pedantic on until a CONNECT says otherwise, echo on). A CONNECT that is
   no JSON object, or has a known field of the wrong type, closes without an ``-ERR``;
   ``protocol`` other than 0 or 1 is ``-ERR 'invalid client protocol'``, and
   ``no_responders`` without ``headers`` is ``-ERR 'no responders requires headers
   support'``, both closing.
6. HPUB is taken only after a CONNECT with ``headers: true``; before, it closes the
   connection (nats-server: headers not supported).

What a subject may be is not the parser's business: a SUB's subject, queue and sid
come out as they were sent (meshbus.broker.core.subjects checks them). Every error is
a ``NatsProtocolViolation``: fatal, the parser is done, and ``error_text`` says the
``-ERR`` to send first (None: close without one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import msgspec

from meshbus.errors import ProtocolError
from meshbus.protocol.nats_handshake import (
    MAX_CLIENT_PROTOCOL,
    ConnectCredentials,
    ConnectOptions,
    ServerInfo,
    encode_info,
    read_connect,
)

if TYPE_CHECKING:
    from meshbus.protocol.control import NatsRow

__all__ = [
    "DEFAULT_MAX_CONTROL_LINE",
    "DEFAULT_MAX_PAYLOAD",
    "OK",
    "PING",
    "PONG",
    "Connect",
    "ConnectCredentials",
    "ConnectOptions",
    "Message",
    "NatsEvent",
    "NatsParser",
    "NatsProtocolViolation",
    "Ping",
    "Pong",
    "Publish",
    "ServerInfo",
    "Subscribe",
    "Unsubscribe",
    "encode_err",
    "encode_hmsg",
    "encode_info",
    "encode_msg",
    "encode_msgs",
    "no_responders_header",
]

# Final: compiled (mypyc), a module's Final names are C statics, its other globals a
# dictionary look-up on every use.
DEFAULT_MAX_CONTROL_LINE: Final = 4096
DEFAULT_MAX_PAYLOAD: Final = 1024 * 1024
# parseSize's limit: 999,999,999 at most.
_MAX_DIGITS: Final = 9
# The shortest run of PUBs alike that is checked column by column (_repeats).
_MIN_STRIDE_RUN: Final = 8

PING: Final = b"PING\r\n"
PONG: Final = b"PONG\r\n"
OK: Final = b"+OK\r\n"
_CRLF: Final = b"\r\n"
_BLANKS: Final = b" \t"

# The -ERR texts, nats-server's words (clients match on some of them).
UNKNOWN_OPERATION: Final = "Unknown Protocol Operation"
MAX_CONTROL_LINE: Final = "maximum control line exceeded"
MAX_PAYLOAD: Final = "Maximum Payload Violation"
BAD_CLIENT_PROTOCOL: Final = "invalid client protocol"
NO_RESPONDERS_NEED_HEADERS: Final = "no responders requires headers support"


class NatsProtocolViolation(ProtocolError):
    """A NATS client broke the protocol; its connection is closed. ``error_text`` is
    what the server says first (``-ERR '<error_text>'``), None when nats-server says
    nothing and just closes; the message says what was wrong, for the log."""

    def __init__(self, message: str, error_text: str | None) -> None:
        super().__init__(message)
        self.error_text = error_text


# The events are slotted dataclasses, not frozen ones: one is made per message, and a
# frozen one takes four times as long to build. They are values all the same: nothing
# changes one once it is made.


@dataclass(slots=True)
class Connect:
    """A CONNECT; ``options`` are those in force from now on (laid over the earlier),
    ``credentials`` those of this CONNECT alone."""

    options: ConnectOptions
    credentials: ConnectCredentials


@dataclass(slots=True, init=False)
class Publish:
    """A PUB (``header_size`` 0) or HPUB. ``data`` is the message as sent: its first
    ``header_size`` bytes are the header block, kept byte for byte, the rest the
    payload. ``reply`` is empty for none."""

    subject: bytes
    reply: bytes
    header_size: int
    data: bytes

    # Written out, not generated: compiled (mypyc), the dataclass's generated __init__
    # would stay interpreted, and a client off the fast way makes one per message.
    def __init__(self, subject: bytes, reply: bytes, header_size: int, data: bytes) -> None:
        self.subject = subject
        self.reply = reply
        self.header_size = header_size
        self.data = data


@dataclass(slots=True)
class Subscribe:
    """A SUB; ``queue`` is empty for a plain subscription."""

    subject: bytes
    queue: bytes
    sid: bytes


@dataclass(slots=True)
class Unsubscribe:
    """An UNSUB: ``max_msgs`` 0 ends the subscription now; more lets it end after
    that many messages in all (nats-server: a max that is no number ends it now)."""

    sid: bytes
    max_msgs: int


@dataclass(slots=True)
class Ping:
    pass


@dataclass(slots=True)
class Pong:
    pass


NatsEvent = Connect | Publish | Subscribe | Unsubscribe | Ping | Pong
# A published message as the router takes it, a Publish's fields in a plain tuple --
# (subject, reply, header size, data) -- which costs a tenth of an event to make.
Message = tuple[bytes, bytes, int, bytes]
_PING, _PONG = Ping(), Pong()

# A whole PUB line as clients write it (upper case, CRLF), matched at C speed: the common
# case, taken whole when its message is all there. Anything else -- and any line this
# matches but the limits refuse -- goes the general way, which decides alike.
_PUB_LINE: Final = re.compile(
    rb"PUB[ \t]+([^ \t\r\n]+)[ \t]+(?:([^ \t\r\n]+)[ \t]+)?(\d{1,9})[ \t]*\r\n"
)

# The verbs a client may send. An argument verb must be followed by a blank; PING and
# PONG take whatever follows up to the line's end, CONNECT its JSON after any blanks.
_ARGUMENT_VERBS: Final = (b"PUB", b"HPUB", b"SUB", b"UNSUB", b"INFO", b"-ERR")
_BARE_VERBS: Final = (b"PING", b"PONG", b"CONNECT", b"+OK")


class _Ignored:
    """A line the server reads past: a client's INFO or +OK (nats-server ignores them)."""


_IGNORED = _Ignored()


def _could_begin(head: bytes) -> bool:
    """Whether ``head`` (the uppercased start of an unfinished line) can still become a
    client operation."""
    for verb in _ARGUMENT_VERBS:
        if verb.startswith(head):
            return True
        if head.startswith(verb):
            return head[len(verb)] in _BLANKS
    return any(verb.startswith(head) or head.startswith(verb) for verb in _BARE_VERBS)


def _check_head(head: bytes) -> None:
    """Unknown Protocol Operation as soon as a line's start can be no operation (before
    its length is looked at, so that it is the same error however the bytes came)."""
    if head and not _could_begin(head):
        raise NatsProtocolViolation(f"unknown operation {head!r}", UNKNOWN_OPERATION)


def _repeats(buf: bytes | bytearray, pos: int, line: bytes, stride: int, most: int) -> int:
    """How many messages, at most ``most``, lie whole from ``pos`` in ``buf`` at a fixed
    ``stride``, each its PUB ``line`` and a payload then CRLF: the run of a publisher
    that repeats one subject and one size, checked a column at a time -- each byte of the
    line, and the CRLF, across the messages in one extended slice -- instead of message
    by message. 0 where the run is too short to gain; a run cut short is found by
    halving. The lines of requests differ (a reply subject each): one look at the
    message after the first finds that, before any column is."""
    if not buf.startswith(line, pos + stride):
        return 0
    count = min(most, (len(buf) - pos) // stride)
    width = len(line)
    while count >= _MIN_STRIDE_RUN and width <= 4 * count:
        stop = pos + count * stride
        if (
            buf[pos + stride - 2 : stop : stride] == b"\r" * count
            and buf[pos + stride - 1 : stop : stride] == b"\n" * count
            and all(buf[pos + i : stop : stride] == line[i : i + 1] * count for i in range(width))
        ):
            return count
        count //= 2
    return 0


def _size(text: bytes) -> int:
    """A size or count as nats-server reads one: 1 to 9 ASCII digits; -1 otherwise."""
    if 0 < len(text) <= _MAX_DIGITS and text.isdigit():
        return int(text)
    return -1


class NatsParser:
    """One client connection's reader: ``feed`` bytes, then ``next_event`` until it
    returns None (more bytes needed). A ``NatsProtocolViolation`` ends it: nothing more
    may be fed. Holds at most one control line (``max_control_line``) and one message
    (``max_payload``) of unparsed bytes."""

    def __init__(
        self,
        *,
        max_control_line: int = DEFAULT_MAX_CONTROL_LINE,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self.max_control_line = max_control_line
        self.max_payload = max_payload
        self.options = ConnectOptions()
        # What was fed and not yet parsed starts at _pos. Bytes while the reads come in
        # whole messages or nearly (a message is one slice of them, where a bytearray's
        # slice must be copied again into bytes, and the regex runs twice as fast on
        # them); a bytearray while a message much longer than the reads piles up (feed).
        self._buf: bytes | bytearray = b""
        self._pos = 0
        # A PUB or HPUB whose message has not all arrived: (subject, reply, header size,
        # total size).
        self._waiting: tuple[bytes, bytes, int, int] | None = None

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet parsed."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        buf, pos = self._buf, self._pos
        rest = len(buf) - pos
        if not rest:
            self._buf = bytes(data)
        elif rest <= len(data):
            # The unparsed tail of the last read (a message cut by the read's end) and
            # this read, copied once: never more than twice what was read.
            self._buf = bytes(buf[pos:]) + data
        else:
            # A message longer than this read waits for more: appended to in place, so
            # that a megabyte in small reads is not copied again for each.
            if isinstance(buf, bytes):
                buf = bytearray(buf[pos:])
            else:
                del buf[:pos]
            buf += data
            self._buf = buf
        self._pos = 0

    def next_publishes(self, limit: int) -> list[Message]:
        """The plain PUBs next in the buffer, each whole, as ``(subject, reply, 0,
        payload)``: at most ``limit`` of them, up to the first operation that is anything
        else or not all here (``next_event`` reads that one). Each is the Publish that
        ``next_event`` would give, without an event made per message: the way a client's
        stream of PUBs is read."""
        found: list[Message] = []
        if self._waiting is not None:
            return found
        buf, pos = self._buf, self._pos
        match = _PUB_LINE.match
        max_line, max_payload = self.max_control_line, self.max_payload
        # A publisher mostly repeats its last PUB line byte for byte (one subject, one
        # size): such a line is what it was last time, without the regex, and a run of
        # them lies at a fixed stride.
        line = b""
        subject = reply = b""
        size = 0
        while len(found) < limit:
            if not (line and buf.startswith(line, pos)):
                pub = match(buf, pos)
                if pub is None:
                    break
                start = pub.end()
                size = int(pub[3])
                if start - pos > max_line or size > max_payload:
                    break
                line = bytes(buf[pos:start])
                subject, reply = pub[1], pub[2] or b""
            stride = len(line) + size + 2
            count = _repeats(buf, pos, line, stride, limit - len(found))
            if count:
                stop = pos + count * stride
                run = bytes(buf[pos:stop])
                found += [
                    (subject, reply, 0, run[i : i + size])
                    for i in range(len(line), len(run), stride)
                ]
                pos = stop
                continue
            start = pos + len(line)
            end = start + size
            if not buf.startswith(_CRLF, end):
                break
            found.append((subject, reply, 0, bytes(buf[start:end])))
            pos = end + 2
        self._pos = pos
        return found

    def next_event(self) -> NatsEvent | None:
        """The next operation, or None until more bytes are fed."""
        while True:
            if self._waiting is not None:
                return self._message()
            buf, pos = self._buf, self._pos
            pub = _PUB_LINE.match(buf, pos)
            if pub is not None:
                start = pub.end()
                end = start + int(pub[3])
                if (
                    start - pos <= self.max_control_line
                    and end - start <= self.max_payload
                    and buf.startswith(_CRLF, end)
                ):
                    self._pos = end + 2
                    return Publish(pub[1], pub[2] or b"", 0, bytes(buf[start:end]))
            end = buf.find(b"\n", pos)
            if end < 0:
                self._check_unfinished_line()
                return None
            stop = end - 1 if end > pos and buf[end - 1] == 13 else end  # 13: CR
            line = bytes(buf[pos:stop])
            if len(line) > self.max_control_line:
                _check_head(line[:8].upper())
                raise NatsProtocolViolation(
                    f"a control line of {len(line)} bytes, over the limit of "
                    f"{self.max_control_line}",
                    MAX_CONTROL_LINE,
                )
            self._pos = end + 1
            event = self._operation(line)
            if event is None:  # a PUB or HPUB line: its message follows
                return self._message()
            if not isinstance(event, _Ignored):
                return event

    def _check_unfinished_line(self) -> None:
        _check_head(bytes(self._buf[self._pos : self._pos + 8]).upper())
        pending = len(self._buf) - self._pos
        if pending > self.max_control_line + 1:  # the line, and its CR
            raise NatsProtocolViolation(
                f"{pending} bytes without a line end, over the control line limit of "
                f"{self.max_control_line}",
                MAX_CONTROL_LINE,
            )

    def _operation(self, line: bytes) -> NatsEvent | _Ignored | None:
        """The event of a whole control line (None for a PUB or HPUB, which waits for
        its message)."""
        head = line[:8].upper()
        for verb in _ARGUMENT_VERBS:
            if head.startswith(verb) and len(line) > len(verb) and line[len(verb)] in _BLANKS:
                return self._with_arguments(verb, line[len(verb) + 1 :].split(), line)
        if head.startswith(b"PING"):
            return _PING
        if head.startswith(b"PONG"):
            return _PONG
        if head.startswith(b"CONNECT"):
            return self._connect(line[7:].strip(_BLANKS))
        if head.startswith(b"+OK"):
            return _IGNORED
        raise NatsProtocolViolation(f"unknown operation {line[:32]!r}", UNKNOWN_OPERATION)

    def _with_arguments(
        self, verb: bytes, args: list[bytes], line: bytes
    ) -> NatsEvent | _Ignored | None:
        if verb == b"PUB":
            self._pub(args, line)
            return None
        if verb == b"HPUB":
            self._hpub(args, line)
            return None
        if verb == b"SUB":
            return _sub(args, line)
        if verb == b"UNSUB":
            return _unsub(args, line)
        if verb == b"INFO":
            return _IGNORED
        # -ERR from a client: nats-server closes, saying nothing.
        raise NatsProtocolViolation(f"the client sent {line[:64]!r}", None)

    def _pub(self, args: list[bytes], line: bytes) -> None:
        if len(args) == 2:
            self._wait(args[0], b"", 0, _size(args[1]), line)
        elif len(args) == 3:
            self._wait(args[0], args[1], 0, _size(args[2]), line)
        else:
            raise NatsProtocolViolation(f"PUB with {len(args)} arguments: {line!r}", None)

    def _hpub(self, args: list[bytes], line: bytes) -> None:
        if not self.options.headers:
            raise NatsProtocolViolation(
                "HPUB before a CONNECT with headers: true (headers not supported)", None
            )
        if len(args) not in (3, 4):
            raise NatsProtocolViolation(f"HPUB with {len(args)} arguments: {line!r}", None)
        reply = args[1] if len(args) == 4 else b""
        header_size = _size(args[-2])
        if header_size < 0:
            raise NatsProtocolViolation(f"HPUB with a bad header size: {line!r}", None)
        self._wait(args[0], reply, header_size, _size(args[-1]), line)

    def _wait(self, subject: bytes, reply: bytes, header_size: int, size: int, line: bytes) -> None:
        if size < 0:
            raise NatsProtocolViolation(f"a publish with a bad size: {line!r}", None)
        if header_size > size:
            raise NatsProtocolViolation(f"HPUB header size above its total: {line!r}", None)
        if size > self.max_payload:
            raise NatsProtocolViolation(
                f"a message of {size} bytes, over max_payload {self.max_payload}", MAX_PAYLOAD
            )
        self._waiting = (subject, reply, header_size, size)

    def _message(self) -> Publish | None:
        assert self._waiting is not None
        subject, reply, header_size, size = self._waiting
        start = self._pos
        end = start + size
        buf = self._buf
        if len(buf) < end + 2:
            return None
        if not buf.startswith(_CRLF, end):
            raise NatsProtocolViolation(
                f"a message of {subject!r} longer than its size {size}", UNKNOWN_OPERATION
            )
        self._waiting = None
        self._pos = end + 2
        return Publish(subject, reply, header_size, bytes(buf[start:end]))

    def _connect(self, text: bytes) -> Connect:
        try:
            options, credentials = read_connect(text, self.options)
        except msgspec.DecodeError as exc:
            raise NatsProtocolViolation(f"CONNECT that cannot be read: {exc}", None) from None
        if not 0 <= options.protocol <= MAX_CLIENT_PROTOCOL:
            raise NatsProtocolViolation(
                f"CONNECT with protocol {options.protocol}", BAD_CLIENT_PROTOCOL
            )
        if options.no_responders and not options.headers:
            raise NatsProtocolViolation(
                "CONNECT with no_responders and without headers", NO_RESPONDERS_NEED_HEADERS
            )
        self.options = options
        return Connect(options, credentials)


def _sub(args: list[bytes], line: bytes) -> Subscribe:
    if len(args) == 2:
        return Subscribe(args[0], b"", args[1])
    if len(args) == 3:
        return Subscribe(args[0], args[1], args[2])
    raise NatsProtocolViolation(f"SUB with {len(args)} arguments: {line!r}", None)


def _unsub(args: list[bytes], line: bytes) -> Unsubscribe:
    if len(args) == 1:
        return Unsubscribe(args[0], 0)
    if len(args) == 2:
        return Unsubscribe(args[0], max(_size(args[1]), 0))
    raise NatsProtocolViolation(f"UNSUB with {len(args)} arguments: {line!r}", None)


# -- the server's side -----------------------------------------------------------------


def encode_err(text: str) -> bytes:
    """``-ERR '<text>'``; ``text`` is one of nats-server's words (printable ASCII)."""
    return b"-ERR '" + text.encode() + b"'\r\n"


def encode_msg(subject: bytes, sid: bytes, reply: bytes, payload: bytes) -> bytes:
    """A MSG: ``payload`` to subscription ``sid``; ``reply`` empty for none."""
    if reply:
        return b"MSG %b %b %b %d\r\n%b\r\n" % (subject, sid, reply, len(payload), payload)
    return b"MSG %b %b %d\r\n%b\r\n" % (subject, sid, len(payload), payload)


def encode_msgs(
    subject: bytes, sid: bytes, messages: Sequence[Message | NatsRow], headers: bool
) -> tuple[bytes, int]:
    """The messages of a run on ``subject`` to subscription ``sid``, each as
    ``encode_msg`` or ``encode_hmsg`` writes it (an HMSG when the client takes
    ``headers``, else a MSG of the payload alone), in one bytes; and the size of their
    data. Only the fields that a ``Message`` and a peer's ``NatsRow`` share are read."""
    head = b"MSG " + subject + b" " + sid + b" "
    parts: list[bytes] = []
    # Messages of a run are mostly of one size: their MSG line is the same.
    line = b""
    line_size = -1
    total = 0
    for message in messages:
        reply, header_size, data = message[1], message[2], message[3]
        total += len(data)
        if reply or header_size:
            if header_size and headers:
                parts.append(encode_hmsg(subject, sid, reply, header_size, data))
            else:
                parts.append(encode_msg(subject, sid, reply, data[header_size:]))
            continue
        size = len(data)
        if size != line_size:
            line = head + b"%d\r\n" % size
            line_size = size
        parts.append(line)
        parts.append(data)
        parts.append(_CRLF)
    return b"".join(parts), total


def encode_hmsg(subject: bytes, sid: bytes, reply: bytes, header_size: int, data: bytes) -> bytes:
    """An HMSG: ``data`` is the header block (its first ``header_size`` bytes) and the
    payload, as a Publish holds them."""
    sizes = b"%d %d" % (header_size, len(data))
    if reply:
        return b"HMSG %b %b %b %b\r\n%b\r\n" % (subject, sid, reply, sizes, data)
    return b"HMSG %b %b %b\r\n%b\r\n" % (subject, sid, sizes, data)


def no_responders_header(subject: bytes) -> bytes:
    """The header block of the status message a requester gets when its request
    reached no subscriber: status 503, and the subject the request was sent to."""
    return b"NATS/1.0 503\r\nNats-Subject: " + subject + b"\r\n\r\n"
