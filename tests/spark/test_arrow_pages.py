"""Stored blocks to Arrow batches (``reader.to_batch``), without a Spark session: every
column matches the stored messages, across blocks stored at different times, with
one or many distinct values, sliced at both ends by the block and by the range."""

from __future__ import annotations

import datetime

import pytest

from meshbus.address import Address
from meshbus.protocol.blocks import BlockSlice, encode_block
from meshbus.protocol.headers import encode_headers
from meshbus.spark.options import parse_read
from meshbus.spark.reader import COLUMNS, SCHEMA, SeqRange, to_batch

pytestmark = [pytest.mark.spark]

A, B = (
    Address.parse("unicast:game:1").to_bytes(),
    Address.parse("unicast:game:2").to_bytes(),
)
TOPIC = Address.parse("multicast:scores").to_bytes()


def block(
    first: int,
    at: float,
    srcs: list[bytes],
    groups: list[bytes],
    prios: list[int],
    headers: list[bytes] | None = None,
) -> BlockSlice:
    n = len(srcs)
    payloads = [b"p%d" % (first + i) for i in range(n)]
    data = encode_block(srcs, [TOPIC] * n, payloads, groups, prios, [b""] * n, headers or [])
    return BlockSlice(first, at, 0, n, data)


def test_blocks_become_one_arrow_batch_of_the_stored_messages() -> None:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    # seqs 10-13 from one sender at t=5, then 14-18 from two senders with groups at t=6
    one = block(10, 5.0, [A] * 4, [b""] * 4, [0] * 4)
    trace = encode_headers({"Trace": "t1", "Zone": "eu"})
    headers = [b"", trace, b"", b"", trace]
    two = block(14, 6.25, [A, B, A, B, B], [b"", b"g", b"g", b"", b"h"], [0, 1, 0, 2, 0], headers)
    one = BlockSlice(one.first_seq, one.stored_at, 1, one.stop, one.data)  # the block starts at 11
    options = parse_read({"brokers": "127.0.0.1:1", "stream": "scores"}, streaming=True)
    part = SeqRange(options, tuple(COLUMNS), 12, 17)  # the range cuts both blocks
    batch = to_batch(part, [one, two], to_arrow_schema(SCHEMA, timezone="UTC"))
    utc = datetime.UTC
    rows = batch.to_pylist()
    assert [r["seq"] for r in rows] == [12, 13, 14, 15, 16]
    assert [r["payload"] for r in rows] == [b"p12", b"p13", b"p14", b"p15", b"p16"]
    assert [r["stored_at"] for r in rows] == [datetime.datetime.fromtimestamp(5.0, utc)] * 2 + [
        datetime.datetime.fromtimestamp(6.25, utc)
    ] * 3
    a, b = str(Address.from_bytes(A)), str(Address.from_bytes(B))
    assert [r["src"] for r in rows] == [a, a, a, b, a]
    assert {r["dst"] for r in rows} == {"multicast:scores"}
    assert [r["group"] for r in rows] == [None, None, None, "g", "g"]
    assert [r["priority"] for r in rows] == [0, 0, 0, 1, 0]
    assert {r["stream"] for r in rows} == {"scores"}
    # A map column: Arrow gives a map as its (key, value) pairs.
    assert [r["headers"] for r in rows] == [
        None,
        None,
        None,
        [("Trace", "t1"), ("Zone", "eu")],
        None,
    ]
    # Starting inside a block with many distinct values: the index is read from there.
    wanted = ("seq", "src", "group", "priority")
    schema = to_arrow_schema(StructType([SCHEMA[name] for name in wanted]), timezone="UTC")
    tail = to_batch(SeqRange(options, wanted, 15, 19), [two], schema).to_pylist()
    assert [(r["seq"], r["src"], r["group"], r["priority"]) for r in tail] == [
        (15, b, "g", 1),
        (16, a, "g", 0),
        (17, b, None, 2),
        (18, b, "h", 0),
    ]
