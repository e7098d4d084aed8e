"""The client's side of the stream requests: what it makes of a STREAM reply."""

from __future__ import annotations

from typing import Any

from meshbus.client.streams import StreamInfo

INFO: dict[str, Any] = {
    "name": "orders",
    "broker": "b1",
    "captures": ["multicast:orders"],
    "first_seq": 1,
    "last_seq": 3,
    "messages": 3,
    "bytes": 17,
    "consumers": [],
    "max_msgs": 0,
    "max_bytes": 0,
    "max_age": 0.0,
    "dedupe_window": 120.0,
    "store": "",
    "host": "h",
    "owner": "alice",
}


def test_the_info_of_a_reply_keeps_every_field_the_broker_sent() -> None:
    info = StreamInfo.from_reply(INFO)
    assert (info.name, info.owner, info.last_seq) == ("orders", "alice", 3)


def test_a_key_of_a_newer_broker_is_left_out_not_an_error() -> None:
    assert StreamInfo.from_reply({**INFO, "shards": 3}) == StreamInfo.from_reply(INFO)


def test_an_older_broker_without_owners_gives_nobody_s_stream() -> None:
    older = {key: value for key, value in INFO.items() if key != "owner"}
    assert StreamInfo.from_reply(older).owner == ""


def test_service_fetch_is_typed_as_the_stream_messages_it_returns() -> None:
    from typing import get_type_hints

    from meshbus.client.service import Service
    from meshbus.client.streams import StreamMessage

    assert get_type_hints(Service.fetch)["return"] == list[StreamMessage]
