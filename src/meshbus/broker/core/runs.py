"""How many frames of a read belong to the current run, counted at C speed.

``Link._process`` (meshbus.broker.core.link) keeps runs of frames with one routing
decision. Once a run is a few frames long, the frames after it are counted here,
without a turn of the Python loop per frame: ``frames_in`` for a run over several
routing keys (a producer interleaving destinations), ``same_key_frames`` for a run of
one key (a burst to one destination). Both only count: the decisions were made, and
every check on a frame passed, when each key's decision was cached.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator
from operator import length_hint

from meshbus.address import ADDRESS_SIZE
from meshbus.protocol.layout import OFF_DST, OFF_SRC, ROUTING_KEY_SIZE

# The frames a same-key run's first byte-column check covers (``_same_key_frames``), then
# twice as many each time: 40 strided slices cost what about 100 frames' set lookups do.
_FIRST_CHUNK = 256
# The key's bytes in the order they are checked: a run's next key most often differs in
# its destination, then in its length or flags, and seldom in its source.
_KEY_COLUMNS = (
    *range(OFF_DST + ADDRESS_SIZE - 1, OFF_DST - 1, -1),
    *range(OFF_DST),
    *range(OFF_SRC, ROUTING_KEY_SIZE),
)


@functools.lru_cache(maxsize=64)
def _scan_keys(size: int) -> Callable[[memoryview], Iterator[tuple[bytes]]]:
    """The routing keys of consecutive frames of ``size`` bytes, one 1-tuple each."""
    return struct.Struct(f"{ROUTING_KEY_SIZE}s{size - ROUTING_KEY_SIZE}x").iter_unpack


def frames_in(keys: set[tuple[bytes]], mv: memoryview, pos: int, end: int, size: int) -> int:
    """How many whole frames of ``size`` bytes from ``pos`` have their routing key in
    ``keys``, up to the first that has not (or the end of the read).

    Sound without looking at each frame's length: a key holds the length field, and
    every key in ``keys`` is one of frames of ``size`` bytes. One C-level pass:
    ``issuperset`` stops at the first key missing, and the iterator's length hint says
    how far it got."""
    count = (end - pos) // size
    scan = _scan_keys(size)(mv[pos : pos + count * size])
    if keys.issuperset(scan):
        return count
    return count - length_hint(scan) - 1


def same_key_frames(
    key: bytes,
    keys: set[tuple[bytes]],
    buf: bytearray,
    mv: memoryview,
    pos: int,
    end: int,
    size: int,
) -> int:
    """``frames_in`` for a run whose frame at ``pos`` has routing key ``key`` (one of
    ``keys``), faster while the frames keep that key: a chunk of them is checked a byte
    column at a time -- each of the key's 40 bytes, in every frame of the chunk, by one
    strided slice compared with that byte repeated -- with no object made per frame.
    From the first chunk with another key in it, the set lookups take over."""
    left = (end - pos) // size
    at = pos
    chunk = _FIRST_CHUNK
    while left >= _FIRST_CHUNK:
        count = min(chunk, left)
        last = at + count * size
        if any(buf[at + i : last : size] != key[i : i + 1] * count for i in _KEY_COLUMNS):
            break
        at = last
        left -= count
        chunk *= 2
    counted = (at - pos) // size
    return counted + frames_in(keys, mv, at, end, size) if left else counted
