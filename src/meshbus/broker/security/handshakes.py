"""The connections in their handshake, by the address they come from (docs/security.md,
"One source cannot lock others out").

``--max-handshaking`` bounds the connections of the whole broker that have not finished
their handshake; alone, one source that holds that many idle connections keeps every
other client out for as long as it holds them. So each source may have at most
``--max-handshaking-per-source`` of them, well below the global bound, and a new
connection from a source at its cap does not wait or get refused: the one of that
source that has waited longest in its handshake is closed instead. A client that says
HELLO at once finishes its handshake in a round trip, long before a flood from its own
address has opened that many newer connections, so it always gets in.
"""

from __future__ import annotations

import ipaddress
from typing import Generic, TypeVar

Connection = TypeVar("Connection")

# IPv6 hosts get a /64 each (RFC 4291 addresses a subnet's interfaces in the low 64 bits):
# one holder of a /64 has 2^64 addresses to come from, so the prefix is the source.
_IPV6_SOURCE_PREFIX = 64


def source_of(host: str) -> str:
    """The source a connection from ``host`` (an IP address as the socket gave it) is
    counted against: the IPv4 address (an IPv4-mapped IPv6 one too), or the IPv6 /64;
    anything else (a Unix socket, a test's fake network) as it is."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, _IPV6_SOURCE_PREFIX), strict=False))
    return str(address)


class HandshakesBySource(Generic[Connection]):
    """The connections of each source that are in their handshake, oldest first; at
    most ``per_source`` of one source. The caller closes what ``add`` hands back, and
    ``remove``s a connection when its handshake is done or it closes."""

    def __init__(self, per_source: int) -> None:
        if per_source < 1:
            raise ValueError(f"per_source must be at least 1, not {per_source}")
        self.per_source = per_source
        # Insertion-ordered: the first connection of a source is the one waiting longest.
        self._by_source: dict[str, dict[Connection, None]] = {}
        self._source: dict[Connection, str] = {}

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, connection: object) -> bool:
        return connection in self._source

    def sources(self) -> int:
        """Sources with connections in their handshake."""
        return len(self._by_source)

    def count(self, source: str) -> int:
        """Connections of ``source`` in their handshake."""
        return len(self._by_source.get(source, ()))

    def add(self, source: str, connection: Connection) -> Connection | None:
        """``connection``, from ``source``, starts its handshake. When ``source`` already
        had ``per_source`` connections in theirs: the one that has waited longest, now
        forgotten here, for the caller to close."""
        if connection in self._source:
            raise ValueError(f"{connection!r} is already counted")
        waiting = self._by_source.setdefault(source, {})
        evicted = None
        if len(waiting) >= self.per_source:
            evicted = next(iter(waiting))
            del waiting[evicted]
            del self._source[evicted]
        waiting[connection] = None
        self._source[connection] = source
        return evicted

    def remove(self, connection: Connection) -> None:
        """``connection`` finished its handshake, or closed; nothing if it was not here."""
        source = self._source.pop(connection, None)
        if source is None:
            return
        waiting = self._by_source[source]
        del waiting[connection]
        if not waiting:
            del self._by_source[source]


def evicted_why(per_source: int, host: str) -> str:
    """Why a connection was closed to make room for a newer one from its source."""
    return (
        f"closed to make room: {per_source} connections from {host} were in their handshake "
        "(the broker's --max-handshaking-per-source) and this one had waited longest; a "
        "client that says HELLO as soon as it connects is not closed so"
    )
