"""The per-source cap on connections in their handshake (meshbus.broker.security.handshakes): the
table itself, and the broker that closes the longest waiting of a source past it."""

from __future__ import annotations

import pytest

from meshbus.broker.observe.monitor import BrokerCollector
from meshbus.broker.security.handshakes import HandshakesBySource, source_of
from meshbus.protocol.codec import ControlFrame, encode_control
from meshbus.protocol.control import (
    MAX_SESSION,
    MAX_USER_NAME,
    TOKEN_PROOF_SIZE,
    Auth,
    Error,
    Hello,
)
from meshbus.protocol.handshake import MAX_HANDSHAKE_FRAME, NONCE_SIZE, SIGNATURE_SIZE
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import FakeNetwork, connect_client, describe_frame, start_broker

# -- the table ------------------------------------------------------------------------------


def test_a_source_at_its_cap_gives_up_the_connection_that_waited_longest() -> None:
    table: HandshakesBySource[str] = HandshakesBySource(per_source=2)
    assert table.add("10.0.0.1", "a1") is None
    assert table.add("10.0.0.1", "a2") is None
    assert table.add("10.0.0.2", "b1") is None
    assert table.add("10.0.0.1", "a3") == "a1"
    assert table.add("10.0.0.1", "a4") == "a2"
    assert "a1" not in table
    assert "a2" not in table
    assert (table.count("10.0.0.1"), table.count("10.0.0.2"), len(table)) == (2, 1, 3)


def test_a_connection_done_with_its_handshake_no_longer_counts() -> None:
    table: HandshakesBySource[str] = HandshakesBySource(per_source=2)
    table.add("10.0.0.1", "a1")
    table.add("10.0.0.1", "a2")
    table.remove("a1")  # said HELLO
    assert table.add("10.0.0.1", "a3") is None
    assert table.add("10.0.0.1", "a4") == "a2"
    table.remove("a3")
    table.remove("a4")
    table.remove("a4")  # twice, or never added: nothing
    assert table.count("10.0.0.1") == 0
    assert len(table) == 0


def test_the_table_refuses_a_cap_below_one_and_a_connection_counted_twice() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HandshakesBySource[str](per_source=0)
    table: HandshakesBySource[str] = HandshakesBySource(per_source=2)
    table.add("10.0.0.1", "a1")
    with pytest.raises(ValueError, match="already counted"):
        table.add("10.0.0.2", "a1")


@pytest.mark.parametrize(
    ("host", "source"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::7", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("fake", "fake"),
    ],
)
def test_the_source_is_the_ipv4_address_or_the_ipv6_64(host: str, source: str) -> None:
    assert source_of(host) == source


# -- what a handshake may send ----------------------------------------------------------------


def test_the_largest_auth_and_a_hello_fit_under_the_handshake_frame_cap() -> None:
    auth = Auth(
        user="\U0001f600" * MAX_USER_NAME,
        signature=bytes(SIGNATURE_SIZE),
        token_proof=bytes(TOKEN_PROOF_SIZE),
    )
    hello = Hello(
        name="n" * 256,
        session=bytes(MAX_SESSION),
        listen="broker-with-a-long-name.example.com:65535",
        nonce=bytes(NONCE_SIZE),
    )
    for body, ctype in ((auth, ControlType.AUTH), (hello, ControlType.HELLO)):
        assert len(encode_control(ctype, body)) <= MAX_HANDSHAKE_FRAME


# -- the broker -------------------------------------------------------------------------------


async def test_a_new_connection_from_a_source_at_its_cap_closes_its_longest_waiting(
    network: FakeNetwork,
) -> None:
    """Fake clients of one name come from one address."""
    broker = await start_broker(network, "a", max_handshaking_per_source=2)
    first, second = (
        connect_client(network, broker, "flood"),
        connect_client(network, broker, "flood"),
    )
    other = connect_client(network, broker, "elsewhere")
    await network.settle()
    valid = connect_client(network, broker, "flood")
    await valid.hello()  # at once: in, though its address is at its cap
    assert first.closed
    assert not second.closed
    assert not other.closed
    (frame,) = first.take(ControlType.ERROR)
    assert isinstance(frame, ControlFrame)
    assert isinstance(frame.body, Error), describe_frame(frame)
    assert frame.body.code == ErrorCode.LIMIT_EXCEEDED
    assert "--max-handshaking-per-source" in frame.body.message
    assert broker.links.by_source.count("flood") == 1  # second; valid is done


async def test_stat_and_metrics_count_the_connections_in_their_handshake(
    network: FakeNetwork,
) -> None:
    broker = await start_broker(network, "a")
    flood = [connect_client(network, broker, "flood") for _ in range(3)]
    other = connect_client(network, broker, "elsewhere")
    await network.settle()
    brief = broker.stat.brief()
    assert (brief["handshaking"], brief["handshaking_sources"]) == (4, 2)
    metrics = {
        family.name: family.samples[0].value
        for family in BrokerCollector(
            stat=broker.stat.brief, traffic_bytes=lambda: (0, 0), lag=broker.lag, streams=list
        ).collect()
        if family.name.startswith("meshbus_handshaking")
    }
    assert metrics == {"meshbus_handshaking": 4, "meshbus_handshaking_sources": 2}
    await other.hello()
    for client in flood[:2]:
        client.close()
    await network.settle()
    brief = broker.stat.brief()
    assert (brief["handshaking"], brief["handshaking_sources"]) == (1, 1)
