"""LostCaptures, and the routing table's part in it: which groups a lost peer's stream
members were in, and how long "no member" is not the answer for them."""

from __future__ import annotations

from meshbus.address import Multicast, Unicast
from meshbus.broker.core.captures import STREAM_SERVERS, LostCaptures
from meshbus.broker.core.reserved import REPLICATED_STREAM_SERVER, STREAM_SERVER
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.replication.streams import member_address

ORDERS = Multicast("orders").to_bytes()
AUDIT = Multicast("audit").to_bytes()
CHAT = Multicast("chat").to_bytes()


def test_the_groups_of_a_links_stream_members_and_none_of_its_services() -> None:
    routing: RoutingTable[str] = RoutingTable(slot=3)
    r1 = routing.allocate_dynamic(STREAM_SERVER, "peer-a")
    replicated = member_address("ledger")
    routing.add_service(replicated, "peer-a")
    game = Unicast("game01", 1).to_bytes()
    routing.add_service(game, "peer-a")
    other = routing.allocate_dynamic(STREAM_SERVER, "peer-b")
    routing.join(r1, ORDERS)
    routing.join(r1, AUDIT)
    routing.join(replicated, AUDIT)
    routing.join(game, CHAT)
    routing.join(other, CHAT)
    assert (r1[1:12], replicated[1:12]) == (STREAM_SERVER, REPLICATED_STREAM_SERVER)
    assert routing.groups_of_servers("peer-a", STREAM_SERVERS) == {ORDERS, AUDIT}
    assert routing.groups_of_servers("peer-b", STREAM_SERVERS) == {CHAT}
    assert routing.groups_of_servers("peer-c", STREAM_SERVERS) == set()
    routing.remove_service(r1, "peer-a")
    assert routing.groups_of_servers("peer-a", STREAM_SERVERS) == {AUDIT}


def test_a_mark_lasts_while_the_group_has_no_member() -> None:
    lost = LostCaptures()
    lost.lost("b", [ORDERS, AUDIT])
    assert lost.holder(ORDERS, has_members=False) == "b"
    # Another replica took the stream over: the mark goes with its first member.
    assert lost.holder(ORDERS, has_members=True) is None
    assert lost.holder(ORDERS, has_members=False) is None
    assert lost.holder(AUDIT, has_members=False) == "b"
    assert lost.holder(CHAT, has_members=False) is None


def test_a_peer_whose_table_arrived_again_takes_its_marks_along() -> None:
    lost = LostCaptures()
    lost.lost("b", [ORDERS])
    lost.lost("c", [AUDIT])
    lost.linked("b")
    assert lost.holder(ORDERS, has_members=False) is None  # deleted meanwhile, say
    assert lost.holder(AUDIT, has_members=False) == "c"
    lost.lost("d", [AUDIT])  # the stream moved to d, and d went too
    lost.linked("c")
    assert lost.holder(AUDIT, has_members=False) == "d"


def test_the_marks_are_bounded_and_the_oldest_goes_first() -> None:
    lost = LostCaptures(limit=2)
    lost.lost("b", [ORDERS, AUDIT])
    lost.lost("c", [ORDERS])  # marked again: now the newest
    lost.lost("c", [CHAT])
    assert len(lost) == 2
    assert lost.holder(AUDIT, has_members=False) is None
    assert lost.holder(ORDERS, has_members=False) == "c"
    assert lost.holder(CHAT, has_members=False) == "c"
