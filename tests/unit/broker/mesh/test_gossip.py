"""What the mesh tells NATS clients (meshbus.broker.mesh.gossip): the NATS addresses of
the peers that take NATS clients, carried in the handshake of each peer link, and the
list a broker's NATS listener gives as connect_urls -- as peers join, drain and crash,
and with a peer whose handshake has no NATS address (none, or an older broker)."""

from __future__ import annotations

import logging

import msgspec
import pytest

from meshbus.broker.mesh.gossip import checked_nats_address, nats_urls
from meshbus.broker.server import Broker
from meshbus.protocol.codec import FrameError, decode_body
from meshbus.protocol.control import MAX_NATS_ADDRESS, BrokerInfo, Hello, Welcome
from meshbus.protocol.layout import ControlType, ErrorCode
from meshbus.testing import FakeNetwork, address_of, start_broker


def info(name: str, nats: str, *, ready: bool = True, draining: bool = False) -> BrokerInfo:
    return BrokerInfo(name=name, address=address_of(name), nats=nats, ready=ready,
                      draining=draining)  # fmt: skip


def test_the_urls_are_those_of_peers_that_take_clients() -> None:
    peers = [
        info("c", "c.example:4222"),
        info("b", "b.example:4222"),
        info("joining", "j.example:4222", ready=False),
        info("leaving", "l.example:4222", draining=True),
        info("old", ""),  # no NATS listener, or a broker before the field
        info("twin", "b.example:4222"),  # two brokers behind one address
    ]
    assert nats_urls(peers) == ["b.example:4222", "c.example:4222"]
    assert nats_urls([]) == []


@pytest.mark.parametrize(
    "address", ["127.0.0.1:4222", "[::1]:4222", "nats-2.eu-west.example:1", "[::ffff:1.2.3.4]:4222"]
)
def test_an_address_a_client_can_dial_is_kept(address: str) -> None:
    assert checked_nats_address("b", address) == address


def test_no_address_is_none() -> None:
    assert checked_nats_address("b", "") == ""


@pytest.mark.parametrize(
    "address",
    ["nats.example", "nats.example:0", "nats.example:99999", ":4222", "a b:4222",
     "x\r\nPING:4222", 'x",":4222', "nats.example:port", "::1:4222", "[fe80::1%eth0]:4222"],
)  # fmt: skip
def test_an_address_no_client_can_dial_is_dropped_and_logged(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "meshbus.broker"):
        assert checked_nats_address("b", address) == ""
    assert [r.peer for r in caplog.records] == ["b"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("body", [Hello, Welcome])
def test_a_handshake_address_past_its_bound_is_a_protocol_error(body: type) -> None:
    ctype = ControlType.HELLO if body is Hello else ControlType.WELCOME
    fits = msgspec.msgpack.encode(body(nats="n" * (MAX_NATS_ADDRESS - 5) + ":4222"))
    assert decode_body(ctype, fits).nats.endswith(":4222")  # type: ignore[union-attr]
    too_long = msgspec.msgpack.encode(body(nats="n" * MAX_NATS_ADDRESS + ":4222"))
    with pytest.raises(FrameError) as error:
        decode_body(ctype, too_long)
    assert error.value.code == ErrorCode.PROTOCOL_ERROR


def nats_of(name: str) -> str:
    return f"{name}.nats.example:4222"


async def broker(network: FakeNetwork, name: str, *, nats: bool = True) -> Broker:
    """A broker that takes NATS clients at ``nats_of(name)`` (``nats`` False: none, as a
    broker of an older meshbus says nothing of one); the first founds the mesh."""
    seeds = [address_of("a")] if name != "a" else []
    advertise = nats_of(name) if nats else ""
    return await start_broker(network, name, seeds=seeds, nats_advertise=advertise)


async def test_each_broker_learns_its_peers_nats_addresses(network: FakeNetwork) -> None:
    a = await broker(network, "a")
    b = await broker(network, "b")
    c = await broker(network, "c")
    old = await broker(network, "old", nats=False)
    await network.settle()
    # a learnt b, c from their HELLOs; b and c learnt a from its WELCOME, each other
    # from whichever dialled. The older broker is linked all the same, with no address.
    assert a.mesh.gossip.nats_urls == [nats_of("b"), nats_of("c")]
    assert b.mesh.gossip.nats_urls == [nats_of("a"), nats_of("c")]
    assert c.mesh.gossip.nats_urls == [nats_of("a"), nats_of("b")]
    assert old.mesh.gossip.nats_urls == [nats_of("a"), nats_of("b"), nats_of("c")]
    assert sorted(a.peers.names()) == ["b", "c", "old"]
    # What the operator sees in the mesh table: each broker's own, and its peers'.
    assert {s.name: s.nats for s in a.mesh.brokers()} == {
        "a": nats_of("a"), "b": nats_of("b"), "c": nats_of("c"), "old": "",
    }  # fmt: skip


async def test_a_draining_or_lost_peer_leaves_the_list(network: FakeNetwork) -> None:
    a = await broker(network, "a")
    b = await broker(network, "b")
    c = await broker(network, "c")
    await broker(network, "d")
    await network.settle()
    assert a.mesh.gossip.nats_urls == [nats_of(n) for n in "bcd"]
    await c.mesh.drain(0.0)  # its clients go to lame duck mode; the others' leave it out
    await network.settle()
    assert a.mesh.gossip.nats_urls == [nats_of("b"), nats_of("d")]
    assert b.mesh.gossip.nats_urls == [nats_of("a"), nats_of("d")]
    network.crash(address_of("d"))
    await network.settle()
    assert a.mesh.gossip.nats_urls == [nats_of("b")]
    await c.mesh.stop()
    await network.settle()
    assert a.mesh.gossip.nats_urls == [nats_of("b")]
    await b.mesh.stop()  # a goodbye
    await network.settle()
    assert a.mesh.gossip.nats_urls == []
