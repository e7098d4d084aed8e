"""Requests a broker answers for a connector of another broker, and their answers.

Group bindings are answered by a group's home broker and stream requests by the
stream's host; the connector's own broker relays them there and relays the
answer back. A request relayed from a peer is answered in a RELAYED frame, so
the peer can hand the answer to its connector as it is, with the connector's
correlation. A relayed request whose broker is lost is answered TRY_AGAIN at
once: the connector asks again.
"""

from __future__ import annotations

from meshbus.broker.core.endpoint import LinkState
from meshbus.broker.core.link import Link
from meshbus.broker.core.outbox import Outbox
from meshbus.protocol.codec import encode_control, encode_control_raw
from meshbus.protocol.control import ENCODER, Body, Error, Relayed
from meshbus.protocol.layout import ControlType, ErrorCode


class Relay:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self._relayed: dict[int, tuple[Link, int, Link]] = {}  # ours -> (origin, its corr, peer)
        self._next = 1

    def answer(self, link: Link, type_: ControlType, body: Body, correlation: int) -> None:
        """To a connector as it is; to a peer that relayed the request, wrapped."""
        if link.is_peer:
            body = Relayed(type=int(type_), body=ENCODER.encode(body))
            type_ = ControlType.RELAYED
        self._outbox.reply(link, type_, body, correlation)

    def refuse(self, link: Link, code: ErrorCode, message: str, correlation: int) -> None:
        self.answer(link, ControlType.ERROR, Error(code=code, message=message), correlation)

    def relay(self, peer: Link, type_: ControlType, body: Body, origin: Link, corr: int) -> None:
        ours = self._next
        self._next = ours % 0xFFFFFFFF + 1
        self._relayed[ours] = (origin, corr, peer)
        peer.send(encode_control(type_, body, ours))

    def on_relayed(self, peer: Link, correlation: int, body: Relayed) -> None:
        waiting = self._relayed.pop(correlation, None)
        if waiting is None:
            return
        origin, corr, _ = waiting
        if origin.state is LinkState.OPEN:
            origin.send(encode_control_raw(body.type, body.body, corr))

    def peer_lost(self, peer: Link) -> None:
        """Requests relayed to a broker that is gone get an answer now: try again."""
        lost = [ours for ours, (_, _, via) in self._relayed.items() if via is peer]
        for ours in lost:
            origin, corr, _ = self._relayed.pop(ours)
            self.refuse(
                origin,
                ErrorCode.TRY_AGAIN,
                f"broker {peer.name} left the mesh before it answered; try again",
                corr,
            )
        if lost:
            self._outbox.flush()
