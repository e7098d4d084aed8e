"""A broker's configuration: what ``meshbus broker``'s flags (and its config file) set."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from meshbus.auth import Credentials, TokenHash
from meshbus.broker.security.users import UserTable
from meshbus.errors import InvalidArgument
from meshbus.protocol.layout import DEFAULT_MAX_FRAME


class AnonymousExposure(InvalidArgument):
    """A broker told to listen beyond loopback with no users and no --allow-anonymous
    (docs/security.md, "Secure by default")."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: localhost, 127.0.0.0/8, ::1.
    Other names are not resolved: a name is taken as reachable from anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 7400
    # Empty: broker-PORT, with the port actually bound. Broker.start fills it in, and
    # ``advertise`` likewise, before any part uses them.
    name: str = ""
    slot: int = 1
    max_frame: int = DEFAULT_MAX_FRAME
    # A link whose unsent output passes this is a slow consumer and is closed (as NATS does):
    # the alternative, buffering without bound, lets one stuck client take the broker down.
    max_pending_bytes: int = 64 * 1024 * 1024
    # Used when a request carries no timeout of its own.
    default_request_timeout: float = 30.0
    # How often pending requests are checked for expiry: a TIMEOUT is at most this late.
    sweep_interval: float = 0.01
    # The mesh (docs/mesh.md).
    seeds: list[str] = field(default_factory=list)  # empty: start a new mesh
    advertise: str = ""  # the address peers and connectors dial; empty: the bound address
    max_connectors: int = 50  # the seed patent's capacity
    capacity_boost: float = 1.2  # after a peer crashed: 50 -> 60, as in the seed
    boost_window: float = 30.0
    heartbeat_interval: float = 0.5
    heartbeat_misses: int = 3  # a silent peer is dead after 1.5 s
    # A broker this one lost (or heard of) is dialled again, with a backoff capped at two
    # heartbeat intervals, until it is back, has left, or this many seconds passed.
    peer_forget: float = 600.0
    # One of meshbus.cli.broker.PARTITION_HANDLING. "pause-minority": a broker linked to
    # no more than half of the brokers it knows takes no connectors (docs/mesh.md,
    # "Partitions"); "ignore": it goes on.
    partition_handling: str = "ignore"
    drain_grace: float = 10.0
    join_timeout: float = 30.0
    data_dir: str = ""
    # Message groups: idle seconds before a binding goes (the seed's 5 minutes), and how
    # long a member may be missing (failing over) before its groups move.
    group_expiry: float = 300.0
    group_grace: float = 4.0
    # Streams under data_dir: "normal" survives the broker being killed (kill -9),
    # "always" also an OS crash or power loss, at a cost (BENCHMARKS.md).
    fsync: str = "normal"
    # Stream limits (docs/guarantees.md): streams hosted; the largest max_bytes a stream
    # may have (and the one a stream created without max_bytes gets); payload bytes of all
    # streams in data_dir together -- an append that would pass it is refused.
    max_streams: int = 1000
    max_stream_bytes: int = 1 << 30
    max_store_bytes: int = 10 << 30
    # Telemetry (broker/observe/telemetry.py): seconds between records, 0 for none; and the
    # share of sends connectors trace while it is on.
    telemetry_interval: float = 0.0
    trace_sample: float = 0.001
    # -- Limits: what one client can take from this broker (docs/architecture.md §7).
    # Past a per-connector limit the request is refused (ERROR LIMIT_EXCEEDED, or NO_ROUTE
    # for a request) and the link stays usable; past a per-link limit the link is closed.
    max_services: int = 10_000  # services registered per connector
    max_groups_per_service: int = 1_000  # groups one service is a member of
    max_groups: int = 100_000  # group memberships per connector, over all its services
    max_requests: int = 10_000  # requests per connector waiting for a response
    max_request_timeout: float = 3600.0  # a request's longer timeout_ms is cut to this
    max_handshaking: int = 1_000  # accepted connections still in their handshake
    # Of those, from one source address (an IPv6 /64); past it the one of that source that
    # waited longest is closed (meshbus.broker.security.handshakes).
    max_handshaking_per_source: int = 128
    handshake_timeout: float = 5.0  # seconds to finish it: HELLO, and the sign-in if any
    max_operators: int = 16  # operator links (meshbus stat, drain) open at once
    # Who may connect (the config file's [[users]]; docs/security.md): with none, anyone
    # who reaches the port; with some, connectors and operators sign in first. The users
    # at start: SignIn holds the current ones (a SIGHUP reloads them).
    users: UserTable = field(default_factory=UserTable)
    # Listen beyond loopback with no users anyway (--allow-anonymous): otherwise such a
    # broker refuses to start (check_exposure).
    allow_anonymous: bool = False
    # -- Mesh trust (docs/security.md, "The mesh trusts only its brokers"): the brokers it
    # links to (the config file's [[brokers]], each a name and a public key), and this
    # broker's own key pair (--broker-key), whose user is its name.
    brokers: UserTable = field(default_factory=UserTable)
    broker_key: Credentials | None = None
    # -- TLS (docs/security.md): with a certificate and key every accepted link is TLS,
    # and peers are dialled with TLS, checked against tls_ca (the system's CAs if empty).
    # tls_verify_clients: every link must show a certificate signed by tls_ca.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_verify_clients: bool = False
    # -- Monitoring over HTTP (broker/observe/monitor.py, docs/operations.md): HOST:PORT of
    # /metrics, /healthz and /varz, "" for none; and the hash of the bearer token that
    # /metrics and /varz then need (None: no token).
    monitor: str = ""
    monitor_token_hash: TokenHash | None = None

    def check_monitor(self) -> tuple[str, int] | None:
        """Where the monitor listens, or None without one. A monitor beyond loopback
        without a token is refused unless the broker is open on purpose (no users and
        allow_anonymous): /varz names the users signed in."""
        if not self.monitor:
            return None
        host, _, port = self.monitor.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if (
            not is_loopback(host)
            and self.monitor_token_hash is None
            and (self.users or not self.allow_anonymous)
        ):
            raise AnonymousExposure(
                f"refusing to serve --monitor on {self.monitor} without a token: anyone who "
                "reaches it could read the broker's state; add --monitor-token-hash (meshbus "
                "hash-token --generate prints a token and its hash), use 127.0.0.1, or (no "
                "users) pass --allow-anonymous"
            )
        return host, int(port)

    def check_exposure(self) -> None:
        """AnonymousExposure when this broker would listen beyond loopback, where anyone
        who reaches the port could do anything, without users and without
        allow_anonymous: secure by default, open only on purpose."""
        if self.users or self.allow_anonymous or is_loopback(self.host):
            return
        host = f"[{self.host}]" if ":" in self.host else self.host
        raise AnonymousExposure(
            f"refusing to listen on {host}:{self.port} without users: anyone who "
            "reaches it could connect and do anything; add [[users]] to a config file "
            "(meshbus keygen --user NAME --out NAME.creds >> broker.toml, then meshbus "
            "broker --config broker.toml; docs/security.md, Authentication), listen on "
            "127.0.0.1, or pass --allow-anonymous to take that risk"
        )

    @property
    def mesh_trust(self) -> bool:
        """Whether peer brokers must prove themselves: the config lists brokers, or has
        users (a broker that checks who its clients are must not take any process that
        says it is a broker; with no [[brokers]] it links to none)."""
        return bool(self.brokers) or bool(self.users)

    @property
    def heartbeat_budget(self) -> float:
        """Seconds of silence after which a peer is dead (and this broker, if it was the
        silent one, fenced)."""
        return self.heartbeat_interval * self.heartbeat_misses
