"""Who is linked to this broker: every open link, the connectors among them, and the
peer brokers by name.

The registries only keep track; what happens when a link opens or closes is the
broker's (meshbus.broker.server), and who joins or leaves ``Peers`` is the mesh's
(meshbus.broker.mesh.membership) to decide. Every other part reads them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from meshbus.broker.core.endpoint import CloseReason
from meshbus.broker.core.link import Link
from meshbus.broker.security.handshakes import HandshakesBySource


class LinkRegistry:
    def __init__(self, max_handshaking_per_source: int) -> None:
        self.links: dict[int, Link] = {}
        self.connectors: set[Link] = set()  # open connector links
        self.operators: set[Link] = set()  # open operator links (--max-operators)
        # Accepted links that have not finished their handshake (HELLO, and the sign-in
        # when the broker has users) -> when they must have: in deadline order, as each
        # gets the same timeout (--max-handshaking, --handshake-timeout).
        self.handshaking: dict[Link, float] = {}
        # The same links by the address they come from, with those still in their TLS
        # handshake (--max-handshaking-per-source, meshbus.broker.security.handshakes).
        self.by_source: HandshakesBySource[Link] = HandshakesBySource(max_handshaking_per_source)
        self.accepted = 0
        self.closed: Counter[str] = Counter()  # closed links by reason
        # Traffic of links that have closed; open links keep their own counts.
        self._closed_msgs_in = 0
        self._closed_msgs_out = 0
        self._closed_bytes_in = 0
        self._closed_bytes_out = 0
        self._next_id = 1

    def next_id(self) -> int:
        link_id = self._next_id
        self._next_id += 1
        return link_id

    def opened(self, link: Link) -> None:
        self.links[link.link_id] = link
        if not link.dialled:
            self.accepted += 1

    def connector_opened(self, link: Link) -> None:
        self.connectors.add(link)

    def operator_opened(self, link: Link) -> None:
        self.operators.add(link)

    def handshake_done(self, link: Link) -> None:
        """``link`` finished its handshake (a peer's HELLO, or a connector's or operator's
        HELLO and sign-in): no longer timed."""
        self.handshaking.pop(link, None)
        self.by_source.remove(link)

    def late_handshakes(self, now: float) -> list[Link]:
        """The links still handshaking at their deadline; costs what is late."""
        late = []
        for link, deadline in self.handshaking.items():
            if deadline > now:
                break
            late.append(link)
        return late

    def close(self, link: Link, reason: CloseReason) -> bool:
        """Forget ``link``; True when it was a connector."""
        self.links.pop(link.link_id, None)
        self.handshaking.pop(link, None)
        self.by_source.remove(link)
        self.operators.discard(link)
        self.closed[reason.value] += 1
        self._closed_msgs_in += link.msgs_in
        self._closed_msgs_out += link.msgs_out
        self._closed_bytes_in += link.bytes_in
        self._closed_bytes_out += link.bytes_out
        if link in self.connectors:
            self.connectors.discard(link)
            return True
        return False

    def msgs_in(self) -> int:
        """Messages read since the broker started, over every link it has had."""
        return self._closed_msgs_in + sum(link.msgs_in for link in self.links.values())

    def msgs_out(self) -> int:
        return self._closed_msgs_out + sum(link.msgs_out for link in self.links.values())

    def traffic_bytes(self) -> tuple[int, int]:
        """Bytes read and written since the broker started, over every link it has had."""
        links = self.links.values()
        return (
            self._closed_bytes_in + sum(link.bytes_in for link in links),
            self._closed_bytes_out + sum(link.bytes_out for link in links),
        )


class Peers:
    """The open links to peer brokers, by broker name."""

    def __init__(self) -> None:
        self._by_name: dict[str, Link] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def get(self, name: str) -> Link | None:
        return self._by_name.get(name)

    def links(self) -> list[Link]:
        return list(self._by_name.values())

    def items(self) -> list[tuple[str, Link]]:
        return list(self._by_name.items())

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def add(self, link: Link) -> None:
        self._by_name[link.name] = link

    def remove(self, link: Link) -> bool:
        """Forget ``link`` if it is the open link to its broker; True if it was."""
        if self._by_name.get(link.name) is not link:
            return False
        del self._by_name[link.name]
        return True

    def send_all(self, frame: bytes) -> None:
        for link in self._by_name.values():
            link.send(frame)
