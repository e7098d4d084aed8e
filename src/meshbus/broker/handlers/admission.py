"""Admission: the handshake of every link, the sign-in, and who is let in.

Every frame of a link still handshaking comes here (meshbus.broker.core.dispatch), and the
link's sans-IO handshake (meshbus.protocol.handshake) rules on it; a FrameError it raises
closes the link. On a link this broker dialled, the other broker's WELCOME (or its
CHALLENGE, under mesh trust) goes to the mesh. On an accepted link a HELLO decides:

* a peer broker goes to ``Mesh.accept_peer`` -- when the mesh trusts only its brokers,
  only after a CHALLENGE carrying this broker's proof and the peer's AUTH (``MeshTrust``);
* a connector or operator, when the broker has users, gets a CHALLENGE and is let in once
  its AUTH passes (``SignIn``), or at once when its client certificate names a user;
* then the limits: an operator past ``--max-operators``, a user past its connection quota,
  a connector while the broker is draining, joining or full (REDIRECT). Otherwise the link
  opens and gets its WELCOME.

A refusal here closes the link (the handshake's ERROR). A HELLO on a link already open is
answered ALREADY_HANDSHAKEN, and the link stays open.

What it touches is the handshake's alone: the link registry (who is waiting, who opened),
the mesh (peers, redirects, the broker list for the WELCOME), sign-in, quotas, mesh trust.
"""

from __future__ import annotations

import logging

from meshbus.broker.config import BrokerConfig
from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import CloseReason, Endpoint
from meshbus.broker.core.link import Link
from meshbus.broker.core.registry import LinkRegistry
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.usage import UsageTable
from meshbus.broker.mesh.membership import Mesh
from meshbus.broker.security.quotas import CONNECTIONS
from meshbus.broker.security.signin import SignIn, bound_session
from meshbus.broker.security.trust import MeshTrust
from meshbus.protocol.codec import ControlFrame
from meshbus.protocol.control import ROLE_BROKER, ROLE_OPERATOR, Hello, Welcome
from meshbus.protocol.handshake import AuthReceived, Challenged, negotiated_max_frame
from meshbus.protocol.layout import ErrorCode

log = logging.getLogger("meshbus.broker")


class Admission:
    def __init__(
        self,
        *,
        config: BrokerConfig,
        routing: RoutingTable[Endpoint],
        mesh: Mesh,
        links: LinkRegistry,
        sign_in: SignIn,
        usage: UsageTable,
        trust: MeshTrust,
        trace_every: int,
    ) -> None:
        """``routing`` gives the slot the WELCOME names; ``sign_in`` checks who connectors
        and operators are, when the broker has users; ``usage`` what each user holds,
        against its quotas; ``trust`` who peer brokers are, when the mesh trusts only its
        brokers; ``trace_every`` is what WELCOME tells connectors (telemetry)."""
        self._config = config
        self._routing = routing
        self._mesh = mesh
        self._links = links
        self._sign_in = sign_in
        self._usage = usage
        self._trust = trust
        self._trace_every = trace_every

    def on_handshake(self, link: Link, frame: ControlFrame) -> None:
        """Every frame of a link that is still handshaking (meshbus.protocol.handshake
        rules on it; a FrameError it raises closes the link)."""
        if link.dialling is not None:
            answer = link.dialling.receive(frame)
            if isinstance(answer, Challenged):
                # The other broker proved itself (mesh trust): this one answers in kind.
                link.send(answer.reply)
                return
            self._mesh.on_answer(link, answer)
            return
        assert link.accepting is not None
        event = link.accepting.receive(frame)
        if isinstance(event, AuthReceived):
            if event.hello.role == ROLE_BROKER:
                self._check_peer(link, event)
            else:
                self._check_auth(link, event)
            return
        hello = event.hello
        if hello.role == ROLE_BROKER:
            if self._config.tls_ca and self._config.tls_cert and not link.shows_certificate():
                # A broker of this mesh shows its certificate when it dials (tls.dial_context);
                # one signed by another CA failed the TLS handshake already.
                self._refuse(
                    link,
                    ErrorCode.CERTIFICATE_REQUIRED,
                    "a peer broker must show a certificate signed by this broker's --tls-ca; "
                    "the TLS handshake showed none",
                )
                return
            if self._trust.on:
                self._challenge_peer(link, hello)
            else:
                self._accept_peer(link, hello)
            return
        if self._sign_in.required:
            # A client certificate that names a user (mutual TLS) has proved it already.
            user = self._sign_in.certificate_user(link.certificate_name())
            if user is not None:
                self._admit(link, hello, user)
                return
            # Nothing about the broker or the mesh goes out before the link signed in; the
            # handshake timeout still runs.
            link.send(link.accepting.challenge(self._sign_in.new_nonce()))
            return
        self._admit(link, hello, None)

    def on_second_hello(self, link: Link, correlation: int, body: Hello) -> None:
        raise Refused(ErrorCode.ALREADY_HANDSHAKEN, "HELLO was already received on this link")

    def _challenge_peer(self, link: Link, hello: Hello) -> None:
        """Mesh trust: this broker proves itself in its CHALLENGE, and nothing of the mesh
        goes out before the dialler proved itself too (the handshake timeout runs)."""
        refusal = self._trust.refusal(hello)
        if refusal:
            log.warning("peer refused", extra={"peer": hello.name, "remote": link.remote})
            self._refuse(link, ErrorCode.AUTH_FAILED, refusal)
            return
        assert link.accepting is not None
        proof = self._trust.proof(hello)
        nonce = self._sign_in.new_nonce()
        link.send(link.accepting.challenge(nonce, broker=self._config.name, proof=proof))

    def _check_peer(self, link: Link, event: AuthReceived) -> None:
        refusal = self._trust.auth_refusal(event)
        if refusal:
            log.warning("peer refused", extra={"peer": event.auth.user, "remote": link.remote})
            self._refuse(link, ErrorCode.AUTH_FAILED, refusal)
            return
        self._accept_peer(link, event.hello)

    def _accept_peer(self, link: Link, hello: Hello) -> None:
        """The duplicate-link rule and the WELCOME (broker/mesh/membership.py), or a refusal."""
        self._links.handshake_done(link)
        refused = self._mesh.accept_peer(link, hello)
        if refused is not None:
            self._refuse(link, ErrorCode(refused.code), refused.message)

    def _check_auth(self, link: Link, event: AuthReceived) -> None:
        self._signed_in(link, event, self._sign_in.check(event.auth, event.signed))

    def _signed_in(self, link: Link, event: AuthReceived, passed: bool) -> None:
        user = event.auth.user
        if passed:
            log.info("signed in", extra={"link": link.link_id, "user": user})
            self._admit(link, event.hello, user)
            return
        log.warning(
            "sign-in refused", extra={"link": link.link_id, "user": user, "remote": link.remote}
        )
        credential = "key" if event.auth.signature else "token"
        # The same words whether the user exists or not.
        self._refuse(
            link,
            ErrorCode.AUTH_FAILED,
            f"authentication failed: this broker does not accept the {credential} given for "
            f"user {user!r}; check the credentials file (credentials=, --creds, "
            "MESHBUS_CREDS) against the user's entry in the broker's config",
        )

    def _admit(self, link: Link, hello: Hello, user: str | None) -> None:
        """The HELLO of a connector or operator that signed in (``user``), or of any when the
        broker has no users: refused (limits, redirect) or WELCOMEd."""
        links = self._links
        links.handshake_done(link)
        operator = hello.role == ROLE_OPERATOR
        mesh = self._mesh
        permissions = self._sign_in.permissions_of(user)
        if operator and permissions is not None and not permissions.may_open_operator_link:
            self._refuse(
                link,
                ErrorCode.PERMISSION_DENIED,
                f"permission denied: user {user!r} may not open an operator link: it has no "
                "operator right (permissions.operator) and no stream permission "
                "(permissions.streams) in the broker's config",
            )
            return
        if operator and len(links.operators) >= self._config.max_operators:
            self._refuse(
                link,
                ErrorCode.LIMIT_EXCEEDED,
                f"limit exceeded: this broker already has {self._config.max_operators} "
                "operator links open (the broker's --max-operators); try again later",
            )
            return
        quota = "" if user is None else self._usage.refusal(user, CONNECTIONS)
        if quota:
            self._refuse(link, ErrorCode.LIMIT_EXCEEDED, quota)
            return
        # An operator asks about *this* broker, full, joining or draining as it may be.
        refusal = "" if operator else mesh.refusal(len(links.connectors))
        if refusal:
            self._refuse(link, ErrorCode.REDIRECT, refusal, mesh.redirect())
            return
        # Each side enforces the smaller of the two limits, so neither sends what the other
        # must refuse.
        max_frame = negotiated_max_frame(hello.max_frame, self._config.max_frame)
        # A signed-in connector's session is its user's: another user replaying it owns
        # none of its addresses.
        session = hello.session if user is None else bound_session(user, hello.session)
        if operator:
            link.open_as_operator(hello.name, max_frame, user, permissions)
            links.operator_opened(link)
        else:
            link.open_as_connector(
                hello.name,
                session,
                max_frame,
                hello.synced,
                hello.epoch,
                user,
                permissions,
                hello.batched_no_route,
            )
            links.connector_opened(link)
            mesh.gossip.changed()
        self._usage.link_opened(link)
        assert link.accepting is not None
        welcome = Welcome(
            broker=self._config.name,
            slot=self._routing.slot,
            max_frame=max_frame,
            brokers=mesh.gossip.connector_list(),
            trace_every=self._trace_every,
        )
        link.send(link.accepting.welcome(welcome))

    def _refuse(self, link: Link, code: ErrorCode, message: str, redirect: str = "") -> None:
        assert link.accepting is not None
        link.close_with(
            link.accepting.refuse(code, message, redirect), CloseReason.REFUSED, message
        )
