"""The driver's messages, a new member's join and a copy's requests and answers, as
RAFT frames on the peer links (meshbus.broker.replication)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from meshbus.broker.core.link import Link
from meshbus.broker.core.registry import Peers
from meshbus.broker.replication.group import GroupMeta
from meshbus.broker.replication.members import Member
from meshbus.broker.replication.wire import to_bodies
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import (
    MAX_RAFT_MESSAGES,
    RaftChunkBody,
    RaftFetchBody,
    RaftFrame,
    RaftJoinBody,
    RaftMemberBody,
)
from meshbus.protocol.layout import ControlType
from meshbus.raft import Message


class PeerTransport:
    """The driver's messages as RAFT frames on the peer links."""

    def __init__(self, peers: Peers, frame_limit: int, incarnation: int) -> None:
        """``incarnation``: this broker's, in every frame it sends."""
        self._peers = peers
        self._frame_limit = frame_limit
        self._incarnation = incarnation

    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        link = self._peers.get(broker)
        if link is None:
            return  # not linked now: Raft sends again
        if not messages:  # a probe: answered as a stranger by a broker without the group
            self._frame(link, RaftFrame(group=group, incarnation=self._incarnation))
            return
        # Each frame well under the frame limit: entries are at most an eighth of it, and
        # an APPEND carries at most 4 (RaftSettings.max_append_entries).
        batch: list[Message] = []
        size = 0
        for message in messages:
            weight = sum(len(e.data) for e in message.entries) + 64
            if batch and (
                size + weight > self._frame_limit // 2 or len(batch) == MAX_RAFT_MESSAGES
            ):
                self._send(link, group, batch)
                batch, size = [], 0
            batch.append(message)
            size += weight
        if batch:
            self._send(link, group, batch)

    def _send(self, link: Link, group: str, batch: list[Message]) -> None:
        body = RaftFrame(group=group, messages=to_bodies(batch), incarnation=self._incarnation)
        link.send(encode_control(ControlType.RAFT, body, max_frame=self._frame_limit))

    def _frame(self, link: Link, body: RaftFrame) -> None:
        link.send(encode_control(ControlType.RAFT, body, max_frame=self._frame_limit))

    def found(
        self,
        broker: str,
        group: str,
        replicas: list[str],
        config: bytes,
        incarnations: Sequence[int] = (),
    ) -> None:
        """Send ``broker`` the frame that founds ``group`` there (if it is linked); with
        ``incarnations``, only the self of each replica placed founds it."""
        self.frame(broker, found_frame(group, replicas, config, incarnations))

    def frame(self, broker: str, body: RaftFrame) -> None:
        """Send ``broker`` a RAFT frame (if it is linked): the meta group's commands."""
        link = self._peers.get(broker)
        if link is not None:
            self._frame(link, msgspec.structs.replace(body, incarnation=self._incarnation))

    def stranger(self, broker: str, group: str) -> None:
        link = self._peers.get(broker)
        if link is not None:
            self._frame(link, RaftFrame(group=group, incarnation=self._incarnation, stranger=True))

    def fetch(self, broker: str, group: str, body: RaftFetchBody) -> None:
        """Ask ``broker`` for the blocks of ``group``'s stream (a copy: copies.py)."""
        link = self._peers.get(broker)
        if link is not None:
            self._frame(link, RaftFrame(group=group, incarnation=self._incarnation, fetch=body))

    def chunk(self, broker: str, group: str, body: RaftChunkBody) -> None:
        """Answer ``broker``'s fetch; FrameTooLarge past the frame limit."""
        link = self._peers.get(broker)
        if link is not None:
            self._frame(link, RaftFrame(group=group, incarnation=self._incarnation, chunk=body))

    def join(self, broker: str, group: str, meta: GroupMeta, member: Member) -> None:
        # Not linked now: its stranger answer to the appends asks again.
        self.frame(broker, join_frame(group, meta, member))


def found_frame(
    group: str, replicas: list[str], config: bytes, incarnations: Sequence[int] = ()
) -> RaftFrame:
    """The RAFT frame that founds ``group`` on its ``replicas`` (the sender's incarnation
    is stamped as it is sent)."""
    return RaftFrame(group=group, replicas=replicas, create=config, incarnations=list(incarnations))


def join_frame(group: str, meta: GroupMeta, member: Member) -> RaftFrame:
    """The RAFT frame that adds its receiver to ``group`` as ``member`` (the sender's
    incarnation is stamped as it is sent)."""
    members = [RaftMemberBody(m.node, m.broker, m.incarnation) for m in meta.members]
    return RaftFrame(
        group=group,
        replicas=meta.replicas,
        create=meta.app,
        join=RaftJoinBody(member.node, member.incarnation, members),
    )
