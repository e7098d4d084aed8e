"""``meshbus broker``: its flags, and running it (its config file is meshbus.cli.config).

A thin layer, like the rest of the CLI: it builds a ``BrokerConfig`` and runs
``meshbus.broker.serve``. The config file's top-level keys are the flags' long
names (click's ``default_map``); its tables are the users and the brokers of the
mesh (docs/security.md).
"""

from __future__ import annotations

import functools
import os

import click

from meshbus.cli.common import (
    DEFAULT_BROKER,
    HOSTPORT,
)
from meshbus.cli.config import (
    ConfigTables,
    check_config_file,
    read_config_file,
    reread_users,
)
from meshbus.errors import InvalidArgument
from meshbus.protocol.layout import DEFAULT_MAX_FRAME, MIN_MAX_FRAME
from meshbus.util import parse_hostport

# What --partition-handling offers (meshbus.broker.mesh.fence.MinorityRule); bench chaos passes
# it on to its brokers.
PARTITION_HANDLING = ("ignore", "pause-minority")

# -- broker --------------------------------------------------------------------------------


@click.command()
@click.option(
    "--config",
    "tables",
    type=click.Path(dir_okay=False),
    default=None,
    is_eager=True,
    callback=read_config_file,
    help="A TOML file of settings: its keys are the long flag names below (listen = "
    '"0.0.0.0:7400", max-connectors = 100, seed = [...]), a flag given here overrides '
    "the file; [[users]], who may connect, and [[brokers]], the brokers of the mesh "
    "(docs/security.md). SIGHUP reloads its users and their permissions.",
)
@click.option(
    "--check-config",
    type=click.Path(dir_okay=False),
    default=None,
    is_eager=True,
    expose_value=False,
    callback=check_config_file,
    help="Check a config file as --config reads it, then exit: 0 and 'FILE: ok', or 1 and "
    "every error with its line.",
)
@click.option(
    "--listen",
    "listen",
    type=HOSTPORT,
    default=DEFAULT_BROKER,
    show_default=True,
    help="Address to accept connectors and peer brokers on; port 0 picks a free port.",
)
@click.option(
    "--seed",
    "seeds",
    type=HOSTPORT,
    multiple=True,
    help="A broker of the mesh to join through (repeat for more; any one is enough). "
    "Without --seed the broker starts a new mesh.",
)
@click.option(
    "--advertise",
    type=HOSTPORT,
    default=None,
    help="Address other brokers and connectors reach this one at "
    "(default: the --listen address; set it when listening on 0.0.0.0).",
)
@click.option(
    "--name",
    default="",
    help="Broker name, unique in the mesh (default: broker-PORT, with the bound port; "
    "required when the mesh trusts only its brokers).",
)
@click.option(
    "--max-connectors",
    type=click.IntRange(1),
    default=50,
    show_default=True,
    help="Connectors this broker takes; more are redirected to a broker with room.",
)
@click.option(
    "--capacity-boost",
    type=click.FloatRange(1.0),
    default=1.2,
    show_default=True,
    help="After a peer crashed, take this many times --max-connectors for a while.",
)
@click.option(
    "--boost-window",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Seconds the raised capacity lasts.",
)
@click.option(
    "--heartbeat-interval",
    type=click.FloatRange(0.01),
    default=0.5,
    show_default=True,
    help="Seconds between heartbeats on broker-to-broker links.",
)
@click.option(
    "--heartbeat-misses",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="A peer silent for this many intervals is considered dead.",
)
@click.option(
    "--peer-forget",
    type=click.FloatRange(0),
    default=600.0,
    show_default=True,
    help="Seconds a lost broker is still dialled again (a crash, a pause, a cut link) "
    "before it is forgotten; it comes back the moment a peer lists it or it dials in.",
)
@click.option(
    "--partition-handling",
    type=click.Choice(PARTITION_HANDLING),
    default="ignore",
    show_default=True,
    help="pause-minority: a broker linked to no more than half of the brokers it knows "
    "(the others crashed or cut off) closes its connectors' links and takes none until it "
    "is linked to more than half again, so a message group is never processed on both "
    "sides of a partition. Use with 3 brokers or more: in a mesh of 2 the survivor of a "
    "crash pauses too. ignore: every side goes on (docs/mesh.md).",
)
@click.option(
    "--drain-grace",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="On SIGTERM or `meshbus drain`: seconds to wait for connectors to move away.",
)
@click.option(
    "--join-timeout",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    show_default=True,
    help="With --seed: seconds to keep trying to join before giving up (exit 1).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for the broker's durable data, its streams (created if missing); "
    "without it, streams live in memory and end with the broker.",
)
@click.option(
    "--fsync",
    type=click.Choice(["normal", "always"]),
    default="normal",
    show_default=True,
    help="Streams: 'normal' keeps every acknowledged message when the broker is killed "
    "(kill -9); 'always' also through an OS crash or power loss, at a throughput cost.",
)
@click.option(
    "--max-streams",
    type=click.IntRange(0),
    default=1000,
    show_default=True,
    help="Streams: the most this broker hosts; adding one more is refused.",
)
@click.option(
    "--max-stream-bytes",
    type=click.IntRange(1, 2**62),
    default=1 << 30,
    show_default=True,
    help="Streams: the largest max_bytes a stream may have; a stream added without "
    "max_bytes gets this one.",
)
@click.option(
    "--max-store-bytes",
    type=click.IntRange(1, 2**62),
    default=10 << 30,
    show_default=True,
    help="Streams: payload bytes all streams of --data-dir may hold together; an append "
    "that would pass it is refused (reliable sends are then not acknowledged).",
)
@click.option(
    "--group-expiry",
    type=click.FloatRange(0, min_open=True),
    default=300.0,
    show_default=True,
    help="Message groups: idle seconds before a group's binding to a member is dropped.",
)
@click.option(
    "--group-grace",
    type=click.FloatRange(0),
    default=4.0,
    show_default=True,
    help="Message groups: seconds a member may be unreachable (failing over) before "
    "its groups move to another member. Keep it above the connectors' failover time "
    "(3 x keepalive + 1 s), or a member that fails over may find its group moved.",
)
@click.option(
    "--telemetry-interval",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="Seconds between the broker's telemetry records, stored in its stream "
    "telemetry.NAME with sampled message traces in traces.NAME (for `meshbus report`); "
    "0: no telemetry.",
)
@click.option(
    "--trace-sample",
    type=click.FloatRange(0, 1),
    default=0.001,
    show_default=True,
    help="With telemetry on: the share of plain sends that connectors trace hop by hop.",
)
@click.option(
    "--max-frame",
    type=click.IntRange(MIN_MAX_FRAME, 2**31),
    default=DEFAULT_MAX_FRAME,
    show_default=True,
    help="Largest frame accepted or sent, in bytes.",
)
@click.option(
    "--max-pending-bytes",
    type=click.IntRange(1),
    default=64 * 1024 * 1024,
    show_default=True,
    help="A link with more unsent output than this is closed as a slow consumer.",
)
# -- limits: what one client can take from the broker (docs/architecture.md, the limits)
@click.option(
    "--max-services",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="Services one connector may register; past it REGISTER is refused (LIMIT_EXCEEDED).",
)
@click.option(
    "--max-groups-per-service",
    type=click.IntRange(1),
    default=1_000,
    show_default=True,
    help="Groups one service may be a member of; past it JOIN is refused (LIMIT_EXCEEDED).",
)
@click.option(
    "--max-groups",
    type=click.IntRange(1),
    default=100_000,
    show_default=True,
    help="Group memberships of all the services of one connector; past it JOIN is refused.",
)
@click.option(
    "--max-requests",
    type=click.IntRange(1),
    default=10_000,
    show_default=True,
    help="Requests of one connector waiting for a response; past it a request is answered "
    "NO_ROUTE at once.",
)
@click.option(
    "--max-request-timeout",
    type=click.FloatRange(0, min_open=True),
    default=3600.0,
    show_default=True,
    help="Longest request timeout in seconds; a request asking for longer gets this.",
)
@click.option(
    "--max-handshaking",
    type=click.IntRange(1),
    default=1_000,
    show_default=True,
    help="Connections still in their handshake (HELLO, and the sign-in when the broker has "
    "users); past it a new connection is closed at once.",
)
@click.option(
    "--max-handshaking-per-source",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="Of the connections in their handshake (TLS, HELLO, sign-in), those from one "
    "address (an IPv6 /64); past it the one from that address that has waited longest is "
    "closed, so a flood from one address cannot keep others -- or a client at that address "
    "that says HELLO at once -- out. Keep it well below --max-handshaking.",
)
@click.option(
    "--handshake-timeout",
    type=click.FloatRange(0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds a new connection has to finish its handshake (HELLO, and the sign-in "
    "when the broker has users) before it is closed "
    "(checked every --heartbeat-interval).",
)
@click.option(
    "--max-operators",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="Operator links (meshbus stat, drain) open at once; past it one is refused.",
)
@click.option(
    "--allow-anonymous",
    is_flag=True,
    help="Listen on an address other than loopback (127.0.0.0/8, ::1, localhost) without "
    "[[users]]: anyone who reaches the port may then connect, send to and read any "
    "address and stream, drain the broker and link to it as a peer. Without it such a "
    "broker refuses to start (docs/security.md).",
)
# -- TLS (docs/security.md, "TLS")
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False),
    default=None,
    help="PEM certificate (with its chain) of this broker: with it, every link it accepts "
    "is TLS only, and it dials its peers with TLS. Needs --tls-key.",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False),
    default=None,
    help="PEM private key (unencrypted) of --tls-cert.",
)
@click.option(
    "--tls-ca",
    type=click.Path(dir_okay=False),
    default=None,
    help="PEM CA certificate(s) that peer brokers' certificates must be signed by -- those "
    "this broker dials and those that dial it -- and, with --tls-verify-clients, clients'. "
    "Default: the system's CAs, for the brokers this one dials only.",
)
@click.option(
    "--tls-verify-clients",
    is_flag=True,
    help="Mutual TLS: refuse every link (connectors, operators, peer brokers) without a "
    "certificate signed by --tls-ca.",
)
@click.option(
    "--allow-insecure-key-files",
    is_flag=True,
    help="Start even when --broker-key or --tls-key may be read by users other than its "
    "owner, or the --config file of [[users]] may be changed by them (or, holding token "
    "hashes, read). Without it such a broker refuses to start, naming the file and the "
    "chmod 600 that fixes it, as ssh does with a private key (docs/security.md).",
)
# -- mesh trust (docs/security.md, "The mesh trusts only its brokers")
@click.option(
    "--broker-key",
    type=click.Path(dir_okay=False),
    default=None,
    help="This broker's key pair, a credentials file of `meshbus keygen --user NAME` with "
    "NAME its --name: it proves itself to the brokers of the mesh with it. Required when "
    "the config has [[brokers]] or [[users]]: then the broker links only to the brokers "
    "[[brokers]] lists, each proving itself.",
)
# -- monitoring over HTTP (docs/operations.md)
@click.option(
    "--monitor",
    type=str,
    default=None,
    help="Serve /metrics (Prometheus), /healthz and /varz over HTTP on HOST:PORT (or "
    ":PORT, on 127.0.0.1). Off by default. Beyond loopback it needs --monitor-token-hash "
    "(or, for a broker without users, --allow-anonymous).",
)
@click.option(
    "--monitor-token-hash",
    type=str,
    default=None,
    help="The hash of the bearer token /metrics and /varz then need (Authorization: Bearer "
    "TOKEN), as `meshbus hash-token --generate` prints it; /healthz needs none.",
)
def broker(
    tables: ConfigTables,
    listen: str,
    seeds: tuple[str, ...],
    advertise: str | None,
    name: str,
    max_connectors: int,
    capacity_boost: float,
    boost_window: float,
    heartbeat_interval: float,
    heartbeat_misses: int,
    peer_forget: float,
    partition_handling: str,
    drain_grace: float,
    join_timeout: float,
    data_dir: str | None,
    fsync: str,
    max_streams: int,
    max_stream_bytes: int,
    max_store_bytes: int,
    group_expiry: float,
    group_grace: float,
    telemetry_interval: float,
    trace_sample: float,
    max_frame: int,
    max_pending_bytes: int,
    max_services: int,
    max_groups_per_service: int,
    max_groups: int,
    max_requests: int,
    max_request_timeout: float,
    max_handshaking: int,
    max_handshaking_per_source: int,
    handshake_timeout: float,
    max_operators: int,
    allow_anonymous: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
    tls_verify_clients: bool,
    allow_insecure_key_files: bool,
    broker_key: str | None,
    monitor: str | None,
    monitor_token_hash: str | None,
) -> None:
    """Run a broker in the foreground until SIGINT or SIGTERM.

    Prints one line once it takes connectors (after joining the mesh, with
    --seed): `meshbus broker NAME listening on HOST:PORT`. SIGTERM (or
    `meshbus drain`) drains it first: its connectors move to other brokers of
    the mesh; a second signal stops it at once. SIGHUP reloads the --config
    file's users and permissions (not its flags; docs/security.md, "Reloading").
    """
    import uvloop

    from meshbus.auth import Credentials, TokenHash
    from meshbus.broker import BrokerConfig, serve
    from meshbus.broker.config import Fsync, PartitionHandling
    from meshbus.broker.mesh.membership import MeshJoinError
    from meshbus.broker.streams import DataDirLocked
    from meshbus.errors import TLSError
    from meshbus.storage.errors import StoreError

    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together: give both, or neither")
    if tls_verify_clients and not (tls_cert and tls_ca):
        raise click.UsageError(
            "--tls-verify-clients needs --tls-cert, --tls-key and --tls-ca (the CA that "
            "signs the clients' certificates)"
        )
    if not allow_insecure_key_files:
        try:
            _check_secrets(tables, broker_key, tls_key)
        except InvalidArgument as exc:
            raise click.ClickException(str(exc)) from None
    try:
        key = Credentials.load(broker_key) if broker_key else None
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="'--broker-key'") from None
    host, port = parse_hostport(listen)
    token_hash = None
    if monitor_token_hash:
        try:
            token_hash = TokenHash.parse(monitor_token_hash)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--monitor-token-hash'") from None
    if monitor:
        try:
            monitor_host, monitor_port = parse_hostport(
                monitor if not monitor.startswith(":") else "127.0.0.1" + monitor
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--monitor'") from None
        shown = f"[{monitor_host}]" if ":" in monitor_host else monitor_host
        monitor = f"{shown}:{monitor_port}"
    if data_dir:
        os.makedirs(data_dir, exist_ok=True)
    config = BrokerConfig(
        host=host,
        port=port,
        name=name,
        max_frame=max_frame,
        max_pending_bytes=max_pending_bytes,
        seeds=list(seeds),
        advertise=advertise or "",
        max_connectors=max_connectors,
        capacity_boost=capacity_boost,
        boost_window=boost_window,
        heartbeat_interval=heartbeat_interval,
        heartbeat_misses=heartbeat_misses,
        peer_forget=peer_forget,
        partition_handling=PartitionHandling(partition_handling),
        drain_grace=drain_grace,
        join_timeout=join_timeout,
        data_dir=data_dir or "",
        fsync=Fsync(fsync),
        max_streams=max_streams,
        max_stream_bytes=max_stream_bytes,
        max_store_bytes=max_store_bytes,
        group_expiry=group_expiry,
        group_grace=group_grace,
        telemetry_interval=telemetry_interval,
        trace_sample=trace_sample,
        # the limits
        max_services=max_services,
        max_groups_per_service=max_groups_per_service,
        max_groups=max_groups,
        max_requests=max_requests,
        max_request_timeout=max_request_timeout,
        max_handshaking=max_handshaking,
        max_handshaking_per_source=max_handshaking_per_source,
        handshake_timeout=handshake_timeout,
        max_operators=max_operators,
        users=tables.users,
        allow_anonymous=allow_anonymous,
        brokers=tables.brokers,
        broker_key=key,
        tls_cert=tls_cert or "",
        tls_key=tls_key or "",
        tls_ca=tls_ca or "",
        tls_verify_clients=tls_verify_clients,
        monitor=monitor or "",
        monitor_token_hash=token_hash,
    )
    if config.brokers and not (key and name):
        raise click.UsageError(
            "this broker's config lists [[brokers]], the only brokers its mesh trusts: "
            "give it --name and --broker-key FILE, its key pair for that name "
            "(meshbus keygen --broker --user NAME writes one)"
        )
    try:
        reread = (
            functools.partial(reread_users, tables.path, tables.brokers, broker)
            if tables.path
            else None
        )
        uvloop.run(serve(config, reread))
    except TLSError as exc:  # a ConnectionError too, so before OSError
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc.strerror or exc}") from exc
    except (MeshJoinError, DataDirLocked, StoreError, InvalidArgument) as exc:
        # InvalidArgument: the broker key does not fit its name (meshbus.broker.security.trust).
        # StoreError: the stream store is damaged (StoreDamaged) or of another version.
        raise click.ClickException(str(exc)) from exc


def _check_secrets(tables: ConfigTables, broker_key: str | None, tls_key: str | None) -> None:
    """The broker's secrets are its owner's only: its key pair and TLS key (no other user
    may read or change them), a config file of users (none may change it; with token
    hashes, none may read it either). InsecureFile names the first that is not."""
    from meshbus.private_files import WRITABLE_BY_OTHERS, check_private

    if broker_key:
        check_private(broker_key, "the broker key (--broker-key)")
    if tls_key:
        check_private(tls_key, "the TLS key (--tls-key)")
    if tables.path and (tables.users or tables.brokers):
        hashes = any(user.token_hash is not None for user in tables.users)
        what = "the config file, which holds token hashes," if hashes else "the config file"
        check_private(tables.path, what, mask=0o077 if hashes else WRITABLE_BY_OTHERS)
