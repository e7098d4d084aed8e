"""A broker's configuration: what ``meshbus broker``'s flags (and its config file) set.

Each setting is declared once, here, as a field made with ``setting`` (meshbus.broker.settings):
its type (an enum for a choice), its default, its range, its help text and its key, the long
flag name that is also its config file key. ``meshbus broker``'s flags, the config file's keys
and the checks of their values (meshbus.broker.config_file), the check of a ``BrokerConfig``
built in code (``__post_init__``) and the table in docs/operations.md all come from these
declarations.

Not declared as settings, and why:

- ``--config`` and ``--check-config`` (meshbus.cli.config): a file of settings, not one.
- The config file's ``[[users]]`` and ``[[brokers]]`` (meshbus.broker.config_file): tables of
  entries, read into ``users`` and ``brokers``.
- ``host`` and ``port``: ``--listen HOST:PORT`` (``StartSettings.listen``) sets both.
- ``broker_key``: the key pair that ``--broker-key FILE`` (``StartSettings.broker_key``) names,
  loaded once the file's mode passed the check ``--allow-insecure-key-files`` turns off.
- ``slot``, ``default_request_timeout``, ``sweep_interval``: no flag sets them (tests do).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from enum import StrEnum

from meshbus.auth import Credentials, TokenHash
from meshbus.broker.security.users import UserTable
from meshbus.broker.settings import (
    BadSetting,
    Declared,
    check_fields,
    declared_settings,
    setting,
    settings_table,
)
from meshbus.errors import InvalidArgument
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, MIN_MAX_FRAME
from meshbus.util import hostport_text, parse_hostport

# What the CLI builds its flags from (meshbus.cli may import meshbus.broker.config, not the
# modules behind it).
__all__ = [
    "AnonymousExposure",
    "BadSetting",
    "BrokerConfig",
    "Declared",
    "Fsync",
    "PartitionHandling",
    "StartSettings",
    "declared_settings",
    "is_loopback",
    "settings_table",
]


class AnonymousExposure(InvalidArgument):
    """A broker told to listen beyond loopback with no users and no --allow-anonymous
    (docs/security.md, "Secure by default")."""


class PartitionHandling(StrEnum):
    """What a broker cut off from most of its mesh does (docs/mesh.md, "Partitions";
    meshbus.broker.mesh.fence.MinorityRule)."""

    # It goes on: every side of a partition keeps its connectors.
    IGNORE = "ignore"
    # Linked to no more than half of the brokers it knows, it takes no connectors.
    PAUSE_MINORITY = "pause-minority"


class Fsync(StrEnum):
    """How durable a stream's acknowledged messages are (meshbus.storage.sqlite)."""

    # They survive the broker being killed (kill -9).
    NORMAL = "normal"
    # Also an OS crash or power loss, at a cost (BENCHMARKS.md).
    ALWAYS = "always"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only: localhost, 127.0.0.0/8, ::1.
    Other names are not resolved: a name is taken as reachable from anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostport(text: str) -> str:
    parse_hostport(text)
    return text


def _zone(text: str) -> str:
    if text and _ZONE.fullmatch(text) is None:
        raise ValueError(f"{text!r} is not a zone: use 1 to 64 characters from A-Z a-z 0-9 _ . -")
    return text


_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _monitor_address(text: str) -> str:
    """--monitor's HOST:PORT (or :PORT, on 127.0.0.1) as the monitor is named in messages:
    an IPv6 host in brackets."""
    return hostport_text(*parse_hostport("127.0.0.1" + text if text.startswith(":") else text))


_DEFAULT_HOST = "127.0.0.1"
_DEFAULT_PORT = 7400


@dataclass(kw_only=True)
class StartSettings:
    """The settings of ``meshbus broker`` that are no one field of BrokerConfig: the command
    turns them into fields itself. Declared as BrokerConfig's are, so they are flags and
    config file keys, checked and documented, the same way."""

    # Split into BrokerConfig.host and .port.
    listen: str = setting(
        hostport_text(_DEFAULT_HOST, _DEFAULT_PORT),
        help="Address to accept connectors and peer brokers on; port 0 picks a free port.",
        parse=_hostport,
        metavar="HOST:PORT",
    )
    # Loaded into BrokerConfig.broker_key, after its mode is checked (the next setting).
    broker_key: str = setting(
        "",
        help="This broker's key pair, a credentials file of `meshbus keygen --broker --user "
        "NAME` with NAME its --name: it proves itself to the brokers of the mesh with it. "
        "Required when the config lists [[brokers]], the only brokers the mesh then links "
        "to, each proving itself. A broker with [[users]] and no [[brokers]] needs none: it "
        "links to no other broker.",
        path="file",
    )
    # The command's check of the secret files, before the broker exists.
    allow_insecure_key_files: bool = setting(
        False,
        help="Start even when --broker-key or --tls-key may be read by users other than its "
        "owner, or the --config file of [[users]] may be changed by them (or, holding token "
        "hashes, read). Without it such a broker refuses to start, naming the file and the "
        "chmod 600 that fixes it, as ssh does with a private key (docs/security.md).",
    )


@dataclass(kw_only=True)
class BrokerConfig:
    """Everything a broker runs with: its settings, declared here (the module says which
    fields are not), and what the command makes of the rest (host, port, users, brokers,
    key)."""

    # -- The mesh (docs/mesh.md).
    seeds: list[str] = setting(
        [],  # none: start a new mesh
        key="seed",
        help="A broker of the mesh to join through (repeat for more; any one is enough). "
        "Without --seed the broker starts a new mesh.",
        parse=_hostport,
        metavar="HOST:PORT",
    )
    # Empty: the bound address, as name is broker-PORT: Broker.start fills both in before
    # any part uses them.
    advertise: str = setting(
        "",
        help="Address other brokers and connectors reach this one at "
        "(default: the --listen address; set it when listening on 0.0.0.0).",
        parse=_hostport,
        metavar="HOST:PORT",
    )
    name: str = setting(
        "",
        help="Broker name, unique in the mesh (default: broker-PORT, with the bound port; "
        "required when the mesh trusts only its brokers).",
    )
    max_connectors: int = setting(  # the seed patent's capacity
        50,
        min=1,
        help="Connectors this broker takes; more are redirected to a broker with room.",
    )
    capacity_boost: float = setting(  # after a peer crashed: 50 -> 60, as in the seed
        1.2,
        min=1.0,
        help="After a peer crashed, take this many times --max-connectors for a while.",
    )
    boost_window: float = setting(30.0, min=0, help="Seconds the raised capacity lasts.")
    heartbeat_interval: float = setting(
        0.5, min=0.01, help="Seconds between heartbeats on broker-to-broker links."
    )
    heartbeat_misses: int = setting(  # a silent peer is dead after 1.5 s
        3, min=1, help="A peer silent for this many intervals is considered dead."
    )
    # A broker this one lost (or heard of) is dialled again, with a backoff capped at two
    # heartbeat intervals, until it is back, has left, or this many seconds passed.
    peer_forget: float = setting(
        600.0,
        min=0,
        help="Seconds a lost broker is still dialled again (a crash, a pause, a cut link) "
        "before it is forgotten; it comes back the moment a peer lists it or it dials in.",
    )
    partition_handling: PartitionHandling = setting(
        PartitionHandling.IGNORE,
        help="pause-minority: a broker linked to no more than half of the brokers it knows "
        "(the others crashed or cut off) closes its connectors' links and takes none until it "
        "is linked to more than half again, so a message group is never processed on both "
        "sides of a partition. Use with 3 brokers or more: in a mesh of 2 the survivor of a "
        "crash pauses too. ignore: every side goes on (docs/mesh.md).",
    )
    drain_grace: float = setting(
        10.0,
        min=0,
        help="On SIGTERM or `meshbus drain`: seconds to wait for connectors to move away.",
    )
    join_timeout: float = setting(
        30.0,
        min=0,
        min_open=True,
        help="With --seed: seconds to keep trying to join before giving up (exit 1).",
    )
    # -- Streams (docs/guarantees.md).
    data_dir: str = setting(
        "",
        help="Directory for the broker's durable data, its streams (created if missing), and "
        "the Raft log of its replicated streams; without it, streams live in memory and end "
        "with the broker, and it holds no replicated stream.",
        path="directory",
    )
    fsync: Fsync = setting(
        Fsync.NORMAL,
        help="Streams of one replica: 'normal' keeps every acknowledged message when the "
        "broker is killed (kill -9); 'always' also through an OS crash or power loss, at a "
        "throughput cost. Replicated streams fsync their Raft log before every ack whatever "
        "this says.",
    )
    # Replicated streams: an election after 10-20 silent ticks, a heartbeat every tick,
    # a leader that heard from no majority for 10-20 ticks steps down (docs/raft.md).
    raft_tick: float = setting(
        0.1,
        min=0.005,
        max=10.0,
        help="Replicated streams: seconds per Raft tick. A leader sends a heartbeat every "
        "tick; a replica that hears no leader for 10-20 ticks starts an election, and a "
        "leader that hears from no majority of its replicas for as long steps down. Every "
        "replica of a stream should have the same.",
    )
    replace_after: float = setting(
        300.0,
        min=0.0,
        max=86400.0 * 365,
        help="Replicated streams: seconds a stream's leader waits for a replica it does not "
        "hear from before it replaces it by the next ready broker in the stream's placement "
        "order (added as a learner, which copies the log; once caught up, the silent one "
        "removed and the new one promoted). 0: never. A replica whose data dir was wiped "
        "is replaced at once.",
    )
    zone: str = setting(
        "",
        help="Replicated streams: this broker's zone (a rack, a data centre: 1 to 64 "
        "characters from A-Z a-z 0-9 _ . -). The meta group spreads a stream's replicas "
        "over distinct zones before it puts two in one. Empty: none.",
        parse=_zone,
        metavar="NAME",
    )
    meta_voters: list[str] = setting(
        [],  # none: the first replicated stream's broker picks them (docs/raft.md)
        key="meta-voter",
        help="Replicated streams: a voter of the mesh's meta group, which commits every "
        "replicated stream's add, placement and delete (repeat: 1, 3 or 5 broker names, "
        "the same on every broker). Without it, the broker that adds the mesh's first "
        "replicated stream picks the first 3 (5 in a mesh of 5 or more) ready brokers by "
        "name.",
        metavar="NAME",
    )
    raft_compact_entries: int = setting(
        8192,
        min=16,
        max=2**31 - 1,
        help="Replicated streams: a replica compacts a stream's Raft log once it applied "
        "this many entries since the last snapshot (or --raft-compact-bytes of them), so "
        "the log in memory and on disk stays bounded. The messages stay in the stream; a "
        "replica behind the leader's log copies the stream from it (docs/raft.md).",
    )
    raft_compact_bytes: int = setting(
        8 << 20,
        min=4096,
        max=2**40,
        help="Replicated streams: a replica compacts a stream's Raft log once the entries "
        "it applied since the last snapshot hold this many bytes (or "
        "--raft-compact-entries of them).",
    )
    max_streams: int = setting(
        1000,
        min=0,
        help="Streams: the most this broker hosts; adding one more is refused.",
    )
    max_stream_bytes: int = setting(
        1 << 30,
        min=1,
        max=2**62,
        help="Streams: the largest max_bytes a stream may have; a stream added without "
        "max_bytes gets this one.",
    )
    max_store_bytes: int = setting(
        10 << 30,
        min=1,
        max=2**62,
        help="Streams: payload bytes all streams of --data-dir may hold together; an append "
        "that would pass it is refused (reliable sends are then not acknowledged).",
    )
    # -- Message groups: the seed's 5 minutes of idleness; and how long a member may be
    # missing (failing over) before its groups move.
    group_expiry: float = setting(
        300.0,
        min=0,
        min_open=True,
        help="Message groups: idle seconds before a group's binding to a member is dropped.",
    )
    group_grace: float = setting(
        4.0,
        min=0,
        help="Message groups: seconds a member may be unreachable (failing over) before "
        "its groups move to another member. Keep it above the connectors' failover time "
        "(3 x keepalive + 1 s), or a member that fails over may find its group moved.",
    )
    # -- Telemetry (broker/observe/telemetry.py).
    telemetry_interval: float = setting(
        0.0,
        min=0,
        help="Seconds between the broker's telemetry records, stored in its stream "
        "telemetry.NAME with sampled message traces in traces.NAME (for `meshbus report`); "
        "0: no telemetry.",
    )
    trace_sample: float = setting(
        0.001,
        min=0,
        max=1,
        help="With telemetry on: the share of plain sends that connectors trace hop by hop.",
    )
    max_frame: int = setting(
        DEFAULT_MAX_FRAME,
        min=MIN_MAX_FRAME,
        max=2**31,
        help="Largest frame accepted or sent, in bytes.",
    )
    # A link whose unsent output passes this is a slow consumer and is closed (as NATS does):
    # the alternative, buffering without bound, lets one stuck client take the broker down.
    max_pending_bytes: int = setting(
        64 * 1024 * 1024,
        min=1,
        help="A link with more unsent output than this is closed as a slow consumer.",
    )
    # -- Limits: what one client can take from this broker (docs/architecture.md §7).
    # Past a per-connector limit the request is refused (ERROR LIMIT_EXCEEDED, or NO_ROUTE
    # for a request) and the link stays usable; past a per-link limit the link is closed.
    max_services: int = setting(
        10_000,
        min=1,
        help="Services one connector may register; past it REGISTER is refused (LIMIT_EXCEEDED).",
    )
    max_groups_per_service: int = setting(
        1_000,
        min=1,
        help="Groups one service may be a member of; past it JOIN is refused (LIMIT_EXCEEDED).",
    )
    max_groups: int = setting(
        100_000,
        min=1,
        help="Group memberships of all the services of one connector; past it JOIN is refused.",
    )
    max_subjects: int = setting(
        10_000,
        min=1,
        help="Subject subscriptions of all the services of one connector; past it SUBSCRIBE "
        "is refused (LIMIT_EXCEEDED).",
    )
    max_requests: int = setting(
        10_000,
        min=1,
        help="Requests of one connector waiting for a response; past it a request is answered "
        "NO_ROUTE at once.",
    )
    max_request_timeout: float = setting(
        3600.0,
        min=0,
        min_open=True,
        help="Longest request timeout in seconds; a request asking for longer gets this.",
    )
    max_handshaking: int = setting(
        1_000,
        min=1,
        help="Connections still in their handshake (HELLO, and the sign-in when the broker has "
        "users); past it a new connection is closed at once.",
    )
    # Counted per source, an IPv6 /64 (meshbus.broker.security.handshakes).
    max_handshaking_per_source: int = setting(
        128,
        min=1,
        help="Of the connections in their handshake (TLS, HELLO, sign-in), those from one "
        "address (an IPv6 /64); past it the one from that address that has waited longest is "
        "closed, so a flood from one address cannot keep others -- or a client at that address "
        "that says HELLO at once -- out. Keep it well below --max-handshaking.",
    )
    handshake_timeout: float = setting(
        5.0,
        min=0,
        min_open=True,
        help="Seconds a new connection has to finish its handshake (HELLO, and the sign-in "
        "when the broker has users) before it is closed "
        "(checked every --heartbeat-interval).",
    )
    max_operators: int = setting(
        16,
        min=1,
        help="Operator links (meshbus stat, drain) open at once; past it one is refused.",
    )
    # Otherwise a broker beyond loopback without users refuses to start (check_exposure).
    allow_anonymous: bool = setting(
        False,
        help="Listen on an address other than loopback (127.0.0.0/8, ::1, localhost) without "
        "[[users]]: anyone who reaches the port may then connect, send to and read any "
        "address and stream, drain the broker and link to it as a peer. Without it such a "
        "broker refuses to start (docs/security.md).",
    )
    # -- TLS (docs/security.md): with a certificate and key every accepted link is TLS, and
    # peers are dialled with TLS, checked against tls_ca (the system's CAs if empty).
    tls_cert: str = setting(
        "",
        help="PEM certificate (with its chain) of this broker: with it, every link it accepts "
        "is TLS only, and it dials its peers with TLS. Needs --tls-key.",
        path="file",
    )
    tls_key: str = setting("", help="PEM private key (unencrypted) of --tls-cert.", path="file")
    tls_ca: str = setting(
        "",
        help="PEM CA certificate(s) that peer brokers' certificates must be signed by -- those "
        "this broker dials and those that dial it -- and, with --tls-verify-clients, clients'. "
        "Default: the system's CAs, for the brokers this one dials only.",
        path="file",
    )
    tls_verify_clients: bool = setting(
        False,
        help="Mutual TLS: refuse every link (connectors, operators, peer brokers) without a "
        "certificate signed by --tls-ca.",
    )
    # -- Monitoring over HTTP (broker/observe/monitor.py, docs/operations.md).
    monitor: str = setting(
        "",  # no monitor
        help="Serve /metrics (Prometheus), /healthz and /varz over HTTP on HOST:PORT (or "
        ":PORT, on 127.0.0.1). Off by default. Beyond loopback it needs --monitor-token-hash "
        "(or, for a broker without users, --allow-anonymous).",
        parse=_monitor_address,
    )
    monitor_token_hash: TokenHash | None = setting(
        None,  # no token
        help="The hash of the bearer token /metrics and /varz then need (Authorization: Bearer "
        "TOKEN), as `meshbus hash-token --generate` prints it; /healthz needs none.",
        parse=TokenHash.parse,
    )
    # -- NATS clients (broker/nats/, docs/nats.md): any language's NATS client library
    # speaks to the broker over the NATS client protocol.
    nats_listen: str = setting(
        "",  # no NATS listener
        help="Accept NATS clients (nats.go, nats.py, ... any NATS client library) on "
        "HOST:PORT, speaking the NATS client protocol on the broker's own loop. Off by "
        "default. With [[users]] they sign in (user and pass, auth_token, nkey); with "
        "--tls-cert they speak TLS; beyond loopback without users it needs "
        "--allow-anonymous, as --listen does (docs/nats.md).",
        parse=_hostport,
        metavar="HOST:PORT",
    )
    nats_advertise: str = setting(
        "",  # the address --nats-listen bound, unless that is every address
        help="NATS clients: the HOST:PORT they are told to reconnect to (INFO "
        "connect_urls, here and on every other broker), when it is not the address "
        "--nats-listen binds (0.0.0.0, NAT).",
        parse=_hostport,
        metavar="HOST:PORT",
    )
    nats_max_payload: int = setting(
        1024 * 1024,  # nats-server's default
        min=1,
        max=64 * 1024 * 1024,  # nats-server's cap
        help="NATS clients: the largest message (headers and payload) a client may "
        "publish, told to clients in INFO; a larger one is -ERR 'Maximum Payload "
        "Violation' and closes its connection.",
    )
    nats_max_control_line: int = setting(
        4096,  # nats-server's default
        min=256,
        max=1024 * 1024,
        help="NATS clients: the longest protocol line (a PUB, SUB, CONNECT, ...) in bytes; "
        "a longer one is -ERR 'maximum control line exceeded' and closes its connection.",
    )
    nats_ping_interval: float = setting(
        120.0,  # nats-server's default: 2 minutes
        min=0,
        min_open=True,
        help="NATS clients: seconds between the broker's PINGs to a client it has not heard from.",
    )
    nats_max_pings_out: int = setting(
        2,  # nats-server's default
        min=1,
        help="NATS clients: PINGs a client may leave unanswered; one more and it is closed "
        "with -ERR 'Stale Connection'.",
    )

    # -- Not settings of their own (the module's docstring says why).
    host: str = _DEFAULT_HOST
    port: int = _DEFAULT_PORT
    slot: int = 1
    # Used when a request carries no timeout of its own.
    default_request_timeout: float = 30.0
    # How often pending requests are checked for expiry: a TIMEOUT is at most this late.
    sweep_interval: float = 0.01
    # Who may connect (the config file's [[users]]; docs/security.md): with none, anyone
    # who reaches the port; with some, connectors and operators sign in first. The users
    # at start: SignIn holds the current ones (a SIGHUP reloads them).
    users: UserTable = field(default_factory=UserTable)
    # -- Mesh trust (docs/security.md, "The mesh trusts only its brokers"): the brokers it
    # links to (the config file's [[brokers]], each a name and a public key), and this
    # broker's own key pair (--broker-key), whose user is its name.
    brokers: UserTable = field(default_factory=UserTable)
    broker_key: Credentials | None = None

    def __post_init__(self) -> None:
        # A config built in code is held to the declarations as a flag is: a choice given
        # as its text becomes its enum member, a misspelt one is a BadSetting.
        check_fields(self)
        try:  # a flag's text is parsed; a zone given in code is checked alike (LOAD's bound)
            _zone(self.zone)
        except ValueError as exc:
            raise BadSetting("zone", f"zone = {self.zone!r}: {exc}") from None
        voters = self.meta_voters
        if voters and (len(voters) not in (1, 3, 5) or len(set(voters)) != len(voters)):
            raise BadSetting(
                "meta-voter",
                f"meta-voter = {voters!r}: name 1, 3 or 5 distinct brokers (a meta group of "
                "an even size tolerates no more failures than one smaller)",
            )

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

    def check_nats(self) -> None:
        """For ``--nats-listen``: AnonymousExposure beyond loopback without users or
        --allow-anonymous, as ``check_exposure`` for --listen (with users, NATS clients
        sign in)."""
        if not self.nats_listen or self.users:
            return
        host = parse_hostport(self.nats_listen)[0]
        if not self.allow_anonymous and not is_loopback(host):
            raise AnonymousExposure(
                f"refusing to listen for NATS clients on {self.nats_listen} without users: "
                "anyone who reaches it could publish and subscribe to any subject; listen "
                "on 127.0.0.1, or pass --allow-anonymous to take that risk"
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
