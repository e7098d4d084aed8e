"""Message headers: names and values a message carries beside its payload.

On the wire they are one block in the frame's extension block (``Ext.headers``), in
the format NATS uses (``NATS/1.0\\r\\n``, then a ``Name: value\\r\\n`` line per header,
then an empty line), so a header block goes to and from a NATS client byte for byte.
A name is printable ASCII without spaces or ``:``; a value is text without CR or LF.
A header block is at most ``MAX_HEADER_BYTES`` (the extension block's length is a u16),
and the frame's size limit (``max_frame``) bounds it together with the payload.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from meshbus.errors import InvalidArgument, ProtocolError

MAX_HEADER_BYTES = 32 * 1024
_VERSION_LINE = b"NATS/1.0"
_CRLF = "\r\n"
# RFC 7230's token, which is what NATS and HTTP clients accept as a header name.
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def encode_headers(headers: Mapping[str, str] | None) -> bytes:
    """The header block of ``headers`` (b"" for none); ``InvalidArgument`` for a name or
    value a receiver could not read back."""
    if not headers:
        return b""
    if not isinstance(headers, Mapping):
        raise InvalidArgument(
            f"headers= is a mapping of names to values, not {type(headers).__name__}"
        )
    lines = ["NATS/1.0"]
    for name, value in headers.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgument(
                f"header name {name!r} is not a token: use ASCII letters, digits and "
                "!#$%&'*+-.^_`|~, no spaces or ':'"
            )
        if not isinstance(value, str):
            raise InvalidArgument(
                f"header {name!r}: a value is text, not {type(value).__name__}"
                + ("; decode it first" if isinstance(value, bytes) else "")
            )
        if "\r" in value or "\n" in value:
            raise InvalidArgument(f"header {name!r}: a value may not contain CR or LF")
        lines.append(f"{name}: {value}")
    block = (_CRLF.join(lines) + _CRLF + _CRLF).encode()
    if len(block) > MAX_HEADER_BYTES:
        raise InvalidArgument(
            f"headers of {len(block):,} bytes: at most {MAX_HEADER_BYTES:,} go with a message; "
            "send bigger values in the payload"
        )
    return block


def decode_headers(block: bytes) -> dict[str, str]:
    """The headers of a header block; a name given more than once has its values joined
    with ", " (as HTTP does). ``ProtocolError`` if ``block`` is not a header block."""
    if not block:
        return {}
    if not block.startswith(_VERSION_LINE) or not block.endswith(b"\r\n\r\n"):
        raise ProtocolError("malformed header block: not NATS/1.0 lines ending in a blank line")
    try:
        text = block.decode()
    except UnicodeDecodeError:
        raise ProtocolError("malformed header block: not UTF-8") from None
    headers: dict[str, str] = {}
    # The first line is the version, with a status code after it on a NATS status message.
    for line in text[: -2 * len(_CRLF)].split(_CRLF)[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _NAME.fullmatch(name):
            raise ProtocolError(f"malformed header line {line[:64]!r}")
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers
