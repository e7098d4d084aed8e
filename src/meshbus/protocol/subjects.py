"""What a subject is: the rules both ends check (docs/nats.md).

A subject is tokens separated by ``.``; a subscription's *pattern* may have a token
``*`` (any one token) and a last token ``>`` (one or more). No token is empty, none
holds whitespace. A broker's subject table (meshbus.broker.core.subjects) takes these
rules from here, and the connector checks a service's subjects with them before it
sends anything (meshbus.client.service), so a bad subject fails where it was written.

Subjects are bytes, as they travel: byte-exact, never decoded.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MAX_SUBJECT",
    "is_literal",
    "is_valid_queue",
    "is_valid_subject",
]

# The longest subject (with its queue group) a service may subscribe or publish to: it
# travels in a data frame's extension block (a u16 length, beside up to 32 KiB of
# headers) and in one route operation to the peers.
MAX_SUBJECT: Final = 16 * 1024

_SEPARATOR: Final = b"."
_ONE: Final = b"*"
_REST: Final = b">"
# What no token may hold (nats-server's IsValidSubject).
_WHITESPACE: Final = frozenset(b" \t\r\n\f")


def is_valid_subject(subject: bytes) -> bool:
    """Whether ``subject`` is a valid subscription pattern (a literal subject is one):
    non-empty tokens, no whitespace, ``>`` only as the last token."""
    if not subject or not _WHITESPACE.isdisjoint(subject):
        return False
    tokens = subject.split(_SEPARATOR)
    return all(tokens) and _REST not in tokens[:-1]


def is_valid_queue(queue: bytes) -> bool:
    """Whether ``queue`` is a queue group's name as a SUB carries one: not empty, no
    whitespace."""
    return bool(queue) and _WHITESPACE.isdisjoint(queue)


def is_literal(subject: bytes) -> bool:
    """Whether a valid ``subject`` has no wildcard token (a publish subject must not;
    nats-server checks it only for a pedantic client)."""
    return not any(token in (_ONE, _REST) for token in subject.split(_SEPARATOR))
