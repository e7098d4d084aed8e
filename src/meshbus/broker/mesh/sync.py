"""What brokers tell each other about routes: route operations, snapshots and claims.

* **Each broker is the authority for its own services.** At link-up a broker
  sends the peer its *local* services and memberships (a snapshot, in chunks),
  then every later change of them, in order (``announce``). A peer's view of
  broker X is thus X's snapshot plus X's changes in TCP order, and no third
  broker can make it stale. Operations are conditional (REMOVE only if the peer
  still owns the address), so a connector that moved from X to Y while X's
  REMOVE was on its way ends up owned by Y everywhere.
* A joining broker therefore copies the table from *all* its peers, each its own
  part, rather than all of it from one randomly chosen broker as the seed patent
  has it: a copy of X's services taken from Z can miss a change X made before
  linking to us, and nothing would ever repair it (docs/mesh.md).
* **Uniqueness by claims** (meshbus.broker.mesh.claims): fixed addresses, addresses a
  connector takes along, and a joiner's dynamic-id slot are granted by every
  peer before they are used; fresh dynamic ids need no round trip.
* **A change is confirmed once the mesh knows it.** Operations are numbered; a
  peer confirms each ROUTES frame (ROUTED) once applied; after answering the
  register, join, leave or unregister that made a change, the broker sends its
  connector SYNCED once every peer linked at the time has confirmed it
  (``after_confirmed``), and the connector's call returns then. So when ``join``
  returns, a message sent through any broker reaches the new member. A peer that
  is lost stops counting; one that links later gets the change in its snapshot.
* **NATS interest rides along** (docs/nats.md, "Across the mesh"): the subjects this
  broker's NATS clients subscribe to are route operations too (OP_INTEREST, counted by
  ``LocalInterest``), in the snapshot and in order with the rest, and confirmed alike --
  so a NATS client's PING after a SUB is answered once every peer applied it
  (``after_confirmed``). A peer's interest goes into ``PeerInterest``; its link's close
  takes it out (Broker._link_closed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from meshbus.address import CAST_ANYCAST, CAST_MULTICAST, CAST_UNICAST, describe_address
from meshbus.broker.config import BrokerConfig
from meshbus.broker.core import slices
from meshbus.broker.core.captures import LostCaptures
from meshbus.broker.core.endpoint import Endpoint
from meshbus.broker.core.interest import InterestError, LocalInterest, PeerInterest
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.broker.core.registry import Peers
from meshbus.broker.core.routing import RoutingError, RoutingTable
from meshbus.broker.core.watch import ServiceWatch
from meshbus.broker.mesh.claims import ClaimTable, is_slot_key, slot_key
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import (
    OP_ADD,
    OP_INTEREST,
    OP_JOIN,
    OP_LEAVE,
    OP_LOST_CAPTURE,
    OP_REMOVE,
    Claim,
    Empty,
    Error,
    Revoked,
    Routed,
    RouteOp,
    Routes,
    interest_extra,
    split_interest,
    split_owner,
)
from meshbus.protocol.layout import ControlType, ErrorCode

log = logging.getLogger("meshbus.broker")

# Route operations per ROUTES frame: about 45 bytes each, so a frame is about 22 KB. A
# peer applies a frame in one go, at 2-5 us an operation (more on a busy host): frames of
# 2,000 operations took 10-30 ms, which a read's 5 ms slice could not cut.
ROUTES_CHUNK = 500
# Owners (session and epoch) of ADDs remembered split; past it the memory starts over.
_OWNERS_KEPT = 1024
# And at most this many bytes of addresses and extras: a NATS interest's subject may be
# as long as a NATS control line (4 KiB by default), where an address is 16 bytes.
ROUTES_CHUNK_BYTES = 256 * 1024
_OP_BYTES = 8  # what msgpack adds to an operation, at most


def _chunks(ops: list[RouteOp]) -> Iterator[list[RouteOp]]:
    """``ops`` in order, in chunks of at most ROUTES_CHUNK operations and about
    ROUTES_CHUNK_BYTES bytes (a single larger operation is a chunk of its own)."""
    chunk: list[RouteOp] = []
    size = 0
    for op in ops:
        grows = len(op[1]) + len(op[2]) + _OP_BYTES
        if chunk and (len(chunk) >= ROUTES_CHUNK or size + grows > ROUTES_CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(op)
        size += grows
    if chunk:
        yield chunk


@dataclass
class _ClaimRound:
    """One claim this broker put to its peers, waiting for their answers."""

    key: bytes
    session: bytes
    future: asyncio.Future[bool]
    waiting: dict[str, int] = field(default_factory=dict)  # peer name -> correlation
    granted: list[Link] = field(default_factory=list)
    denied: bool = False


@dataclass
class SyncStats:
    route_ops_in: int = 0
    route_ops_out: int = 0
    route_conflicts: int = 0
    claims_granted: int = 0
    claims_refused: int = 0
    stale_adds: int = 0  # a session's address announced from an older link than its owner's


class RouteSync:
    def __init__(
        self,
        config: BrokerConfig,
        peers: Peers,
        routing: RoutingTable[Endpoint],
        outbox: Outbox,
        watch: ServiceWatch,
        rng: random.Random,
        local_interest: LocalInterest,
        peer_interest: PeerInterest[Link],
        lost_captures: LostCaptures,
    ) -> None:
        """``local_interest``: this broker's NATS interest, sent in each snapshot;
        ``peer_interest``: where the peers' goes; ``lost_captures`` hears of each peer
        whose whole table arrived."""
        self._lost_captures = lost_captures
        self._config = config
        self._local_interest = local_interest
        self._peer_interest = peer_interest
        self._rng = rng
        self._peers = peers
        self._routing = routing
        self._outbox = outbox
        self._watch = watch
        self.claims = ClaimTable(config.name)
        self.stats = SyncStats()
        self._ops: list[RouteOp] = []
        self._flush_scheduled = False
        self._rounds: dict[int, _ClaimRound] = {}
        self._next_correlation = 1
        self._announced = 0  # sequence number of the last operation announced
        self._confirmed: dict[Link, int] = {}  # per peer: the last one it applied
        # (sequence number, peers that must confirm it, what to do then), in order.
        self._waiting: deque[tuple[int, frozenset[Link], Callable[[], None]]] = deque()
        # Peers whose whole table a joining broker still waits for (``wait_snapshots``).
        self._snapshot_pending: set[Link] = set()
        self._snapshots_done = asyncio.Event()
        self._release_scheduled = False  # a slice of ``_release`` waits for its turn
        # An ADD's owner bytes -> (session, epoch): one connector's thousands of ADDs share
        # one, and the routing table one holder per (link, session, epoch).
        self._owners: dict[bytes, tuple[bytes, int]] = {}

    def start(self) -> None:
        """The broker has its name (it listens): claims are made in it from now on."""
        self.claims = ClaimTable(self._config.name)

    # -- route operations out ----------------------------------------------------------------

    def announce(self, op: int, address: bytes, extra: bytes = b"") -> None:
        """Tell every peer about a change of a local service; sent at the end of this loop turn."""
        if not self._peers:
            return
        self._announced += 1
        self._ops.append((op, address, extra))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush_ops)

    def flush_ops(self) -> None:
        self._flush_scheduled = False
        ops, self._ops = self._ops, []
        if not ops:
            return
        peers = self._peers.links()
        self.stats.route_ops_out += len(ops) * len(peers)
        last = self._announced - len(ops)  # the sequence number before ops[0]
        for chunk in _chunks(ops):
            last += len(chunk)
            frame = encode_control(ControlType.ROUTES, Routes(ops=chunk, seq=last))
            for link in peers:
                link.send(frame)

    def after_confirmed(self, then: Callable[[], None]) -> None:
        """Call ``then`` once every peer linked now has applied every operation announced
        so far (at once when there is no peer). ``then`` queues what it writes in the
        outbox, which is flushed after the waiters one confirmation releases: a thousand
        SYNCEDs to one connector go out in one write, not a thousand."""
        peers = frozenset(self._peers.links())
        if not peers:
            then()
            return
        self._waiting.append((self._announced, peers, then))
        # Every peer may have confirmed it already (a NATS client's PING that came a read
        # after its SUB): no ROUTED is on its way to release it then.
        self._release()

    def on_routed(self, link: Link, correlation: int, body: Routed) -> None:
        self._confirmed[link] = max(body.seq, self._confirmed.get(link, 0))
        self._release()

    def _release(self) -> None:
        """Run the waiters whose peers have all confirmed (or are gone), oldest first:
        sequence numbers and confirmations both only grow, so the oldest goes first.
        One confirmation can release thousands (a pipelined burst of joins): past a
        slice, the rest waits for the next loop turn."""
        self._release_scheduled = False
        live = set(self._peers.links())
        deadline = time.perf_counter() + slices.SLICE
        released = 0
        while self._waiting:
            seq, peers, then = self._waiting[0]
            if any(p in live and self._confirmed.get(p, 0) < seq for p in peers):
                break
            self._waiting.popleft()
            then()
            released += 1
            if released % 100 == 0 and time.perf_counter() > deadline:
                if not self._release_scheduled:
                    self._release_scheduled = True
                    asyncio.get_running_loop().call_soon(self._release)
                break
        if released:
            self._outbox.flush()

    def send_snapshot(self, link: Link) -> None:
        """This broker's local services and memberships, to a peer that just linked up.

        Pending operations go out first (to the others). The snapshot is written in
        slices, one per loop turn, each address as it stands when its slice is written.
        A change made meanwhile also reaches the new peer as an operation, before or
        after the address's turn; either way the peer ends where this broker is, as
        operations apply conditionally (module docstring): a JOIN or REMOVE before the
        address's ADD is ignored, and the ADD then carries its state of that moment."""
        self.flush_ops()
        interest = [
            [(OP_INTEREST, subject, interest_extra(count, queue))]
            for subject, queue, count in self._local_interest.snapshot()
        ]
        lost = [
            [(OP_LOST_CAPTURE, group, broker.encode())]
            for group, broker in self._lost_captures.marks()
        ]
        parts = map(self._routing.local_ops, self._routing.local_addresses())
        self._snapshot_slice(link, itertools.chain(parts, interest, lost))

    def _snapshot_slice(self, link: Link, parts: Iterator[list[RouteOp]]) -> None:
        """Each part is one address's operations (taken as it stands when its turn
        comes), or one NATS interest's."""
        if link.closed:
            return
        deadline = time.perf_counter() + slices.SLICE
        ops: list[RouteOp] = []
        for part in parts:
            ops += part
            if len(ops) >= ROUTES_CHUNK:
                self._send_snapshot_ops(link, ops, complete=False)
                ops = []
                if time.perf_counter() > deadline:
                    asyncio.get_running_loop().call_soon(self._snapshot_slice, link, parts)
                    return
        self._send_snapshot_ops(link, ops, complete=True)

    def _send_snapshot_ops(self, link: Link, ops: list[RouteOp], *, complete: bool) -> None:
        chunks = list(_chunks(ops)) or [[]]
        for i, chunk in enumerate(chunks, 1):
            body = Routes(ops=chunk, snapshot=True, complete=complete and i == len(chunks))
            link.send(encode_control(ControlType.ROUTES, body))
        self.stats.route_ops_out += len(ops)

    # -- route operations in -------------------------------------------------------------------

    def on_routes(self, link: Link, correlation: int, body: Routes) -> None:
        self.stats.route_ops_in += len(body.ops)
        for op, address, extra in body.ops:
            try:
                self._apply(link, op, address, extra)
            except (RoutingError, InterestError, IndexError, ValueError) as exc:
                log.warning(
                    "bad route operation from a peer", extra={"peer": link.name, "error": str(exc)}
                )
        if body.seq:
            self._outbox.reply(link, ControlType.ROUTED, Routed(seq=body.seq))
        if body.complete:
            self._lost_captures.linked(link.name)
            self._snapshot_received(link)

    def expect_snapshot(self, link: Link) -> None:
        """A joining broker waits for this peer's whole table (``wait_snapshots``)."""
        self._snapshot_pending.add(link)
        self._snapshots_done.clear()

    def _snapshot_received(self, link: Link) -> None:
        """A peer's whole table has arrived (or the peer is gone)."""
        if link in self._snapshot_pending:
            self._snapshot_pending.discard(link)
            if not self._snapshot_pending:
                self._snapshots_done.set()

    async def wait_snapshots(self) -> None:
        """Until every expected peer's table has arrived, or that peer is gone."""
        if self._snapshot_pending:
            await self._snapshots_done.wait()

    def _apply(self, link: Link, op: int, address: bytes, extra: bytes) -> None:
        if op == OP_LOST_CAPTURE:
            if len(address) != 16 or address[0] != CAST_MULTICAST:
                raise RoutingError("a lost capture of an address that is not multicast")
            broker = extra.decode()  # UnicodeDecodeError: a ValueError, logged as bad
            if broker != self._config.name and self._peers.get(broker) is None:
                self._lost_captures.lost(broker, [address])  # else its own table says
            return
        if op == OP_INTEREST:
            count, queue = split_interest(extra)
            self._peer_interest.apply(link, address, queue, count)
            return
        routing = self._routing
        owner = routing.owner(address)
        if op == OP_ADD:
            if len(address) != 16 or address[0] != CAST_UNICAST:
                raise RoutingError("ADD of an address that is not unicast")
            if self.claims:  # most often empty: a snapshot's ADDs skip the call
                self.claims.release(address, link.name)
            owner_parts = self._owners.get(extra)
            if owner_parts is None:
                if len(self._owners) >= _OWNERS_KEPT:
                    self._owners.clear()
                owner_parts = self._owners[extra] = split_owner(extra)
            session, epoch = owner_parts
            if owner is None:
                routing.add_service(address, link, session, epoch)
            elif owner is link:
                return
            elif session and routing.session_of(address) == session:
                if epoch < routing.epoch_of(address):
                    # The connector registered it since through a later link: this broker
                    # has not noticed yet that it left (it stalled, or was cut off).
                    self.stats.stale_adds += 1
                    return
                routing.take_over(address, link, session, epoch)  # the connector moved here
            else:
                self._conflict(link, address, session, owner)
        elif owner is not link:
            return  # about an address that has moved on since: stale
        elif op == OP_REMOVE:
            routing.remove_service(address, link)
            self._watch.services_left([address])
        elif op in (OP_JOIN, OP_LEAVE):
            if len(extra) != 16 or extra[0] not in (CAST_MULTICAST, CAST_ANYCAST):
                raise RoutingError("JOIN or LEAVE of an address that is not a group")
            if op == OP_JOIN:
                routing.join(address, extra)
            else:
                routing.leave(address, extra)

    def _conflict(self, link: Link, address: bytes, session: bytes, owner: Endpoint) -> None:
        """Two brokers registered one address for different sessions: both sides of a
        split took it (claims prevent it while the mesh is whole). Every broker keeps the
        owner whose broker has the smaller name, so the tables converge; a local loser's
        connector is told (REVOKED), and its service ends with an error it can act on."""
        self.stats.route_conflicts += 1
        current = owner.name if owner.is_peer else self._config.name
        if link.name >= current:
            return
        self._routing.take_over(address, link, session)
        if isinstance(owner, Link):
            owner.revoked.add(address)
            reason = (
                f"{describe_address(address)} was registered through broker {link.name} too "
                "while the mesh was split, and the mesh keeps that one"
            )
            owner.send(encode_control(ControlType.REVOKED, Revoked(address=address, reason=reason)))

    # -- claims: ours -------------------------------------------------------------------------

    def claim(
        self, key: bytes, session: bytes, owner_session: bytes | None
    ) -> asyncio.Future[bool]:
        """Reserve ``key`` here and at every peer; the future says whether all granted it.

        On success the caller uses the key at once (and its ADD ends the peers'
        reservations); on failure the grants are given back."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        me = self._config.name
        if not self.claims.reserve(key, me, session, owner_session):
            self.stats.claims_refused += 1
            future.set_result(False)
            return future
        claim = _ClaimRound(key, session, future)
        for name, link in self._peers.items():
            correlation = self._next_correlation
            self._next_correlation = correlation % 0xFFFFFFFF + 1
            self._rounds[correlation] = claim
            claim.waiting[name] = correlation
            link.send(
                encode_control(ControlType.CLAIM, Claim(key=key, session=session), correlation)
            )
        self._settle(claim)
        return future

    async def claim_slot(self, known: set[int], me: str) -> int:
        """A dynamic-id slot that no broker in ``known`` has, granted by every peer."""
        attempt = 0
        while True:
            used = known | self.claims.reserved_slots()
            free = [s for s in range(1, 0x10000) if s not in used]
            # After a lost race, pick further away: the winner may be taking the next one.
            slot = free[min(len(free) - 1, self._rng.randrange(attempt * 4 + 1))]
            if await self.claim(slot_key(slot), me.encode(), None):
                return slot
            attempt += 1
            await asyncio.sleep(self._rng.uniform(0.0, 0.05))

    def on_answer(self, link: Link, correlation: int, body: Empty | Error) -> None:
        """OK or ERROR: the answer to one of our CLAIMs."""
        claim = self._rounds.pop(correlation, None)
        if claim is None:
            if isinstance(body, Error):
                log.warning("error from a peer", extra={"peer": link.name, "error": body.message})
            return
        claim.waiting.pop(link.name, None)
        if isinstance(body, Error):
            claim.denied = True
        else:
            claim.granted.append(link)
        self._settle(claim)

    def _settle(self, claim: _ClaimRound) -> None:
        if claim.waiting or claim.future.done():
            return
        me = self._config.name
        won = not claim.denied and self.claims.held_by(claim.key, me, claim.session)
        if not won:
            for link in claim.granted:
                link.send(encode_control(ControlType.RELEASE, Claim(key=claim.key)))
        if not won or not is_slot_key(claim.key):
            self.claims.release(claim.key, me)
        if won:
            self.stats.claims_granted += 1
        else:
            self.stats.claims_refused += 1
        claim.future.set_result(won)

    def give_back(self, key: bytes) -> None:
        """A claim was won but will not be used (its connector left while it was out):
        end the peers' reservations, as the ADD that would have used it does."""
        frame = encode_control(ControlType.RELEASE, Claim(key=key))
        self._peers.send_all(frame)

    # -- claims: theirs --------------------------------------------------------------------

    def on_claim(self, link: Link, correlation: int, body: Claim) -> None:
        key = body.key
        routing = self._routing
        if is_slot_key(key):
            slot = int.from_bytes(key[5:7], "big")
            in_use = slot == routing.slot or any(
                p.peer is not None and p.peer.slot == slot for p in self._peers.links()
            )
            owner_session: bytes | None = b"" if in_use else None
        elif routing.owner(key) is None:
            owner_session = None
        else:
            owner_session = routing.session_of(key)
        if self.claims.reserve(key, link.name, body.session, owner_session):
            self._outbox.reply(link, ControlType.OK, Empty(), correlation)
        else:
            self._outbox.reply(
                link,
                ControlType.ERROR,
                Error(code=ErrorCode.ADDRESS_IN_USE, message="in use or claimed"),
                correlation,
            )

    def on_release(self, link: Link, correlation: int, body: Claim) -> None:
        self.claims.release(body.key, link.name)

    # -- a peer is gone ---------------------------------------------------------------------

    def peer_lost(self, link: Link) -> None:
        """A broker that is gone holds nothing: its reservations end, its vote is a grant,
        and no answer waits for its confirmation any more."""
        self.claims.drop_holder(link.name)
        self._confirmed.pop(link, None)
        self._snapshot_received(link)
        self._release()
        for correlation, claim in list(self._rounds.items()):
            if claim.waiting.get(link.name) == correlation:
                del self._rounds[correlation]
                del claim.waiting[link.name]
                self._settle(claim)
