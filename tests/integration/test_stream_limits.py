"""What streams may take of a broker: streams hosted, bytes per stream, bytes per data
dir. Past a limit the request (or the append) is refused, naming the limit and its
flag; nothing else breaks."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

import meshbus
from meshbus import Timeout
from meshbus.errors import StreamError
from meshbus.protocol.layout import ControlType, ErrorCode
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import RawLink
from tests.integration.test_bad_input import assert_rejected, control_raw


async def test_streams_per_broker_and_bytes_per_stream(tmp_path: Path) -> None:
    broker = await start_broker(
        "--data-dir", str(tmp_path), "--max-streams", "2", "--max-stream-bytes", "5000"
    )
    try:
        async with await meshbus.connect(broker.address, server="admin") as conn:
            with pytest.raises(StreamError) as too_big:
                await conn.streams.add("big", "multicast:big", max_bytes=5001)
            assert str(too_big.value) == (
                "stream 'big': max_bytes 5001 is more than this broker allows a stream, "
                "5000 bytes (meshbus broker --max-stream-bytes)"
            )
            first = await conn.streams.add("one", "multicast:one")
            assert first.max_bytes == 5000  # no max_bytes: the broker's cap
            await conn.streams.add("two", "multicast:two", max_bytes=100)
            assert (await conn.streams.add("one", "multicast:one")).name == "one"  # again
            with pytest.raises(StreamError, match=r"hosts 2 streams, its limit.*--max-streams"):
                await conn.streams.add("three", "multicast:three")
            publisher = await conn.register()
            for i in range(20):
                await publisher.send_reliable("multicast:one", b"%03d" % i + b"x" * 497)
            info = await conn.streams.info("one")
            assert (info.first_seq, info.last_seq, info.bytes) == (11, 20, 5000)
            await conn.streams.delete("two")
            await conn.streams.add("three", "multicast:three")
            await conn.ping()
    finally:
        assert await stop_all([broker]) == [0]


async def test_an_append_past_the_data_dir_limit_is_not_acknowledged(tmp_path: Path) -> None:
    broker = await start_broker("--data-dir", str(tmp_path), "--max-store-bytes", "10000")
    try:
        async with await meshbus.connect(broker.address, server="pub") as conn:
            await conn.streams.add("log", "multicast:log")
            publisher = await conn.register()
            for _ in range(10):
                await publisher.send_reliable("multicast:log", b"x" * 1000)
            await publisher.send("multicast:log", b"y" * 1000, reliable=True)
            with pytest.raises(Timeout):
                await conn.wait_acked(1.0)
            assert conn.unacked == 1
            info = await conn.streams.info("log")
            assert (info.messages, info.bytes) == (10, 10000)
            await conn.streams.add("log2", "multicast:log2", max_bytes=100)  # adding works
            await conn.ping()
    finally:
        assert await stop_all([broker]) == [0]


@pytest.mark.parametrize(
    "body",
    [
        {"op": "add", "stream": "huge", "captures": [], "max_msgs": 2**64 - 1},
        {"op": "consumer_add", "stream": "s", "consumer": "c", "start_seq": 2**64 - 1},
        {"op": "fetch", "stream": "s", "from_seq": 2**63},
    ],
    ids=["max_msgs", "start_seq", "from_seq"],
)
async def test_a_number_out_of_range_is_a_protocol_error(
    broker: BrokerProcess, body: dict[str, object]
) -> None:
    link = await RawLink.open(broker.address)
    try:
        await link.hello("bad")
        await link.send(control_raw(int(ControlType.STREAM), msgspec.msgpack.encode(body)))
        error = await assert_rejected(link, ErrorCode.PROTOCOL_ERROR)
        assert error.message.startswith("malformed STREAM body: Expected `int` <= ")
    finally:
        await link.close()
    async with await meshbus.connect(broker.address, server="still") as conn:
        await conn.streams.add("s", "multicast:s")
        await conn.ping()
