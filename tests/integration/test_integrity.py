"""Answers only the right sender can give (issue 14, item 5): real brokers, forgers on
raw links.

* A response counts only from whom its request went to: a service spraying
  ``response_for`` = 1..N at a requester answers nothing, and its frames are dropped and
  counted (``dropped_wrong_responder`` where an entry waited, ``late_responses`` where
  none did) -- on the broker that picked the anycast member, and on the entry broker.
* An acknowledgement counts only from an address the reliable message was sent to: a
  forged ACK leaves the send unacknowledged (``conn.refused_acks``) until the real
  receiver acks.

Barriers, not sleeps: frames of one path arrive in order, so a marker sent after the
forged frames (or a STAT over the same link) proves they were handled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

import meshbus
from meshbus.protocol import ControlType, DataFrame, encode_control
from meshbus.protocol.control import Membership
from meshbus.protocol.ext import ack_frames
from meshbus.protocol.layout import FLAG_RESPONSE
from tests.conftest import BrokerProcess
from tests.integration.helpers import (
    IO_TIMEOUT,
    RawLink,
    data_frame,
    stat,
    wait_members,
    wait_until,
)

SPRAY = 40  # response_for values a forger tries: a connector's message ids count from 1
POOL = meshbus.Anycast("workers")


@contextlib.asynccontextmanager
async def raw_service(broker: BrokerProcess, name: str) -> AsyncIterator[tuple[RawLink, bytes]]:
    """A link driven by hand with one registered service: a forger, or a receiver that acks
    only when told."""
    link = await RawLink.open(broker.address)
    try:
        await link.hello(name)
        yield link, await link.register(name)
    finally:
        await link.close()


async def join(link: RawLink, member: bytes, group: meshbus.Address) -> None:
    correlation = link.next_correlation()
    body = Membership(member=member, group=group.to_bytes())
    await link.send(encode_control(ControlType.JOIN, body, correlation))
    while (frame := await link.read_control()).correlation != correlation:
        pass  # news (BROKERS), not the answer
    assert frame.type == ControlType.OK, frame


async def next_data(link: RawLink, timeout: float = IO_TIMEOUT) -> DataFrame:
    while not isinstance(frame := await link.read_frame(timeout), DataFrame):
        pass
    return frame


async def spray(link: RawLink, forger: bytes, requester: meshbus.Address) -> None:
    await link.send(
        b"".join(
            data_frame(requester, forger, b"forged", response_for=i, flags=FLAG_RESPONSE)
            for i in range(1, SPRAY + 1)
        )
    )


async def counters(broker: BrokerProcess) -> dict[str, int]:
    found: dict[str, int] = (await stat(broker, detail=False))["counters"]
    return found


async def test_forged_responses_do_not_answer_a_request(broker, conns):
    requester = await conns[0].register()
    server = await conns[1].register()
    before = await counters(broker)
    async with raw_service(broker, "forger") as (forger_link, forger):
        asked = asyncio.create_task(requester.request(server.address, b"q", timeout=5))
        request = await server.recv(timeout=IO_TIMEOUT)  # the server is slow: no reply yet
        await spray(forger_link, forger, requester.address)
        await forger_link.ping()  # the broker has routed the spray
        await conns[0].stat()  # and the requester has read whatever reached it
        assert not asked.done(), "a forged response answered the request"
        await request.reply(b"real")
        answer = await asked
        assert (answer.payload, answer.src) == (b"real", server.address)
        await request.reply(b"again")  # a duplicate: its entry is gone
        await conns[1].stat()  # over the server's link: the duplicate was handled
    after = await counters(broker)
    assert after["dropped_wrong_responder"] - before["dropped_wrong_responder"] == 1
    assert after["late_responses"] - before["late_responses"] == SPRAY - 1 + 1
    assert conns[0].dropped == 0, "nothing forged or duplicated reached the requester"


@pytest.mark.parametrize(
    "group", [POOL, meshbus.Multicast("questions")], ids=["anycast", "multicast"]
)
async def test_a_group_member_on_a_peer_answers_alone(mesh2, group):
    """The member is on the other broker, which delivered the request to it (picked it,
    for anycast): a connector beside it cannot answer in its place, even with the
    request's own id (the spray covers it), and neither can one beside the requester."""
    entry, picking = mesh2
    async with (
        await meshbus.connect(entry.address, server="asker") as asking_conn,
        await meshbus.connect(picking.address, server="worker") as working_conn,
        raw_service(picking, "forger") as (far_link, far_forger),
        raw_service(entry, "forger") as (near_link, near_forger),
    ):
        requester = await asking_conn.register()
        worker = await working_conn.register()
        await worker.join(group)
        await wait_members(mesh2, group, 1)
        asked = asyncio.create_task(requester.request(group, b"q", timeout=5))
        request = await worker.recv(timeout=IO_TIMEOUT)
        await spray(far_link, far_forger, requester.address)
        await spray(near_link, near_forger, requester.address)

        async def all_dropped() -> bool:
            near, far = await counters(entry), await counters(picking)
            dropped = near["dropped_wrong_responder"] + near["late_responses"]
            return dropped + far["dropped_wrong_responder"] == 2 * SPRAY

        await wait_until(all_dropped, "every forged response dropped")
        await asking_conn.stat()
        assert not asked.done(), "a forged response answered the request"
        # The picking broker caught the forger behind it; the entry broker the one here.
        assert (await counters(picking))["dropped_wrong_responder"] == 1
        assert (await counters(entry))["dropped_wrong_responder"] == 1
        await request.reply(b"real")
        answer = await asked
        assert (answer.payload, answer.src) == (b"real", worker.address)
        assert asking_conn.dropped == 0


async def forged_ack_is_refused(
    conn: meshbus.Connector,
    sender: meshbus.Service,
    forger_link: RawLink,
    forger: bytes,
    msg_id: int,
) -> None:
    """The forger acks ``msg_id`` and then sends a marker: once the sender has the marker it
    has handled the ACK, and the send must still wait."""
    refused = conn.refused_acks
    await forger_link.send(b"".join(ack_frames(forger, sender.address.to_bytes(), [msg_id])))
    await forger_link.send(data_frame(sender.address, forger, b"marker"))
    assert (await sender.recv(timeout=IO_TIMEOUT)).payload == b"marker"
    assert conn.unacked == 1, "a forged ACK completed a reliable send"
    assert conn.refused_acks == refused + 1


async def test_a_forged_ack_does_not_complete_a_reliable_send(broker, conns):
    sender = await conns[0].register()
    async with (
        raw_service(broker, "receiver") as (receiver_link, receiver),
        raw_service(broker, "forger") as (forger_link, forger),
    ):
        msg_id = await sender.send(meshbus.Address.from_bytes(receiver), b"x", reliable=True)
        assert (await next_data(receiver_link)).msg_id == msg_id
        await forged_ack_is_refused(conns[0], sender, forger_link, forger, msg_id)
        await receiver_link.send(
            b"".join(ack_frames(receiver, sender.address.to_bytes(), [msg_id]))
        )
        await conns[0].wait_acked(timeout=IO_TIMEOUT)
        assert conns[0].unacked == 0


@pytest.mark.parametrize("group", [None, "order-17"], ids=["anycast", "message-group"])
async def test_only_the_picked_member_acks_an_anycast(broker, conns, group):
    sender = await conns[0].register()
    async with (
        raw_service(broker, "member") as (one_link, one),
        raw_service(broker, "member") as (other_link, other),
    ):
        for link, member in ((one_link, one), (other_link, other)):
            await join(link, member, POOL)
        msg_id = await sender.send(POOL, b"x", reliable=True, group=group)
        reads = {
            asyncio.create_task(next_data(link)): (link, member)
            for link, member in ((one_link, one), (other_link, other))
        }
        done, waiting = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
        for task in waiting:
            task.cancel()
        (got,) = done
        assert got.result().msg_id == msg_id
        picked_link, picked = reads[got]
        forger_link, forger = next(v for t, v in reads.items() if t is not got)
        # A member of the same pool, but not the one the message went to.
        await forged_ack_is_refused(conns[0], sender, forger_link, forger, msg_id)
        await picked_link.send(b"".join(ack_frames(picked, sender.address.to_bytes(), [msg_id])))
        await conns[0].wait_acked(timeout=IO_TIMEOUT)
