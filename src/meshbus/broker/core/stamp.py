"""Neighbour identifiers on frames sent to a peer broker (docs/architecture.md).

A frame a broker sends to a peer carries hops = 1 and, at offset 40, the link id that
peer gave us at the handshake. A run of frames bound for one peer is copied once and
stamped with a constant number of C-level writes, not one per frame.
"""

from __future__ import annotations

from meshbus.protocol.layout import OFF_HOPS, OFF_LINK_TAG, PEER_HOPS

_ONE = b"\x01"


def stamp_run(
    frames: memoryview | bytes | bytearray, count: int, size: int, tag: bytes
) -> bytearray:
    """A copy of ``count`` frames (``size`` bytes each, or 0 when sizes differ) with
    hops = 1 and link tag ``tag`` (4 bytes) written in, for one peer.

    Equal sizes: five strided slice assignments, whatever the count. Otherwise a
    walk over the frames' length fields."""
    out = bytearray(frames)
    if size:
        view = memoryview(out)
        view[OFF_HOPS::size] = _ONE * count
        for i in range(4):
            view[OFF_LINK_TAG + i :: size] = tag[i : i + 1] * count
        return out
    pos = 0
    end = len(out)
    while pos < end:
        out[pos + OFF_HOPS] = PEER_HOPS
        out[pos + OFF_LINK_TAG : pos + OFF_LINK_TAG + 4] = tag
        pos += int.from_bytes(out[pos : pos + 4], "big") + 4
    return out
