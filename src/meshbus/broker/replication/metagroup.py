"""The meta group on a broker: the mesh's one record of its replicated streams
(meshbus.broker.replication.meta) kept by a Raft group on the driver every stream
group uses, and the way every other broker reaches its leader.

Who its voters are: the brokers named by --meta-voter, or else the first 3 ready
brokers by name (5 in a mesh of 5 or more) when the mesh's first replicated stream is
added -- chosen by the broker that adds it, which founds the group on them as it founds
a stream's (a RAFT frame with the founding list). Every broker then tells its peers, in
its LOAD, the voters and the leader it knows, so a broker that holds no copy knows
where to send a request, and that a meta group exists (it never founds a second).
After that the voters change only as a stream group's do: the leader replaces a voter
whose broker came back wiped, or that it has not heard from for --replace-after, by
the next ready broker, one membership change at a time (members.next_step).

What goes through it: a replicated stream's add (its leader checks the name is free,
places the replicas -- placement.spread over the ready brokers and their zones -- and
commits the record; once applied there it sends each member the frame that founds the
stream's group: a stream's group exists only once its record is committed), the
stream's members as its own leader reports them (at each election and membership
change), and its deletion once its group committed it. A broker that does not lead the
meta group sends such a command to the leader (a RAFT frame of the meta group with a
serial), which answers with the outcome once it is applied; unanswered commands are
sent again to each new leader.

A new leader, once it applied an entry of its own term (so every record committed
before), sends the founding frames again for each stream whose group has not reported
yet: a leader that committed an add and stopped before it told the members leaves no
stream half-founded. A member that holds the group already, or is another incarnation
than the one placed, ignores the frame.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from meshbus.broker.core.link import Link
from meshbus.broker.replication.driver import RaftDriver
from meshbus.broker.replication.group import GroupMeta, snapshot_app
from meshbus.broker.replication.meta import (
    ADD,
    ADDED,
    META_GROUP,
    REFUSED,
    MetaCommand,
    MetaState,
    Placed,
    StreamRecord,
    decode_command,
    encode_command,
    founding_config,
    meta_voters,
)
from meshbus.protocol.control import RaftFrame
from meshbus.raft import Entry

log = logging.getLogger("meshbus.broker")

# Outcomes kept for the proposals that wait for them, and commands waiting for the
# leader's answer, at most.
_MAX_OUTCOMES = 4096
_MAX_REQUESTS = 4096


class MetaTransport(Protocol):
    """What the meta group sends to other brokers (PeerTransport, on the peer links)."""

    def found(
        self,
        broker: str,
        group: str,
        replicas: list[str],
        config: bytes,
        incarnations: Sequence[int] = (),
    ) -> None: ...

    def frame(self, broker: str, body: RaftFrame) -> None: ...


class MetaGroup:
    def __init__(
        self,
        *,
        name: Callable[[], str],
        driver: RaftDriver,
        transport: MetaTransport,
        configured: Sequence[str],
        found: Callable[[str, list[str], bytes], None],
        changed: Callable[[], None],
    ) -> None:
        """``configured``: --meta-voter; ``found(stream, replicas, config)`` founds a
        stream's group here; ``changed()`` tells the peers (LOAD) that the voters or the
        leader known here changed."""
        self._name = name
        self._driver = driver
        self._transport = transport
        self._configured = list(configured)
        self._found_here = found
        self._changed = changed
        self.state = MetaState()
        self.leader: str | None = None  # as this broker's copy knows it (a voter)
        self._term = 0
        self._reconciled = 0  # the term whose leader resent the founding frames
        self._founded: list[str] = []  # the voters this broker founded it on
        # peer -> (the voters, the leader, its incarnation) its LOAD says
        self._heard: dict[str, tuple[list[str], str, int]] = {}
        self._outcomes: dict[int, str] = {}  # index -> what applying it did
        self._serial = 0
        self._requests: dict[int, tuple[bytes, asyncio.Future[str]]] = {}
        self.leader_moved = asyncio.Event()  # set whenever the leader known here changes

    # -- who the voters and the leader are ------------------------------------------------

    def holds(self) -> bool:
        return META_GROUP in self._driver.groups

    def voters(self) -> list[str]:
        if self.holds():
            return self._driver.members_of(META_GROUP)[0]
        for voters, _, _ in self._heard.values():
            if voters:
                return voters
        return list(self._founded)

    def leader_name(self) -> str:
        """The meta leader: as this broker's copy knows it, or as most peers say (one
        that says it leads itself first, on a tie) -- a peer that stopped says what it
        knew then."""
        if self.holds():
            return self.leader or ""
        said = Counter(leader for _, leader, _ in self._heard.values() if leader)
        claims = {leader for peer, (_, leader, _) in self._heard.items() if leader == peer}
        return max(said, key=lambda b: (said[b], b in claims, b), default="")

    def leads(self) -> bool:
        return self._driver.is_leader(META_GROUP)

    def advertised(self) -> tuple[list[str], str]:
        """What this broker's LOAD says of the meta group."""
        return self.voters(), self.leader_name()

    def peer_loaded(self, peer: str, voters: list[str], leader: str, incarnation: int) -> None:
        """A peer's LOAD. Commands not answered yet go to the leader again each time
        its own LOAD comes (its heartbeat): a leader that was not one yet when it got
        them dropped them."""
        before = self.leader_name()
        self._heard[peer] = (list(voters), leader, incarnation)
        if self.leader_name() != before:
            self._leader_known()
        elif leader == peer == before and self._requests:
            for serial in list(self._requests):
                self._send_request(serial)

    def peer_lost(self, peer: str) -> None:
        self._heard.pop(peer, None)

    def incarnation_of(self, broker: str) -> int:
        """``broker``'s incarnation as its LOAD says (this broker's own: its log's); 0:
        not known."""
        if broker == self._name():
            return self._driver.incarnation
        heard = self._heard.get(broker)
        return heard[2] if heard is not None else 0

    # -- founding ---------------------------------------------------------------------------

    def start(self) -> None:
        """At start: a configured voter founds the group if its log does not hold it."""
        me = self._name()
        if self._configured and me in self._configured and not self.holds():
            self._driver.create(META_GROUP, meta_voters(self._configured, []), b"")

    def found_if_none(self, ready: Sequence[str]) -> bool:
        """Found the meta group unless one is known (held here, heard of, founded by
        this broker): on ``meta_voters``. Whether one is known now."""
        if self.voters():
            return True
        voters = meta_voters(self._configured, ready)
        if not voters:
            return False
        log.warning("founding the mesh's meta group", extra={"voters": voters})
        self._founded = voters
        me = self._name()
        for broker in voters:
            if broker != me:
                self._transport.found(broker, META_GROUP, voters, b"")
        if me in voters:
            self._driver.create(META_GROUP, voters, b"")
        self._changed()
        return True

    def join(self, meta: GroupMeta) -> None:
        """The meta leader added this broker as a new voter (in place of a lost one)."""
        if self._driver.join(META_GROUP, meta):
            log.warning(
                "joined the mesh's meta group as a new voter; it copies the log",
                extra={"node": meta.node},
            )
            self._changed()

    # -- frames from peers --------------------------------------------------------------------

    def on_frame(self, link: Link, body: RaftFrame) -> None:
        """A RAFT frame of the meta group that carries no Raft messages: its founding, a
        command for its leader, or the leader's answer to one of ours."""
        if body.command:
            self._on_command(link.name, body)
        elif body.serial:
            request = self._requests.pop(body.serial, None)
            if request is not None and not request[1].done():
                request[1].set_result(body.outcome)
        elif body.replicas and self._name() in body.replicas and not self.holds():
            self._founded = list(body.replicas)
            self._driver.create(META_GROUP, body.replicas, b"")
            self._changed()

    def _on_command(self, sender: str, body: RaftFrame) -> None:
        if not self.leads():
            return  # the sender sends it again to the leader it hears of
        serial = body.serial

        def answer(outcome: asyncio.Future[str]) -> None:
            error = outcome.exception()
            if error is None:
                reply = RaftFrame(group=META_GROUP, serial=serial, outcome=outcome.result())
                self._transport.frame(sender, reply)

        self._propose_data(body.command).add_done_callback(answer)

    # -- proposing ------------------------------------------------------------------------------

    def propose(self, command: MetaCommand) -> asyncio.Future[str]:
        """Commit ``command`` (this broker leads the group); the future is what applying
        it did (meta.ADDED, meta.EXISTS, ...), or fails as RaftDriver.propose does."""
        return self._propose_data(encode_command(command))

    def _propose_data(self, data: bytes) -> asyncio.Future[str]:
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def applied(index: asyncio.Future[int]) -> None:
            if outcome.done():
                index.exception()
            elif index.cancelled():
                outcome.cancel()
            elif (error := index.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(self._outcomes.pop(index.result(), REFUSED))

        self._driver.propose(META_GROUP, data).add_done_callback(applied)
        return outcome

    def request(self, command: MetaCommand) -> asyncio.Future[str]:
        """Commit ``command`` through whichever broker leads the group, now or once one
        does (sent again to each new leader until it answers)."""
        if self.leads():
            return self.propose(command)
        if len(self._requests) >= _MAX_REQUESTS:
            _, (_, oldest) = next(iter(self._requests.items()))
            self._requests.pop(next(iter(self._requests)))
            if not oldest.done():
                oldest.cancel()
        self._serial += 1
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._requests[self._serial] = (encode_command(command), future)
        self._send_request(self._serial)
        return future

    def _send_request(self, serial: int) -> None:
        leader = self.leader_name()
        if leader and leader != self._name():
            data = self._requests[serial][0]
            self._transport.frame(leader, RaftFrame(group=META_GROUP, command=data, serial=serial))

    def _leader_known(self) -> None:
        self.leader_moved.set()
        if self.leads():  # ours, proposed here now
            for serial, (data, future) in list(self._requests.items()):
                del self._requests[serial]
                self._propose_data(data).add_done_callback(_settle(future))
            return
        for serial in list(self._requests):
            self._send_request(serial)

    # -- the state machine ---------------------------------------------------------------------

    def recovered(self) -> None:
        """At start: the record as the log's snapshot holds it; the driver applies the
        entries after it again."""
        state = self._driver.groups.get(META_GROUP)
        if state is not None and state.node.log.snapshot.index:
            self._load(state.node.log.snapshot.data, "the Raft log's snapshot")

    def snapshot(self) -> bytes:
        """A snapshot's data: the record whole, and the index it is at."""
        return self.state.dump()

    def install(self) -> None:
        """A snapshot came from the leader (this voter's log is behind its compaction):
        its data is the record, loaded now; then the driver installs it."""
        state = self._driver.groups.get(META_GROUP)
        held = state.held_snapshot if state is not None else None
        if held is None or held.snapshot is None:
            return
        if self._load(held.snapshot.data, f"a snapshot from node {held.sender}"):
            self._driver.installed(META_GROUP)

    def _load(self, data: bytes, source: str) -> bool:
        try:
            self.state = MetaState.load(snapshot_app(data))
        except (msgspec.DecodeError, ValueError) as exc:
            log.error(
                "the meta group's snapshot is not one this broker reads; it keeps its record",
                extra={"source": source, "error": str(exc)},
            )
            return False
        return True

    def apply(self, entries: Sequence[Entry]) -> None:
        for entry in entries:
            if entry.data and entry.membership is None and entry.index > self.state.applied:
                try:
                    command = decode_command(entry.data)
                except ValueError as exc:
                    log.error(
                        "a meta group entry this broker does not read; it applies nothing",
                        extra={"index": entry.index, "error": str(exc)},
                    )
                    self._outcome(entry.index, REFUSED)
                    continue
                outcome = self.state.apply(entry.index, command)
                self._outcome(entry.index, outcome)
                if command.op == ADD and outcome == ADDED and self.leads():
                    record = self.state.streams[command.stream]
                    if record.index == entry.index:
                        self._found(command.stream, record)
            if entry.term == self._term and self._reconciled != self._term and self.leads():
                self._reconciled = self._term
                for name, record in self.state.unconfirmed():
                    self._found(name, record)

    def _outcome(self, index: int, outcome: str) -> None:
        if len(self._outcomes) >= _MAX_OUTCOMES:
            del self._outcomes[next(iter(self._outcomes))]
        self._outcomes[index] = outcome

    def _found(self, stream: str, record: StreamRecord) -> None:
        """Send each of the stream's founding members the frame that founds its group
        (and found it here, if this broker is one as the incarnation placed)."""
        try:
            config = founding_config(record)
        except (msgspec.DecodeError, ValueError) as exc:
            log.error(
                "a replicated stream's record holds a configuration this broker does not "
                "read; its group is not founded",
                extra={"stream": stream, "error": str(exc)},
            )
            return
        replicas = [p.broker for p in record.founding]
        incarnations = [p.incarnation for p in record.founding]
        me = self._name()
        for placed in record.founding:
            if placed.broker != me:
                self._transport.found(placed.broker, stream, replicas, config, incarnations)
            elif placed.incarnation in (0, self._driver.incarnation):
                self._found_here(stream, replicas, config)

    def leader_changed(self, leader: str | None, term: int) -> None:
        if (leader, term) == (self.leader, self._term):
            return
        self.leader, self._term = leader, term
        self._changed()
        if leader is not None:
            self._leader_known()

    def placed(self, brokers: Sequence[str]) -> list[Placed]:
        """``brokers`` as members: each with its incarnation as known here now."""
        return [Placed(b, self.incarnation_of(b)) for b in brokers]

    def close(self) -> None:
        for _, future in self._requests.values():
            future.cancel()
        self._requests.clear()


def _settle(future: asyncio.Future[str]) -> Callable[[asyncio.Future[str]], None]:
    def settle(outcome: asyncio.Future[str]) -> None:
        if future.done():
            if not outcome.cancelled():
                outcome.exception()
        elif outcome.cancelled():
            future.cancel()
        elif (error := outcome.exception()) is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome.result())

    return settle
