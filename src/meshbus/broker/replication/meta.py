"""The meta group's state machine: which replicated streams the mesh has, each with its
configuration and its members as (broker, incarnation). Plain values and a pure
``apply``, no I/O: the broker side is meshbus.broker.replication.metagroup.

The meta group is a Raft group like a stream's, on the same driver (its group name,
``META_GROUP``, is no valid stream name), whose log holds ``MetaCommand`` entries. Every
voter applies them in log order, so every voter holds the same records at each index,
and a decision -- this name is free, these brokers hold it -- is made once, by the
entry that commits it, never by two brokers that each saw the mesh their own way:

- ``ADD``: the stream, its configuration and the members its leader picked. Applied
  where the name is free; refused (``EXISTS``) where an entry before it took it, but
  for the same stream asked again -- its configuration and replica count -- which is
  ``ALREADY`` there (an add whose answer was lost, asked once more, or two at once).
- ``MEMBERS``: the stream's members now, as its own group's leader reports them (at its
  election and after each membership change): the record follows the group.
- ``DELETED``: the stream's group committed its deletion; the name is free again. Each
  replica says so as it applies the deletion, so the name is freed unless every one of
  them stops before one of their commands is committed.

A stream's group knows its record by the index of the entry that added it (``record``
in the configuration its members are founded with, ``founding_config``): ``MEMBERS``
and ``DELETED`` name it, and change nothing of a record added by another entry -- a
later stream of the same name, added once the first was deleted, which a command of
the first one's group, late or sent again, must not change.

The state is the group's snapshot data (``dump``/``load``: the records and the index
they are at), so its log is compacted as a stream's is; at start it is loaded from the
log's snapshot and the entries after it applied again.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from meshbus.storage.store import StreamConfig

# The meta group's name among the driver's groups: '$' is in no stream name
# (meshbus.storage.store.check_name).
META_GROUP = "$meta"
# Its voters when none are configured: the first of the ready brokers, by name.
DEFAULT_VOTERS = 3
MANY_VOTERS = 5  # in a mesh of at least this many ready brokers

ADD = 0
MEMBERS = 1
DELETED = 2

# What applying a command did (the proposer's answer).
ADDED = "added"
EXISTS = "exists"
ALREADY = "already"
UPDATED = "updated"
REMOVED = "deleted"
NO_STREAM = "no stream"
REFUSED = "refused"  # not a command this broker reads


class ConfigBody(msgspec.Struct, array_like=True, frozen=True):
    """A stream's configuration: in an ADD, in its group's meta and in the founding RAFT
    frame -- the last two with ``record``, the index of the entry that added the stream
    (0 in the ADD, and in a group founded before records were named)."""

    name: str
    captures: list[bytes]
    max_msgs: int
    max_bytes: int
    max_age: float
    dedupe_window: float
    owner: str
    record: int = 0

    @classmethod
    def of(cls, c: StreamConfig) -> ConfigBody:
        captures = list(c.captures)
        return cls(c.name, captures, c.max_msgs, c.max_bytes, c.max_age, c.dedupe_window, c.owner)

    def config(self) -> StreamConfig:
        return StreamConfig(
            self.name,
            tuple(self.captures),
            self.max_msgs,
            self.max_bytes,
            self.max_age,
            self.dedupe_window,
            self.owner,
        )


class Placed(msgspec.Struct, array_like=True, frozen=True):
    """A member of a stream: its broker, as the incarnation it was when chosen (0: not
    known then; any self of the broker will do)."""

    broker: str
    incarnation: int = 0


class MetaCommand(msgspec.Struct, array_like=True, frozen=True):
    op: int
    stream: str
    config: bytes = b""  # ADD: the stream's configuration (ConfigBody)
    members: list[Placed] = msgspec.field(default_factory=list)
    record: int = 0  # MEMBERS, DELETED: the index of the ADD of the stream (0: any)


class StreamRecord(msgspec.Struct, array_like=True, frozen=True):
    """One replicated stream as the meta group knows it."""

    config: bytes
    founding: list[Placed]  # the members it was founded on (the group's node ids 1..R)
    members: list[Placed]  # its members now, as its group's leader last reported them
    index: int  # the entry that added it
    confirmed: bool = False  # a leader of its group reported its members: it is founded

    @property
    def brokers(self) -> list[str]:
        return [m.broker for m in self.members]

    def same_stream(self, config: bytes, replicas: int) -> bool:
        """Whether an add of ``config`` on ``replicas`` asks for this stream again."""
        return config == self.config and replicas == len(self.founding)


_encode = msgspec.msgpack.Encoder().encode
encode_command = _encode
decode_command = msgspec.msgpack.Decoder(MetaCommand).decode
_decode_state = msgspec.msgpack.Decoder(tuple[int, dict[str, StreamRecord]]).decode
decode_config = msgspec.msgpack.Decoder(ConfigBody).decode


def founding_config(record: StreamRecord) -> bytes:
    """The configuration a stream's group is founded with: its record's, naming the
    record."""
    return _encode(msgspec.structs.replace(decode_config(record.config), record=record.index))


class MetaState:
    """The records, as the entries applied so far made them."""

    def __init__(self) -> None:
        self.streams: dict[str, StreamRecord] = {}
        self.applied = 0

    def apply(self, index: int, command: MetaCommand) -> str:
        """Apply the entry at ``index``; what it did (the module docstring)."""
        self.applied = index
        streams = self.streams
        name = command.stream
        record = streams.get(name)
        if command.op == ADD:
            if record is not None:
                return (
                    ALREADY if record.same_stream(command.config, len(command.members)) else EXISTS
                )
            members = list(command.members)
            streams[name] = StreamRecord(command.config, members, members, index)
            return ADDED
        if command.op not in (MEMBERS, DELETED):
            return REFUSED
        if record is None or (command.record and command.record != record.index):
            return NO_STREAM  # none, or another stream of the name than the command's
        if command.op == MEMBERS:
            streams[name] = msgspec.structs.replace(
                record, members=list(command.members), confirmed=True
            )
            return UPDATED
        del streams[name]
        return REMOVED

    def unconfirmed(self) -> list[tuple[str, StreamRecord]]:
        """The streams no leader of their group has reported yet: maybe never founded
        (the meta leader that committed them stopped before it told their members)."""
        return [(name, r) for name, r in sorted(self.streams.items()) if not r.confirmed]

    def dump(self) -> bytes:
        """The records and the index they are at: a snapshot's data."""
        return _encode((self.applied, self.streams))

    @classmethod
    def load(cls, data: bytes) -> MetaState:
        """The state ``dump`` gave (msgspec.DecodeError for data that is not one)."""
        state = cls()
        state.applied, state.streams = _decode_state(data)
        return state


def meta_voters(configured: Sequence[str], ready: Sequence[str]) -> list[str]:
    """The brokers that found the meta group, sorted (a group's node ids are places in
    its founding list, so every founder must use the same): the configured ones, else
    the first 3 ready brokers by name (5 in a mesh of 5 or more); none while fewer than
    3 are ready."""
    if configured:
        return sorted(configured)
    if len(ready) < DEFAULT_VOTERS:
        return []
    count = MANY_VOTERS if len(ready) >= MANY_VOTERS else DEFAULT_VOTERS
    return sorted(ready)[:count]
