"""Groups a stream captured, whose stream was lost with its broker's link.

A reliable multicast to a group without members succeeds at once: nobody can miss it.
For a group a stream captures, "no member" means something else -- the stream's broker
(an R=1 stream's host, a replicated stream's leader) is down or out of reach -- and the
send, counted as delivered, would be stored nowhere. So when a peer's link closes, the
groups its stream members were in are remembered here, and while such a group has no
member the broker answers MEMBERS with TRY_AGAIN: the sender asks again (the stream's
new leader may take the address over in a moment) and, past its deadline, raises
``meshbus.Timeout`` instead of taking a send nobody stored for an acknowledged one.

A mark goes when the group has a member again, or when that peer links again and its
whole table has arrived: the stream is back, or was deleted meanwhile. A broker that
never comes back leaves its marks for the life of this process (bounded, ``limit``):
its streams cannot take a send, and their senders hear so. The marks go with this
broker's snapshot to a peer that links (``OP_LOST_CAPTURE``): a broker started while
the stream's brokers are out of its reach never saw their members, and takes the marks
of those it is not linked to.

A stream member is told by its server name: ``stream`` (an R=1 stream's dynamic address)
or ``rstream`` (a replicated stream's fixed one), names no connector may register
(meshbus.broker.core.reserved).
"""

from __future__ import annotations

from collections.abc import Iterable

from meshbus.broker.core.reserved import REPLICATED_STREAM_SERVER, STREAM_SERVER

STREAM_SERVERS = frozenset((STREAM_SERVER, REPLICATED_STREAM_SERVER))

# Groups remembered at most: 16 bytes and a name each. Past it the oldest mark goes (its
# senders are back to "no member").
DEFAULT_LIMIT = 65536


class LostCaptures:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._limit = limit
        self._lost: dict[bytes, str] = {}  # group -> the broker its stream member was on

    def __len__(self) -> int:
        return len(self._lost)

    def lost(self, broker: str, groups: Iterable[bytes]) -> None:
        """``broker``'s link closed while its stream members were in ``groups``."""
        lost = self._lost
        for group in groups:
            lost.pop(group, None)  # the newest mark last: the oldest goes first
            lost[group] = broker
        while len(lost) > self._limit:
            del lost[next(iter(lost))]

    def linked(self, broker: str) -> None:
        """``broker`` linked again and its whole table arrived: what it holds is known."""
        if broker in self._lost.values():
            self._lost = {g: b for g, b in self._lost.items() if b != broker}

    def marks(self) -> list[tuple[bytes, str]]:
        """Every mark: (group, the broker its stream went with)."""
        return list(self._lost.items())

    def holder(self, group: bytes, has_members: bool) -> str | None:
        """The broker whose loss took the stream member of ``group``, if the group has no
        member now; a group with members forgets its mark."""
        if has_members:
            self._lost.pop(group, None)
            return None
        return self._lost.get(group)
