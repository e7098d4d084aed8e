"""The server names whose addresses a broker takes for itself, which no connector may
register: a stream's member (an R=1 stream's dynamic address, meshbus.broker.streams.host),
a replicated stream's (one fixed address per stream, drawn from its name, that each
leader takes over: meshbus.broker.replication.streams) and the NATS bridge's
(meshbus.broker.nats.bridge). A connector that held one could take what is sent to a
stream, and acknowledge it as stored; or hold a replicated stream's address before its
leader, with an epoch no leader's passes."""

from __future__ import annotations

STREAM_SERVER = b"stream".ljust(11, b"\x00")
REPLICATED_STREAM_SERVER = b"rstream".ljust(11, b"\x00")
BRIDGE_SERVER = b"nats".ljust(11, b"\x00")
RESERVED_SERVERS = frozenset((STREAM_SERVER, REPLICATED_STREAM_SERVER, BRIDGE_SERVER))
