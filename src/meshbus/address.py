"""Service addresses: 16 bytes on the wire, readable strings for people.

Layout (docs/protocol.md §3): one cast-type byte, then 15 bytes.

* Unicast: server name (at most 11 bytes, NUL-padded) + instance id (4 bytes,
  big-endian). Ids 1..65535 are fixed, well-known ids chosen by the service;
  ids from 65536 up are dynamic and allocated by a broker (see
  ``dynamic_instance``).
* Multicast / anycast: a group name of at most 15 bytes, NUL-padded.

Names are UTF-8 and may not contain NUL or ':' (':' separates the parts of the
text form). A name that does not fit raises ``InvalidArgument`` (a ``ValueError``)
naming the limit: an address is never silently truncated, because two truncated
names could collide.

Text form, used by the CLI and by ``str()``: ``game01:65537``,
``multicast:chat.lobby``, ``anycast:login``. Because of that form, ``multicast``,
``anycast`` and ``unicast`` cannot be used as server names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

from meshbus.errors import InvalidArgument

ADDRESS_SIZE = 16
SERVER_NAME_MAX = 11
GROUP_NAME_MAX = 15
FIXED_INSTANCE_MAX = 65535
DYNAMIC_INSTANCE_MIN = 65536
INSTANCE_MAX = 0xFFFFFFFF

CAST_UNICAST = 1
CAST_MULTICAST = 2
CAST_ANYCAST = 3

_RESERVED_SERVER_NAMES = frozenset({"unicast", "multicast", "anycast"})


def _encode_name(name: str, limit: int, what: str) -> bytes:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidArgument(f"{what} must not be empty")
    if "\x00" in name or ":" in name:
        raise InvalidArgument(f"{what} {name!r} must not contain NUL or ':'")
    raw = name.encode("utf-8")
    if len(raw) > limit:
        raise InvalidArgument(
            f"{what} {name!r} is {len(raw)} bytes in UTF-8; the limit is {limit} bytes"
        )
    return raw


def _decode_name(raw: bytes, what: str) -> str:
    name = raw.rstrip(b"\x00")
    if not name or b"\x00" in name:
        raise InvalidArgument(f"{what} {raw!r} is not a NUL-padded name")
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{what} {raw!r} is not UTF-8") from exc


@functools.total_ordering
class Address:
    """Base class of the three address kinds. Compare, hash and sort by wire bytes.

    ``cast_type`` is the first byte of the wire form: 1 unicast, 2 multicast, 3 anycast."""

    __slots__ = ()
    cast_type: ClassVar[int]

    def to_bytes(self) -> bytes:
        """The 16-byte wire form (docs/protocol.md, "Addresses")."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Address):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Address):
            return NotImplemented
        return self.to_bytes() < other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    @property
    def is_group(self) -> bool:
        """A multicast or anycast address, not one service's."""
        return self.cast_type != CAST_UNICAST

    @staticmethod
    def from_bytes(raw: bytes) -> Address:
        """Decode the 16-byte wire form; ``InvalidArgument`` if it is not a valid address."""
        return _from_bytes_cached(bytes(raw))

    @staticmethod
    def from_bytes_uncached(raw: bytes) -> Address:
        """``from_bytes`` that leaves the cache alone: for addresses a client may choose
        by the hundred thousand (the groups it joins), which would otherwise fill the
        cache and pin the memory around them after the client is gone."""
        return _from_bytes_cached.__wrapped__(bytes(raw))

    @staticmethod
    def parse(text: str) -> Address:
        """Parse the text form: ``server:instance``, ``multicast:NAME`` or ``anycast:NAME``."""
        kind, sep, rest = text.partition(":")
        if not sep:
            raise InvalidArgument(
                f"address {text!r} has no ':'; expected SERVER:INSTANCE, "
                "multicast:NAME or anycast:NAME"
            )
        if kind == "multicast":
            return Multicast(rest)
        if kind == "anycast":
            return Anycast(rest)
        if kind == "unicast":
            kind, sep, rest = rest.partition(":")
            if not sep:
                raise InvalidArgument(f"address {text!r}: expected unicast:SERVER:INSTANCE")
        if not (rest.isascii() and rest.isdigit()):
            if kind.lower() in _RESERVED_SERVER_NAMES:  # "Multicast:chat", "ANYCAST:login"
                raise InvalidArgument(
                    f"address {text!r}: the prefix is lower case; "
                    f"did you mean {kind.lower()}:{rest}?"
                )
            raise InvalidArgument(f"address {text!r}: instance {rest!r} is not a decimal integer")
        return Unicast(kind, int(rest))


@dataclass(frozen=True, eq=False, slots=True)
class Unicast(Address):
    """One service: ``Unicast("game01", 1)`` is ``game01:1``. ``server``: the server
    name (at most 11 bytes of UTF-8); ``instance``: 1..65535 for a fixed address, above
    for one the broker allocated (``is_fixed``)."""

    server: str
    instance: int
    # The wire form, made once: a sender names the same address message after message.
    _raw: bytes = field(init=False, repr=False)
    cast_type: ClassVar[int] = CAST_UNICAST

    def __post_init__(self) -> None:
        server = server_name_bytes(self.server)
        if not isinstance(self.instance, int) or isinstance(self.instance, bool):
            raise TypeError("instance must be an int")
        if not 1 <= self.instance <= INSTANCE_MAX:
            raise InvalidArgument(f"instance {self.instance} is out of range 1..{INSTANCE_MAX}")
        raw = bytes((CAST_UNICAST,)) + server + self.instance.to_bytes(4, "big")
        object.__setattr__(self, "_raw", raw)

    @property
    def is_fixed(self) -> bool:
        """True for well-known ids 1..65535, False for broker-allocated dynamic ids."""
        return self.instance <= FIXED_INSTANCE_MAX

    def to_bytes(self) -> bytes:
        """The 16-byte wire form."""
        return self._raw

    def __str__(self) -> str:
        return f"{self.server}:{self.instance}"


@dataclass(frozen=True, eq=False, slots=True)
class _Group(Address):
    """A group address; ``name``: at most 15 bytes of UTF-8, matched exactly."""

    name: str
    _raw: bytes = field(init=False, repr=False)  # the wire form, made once (as Unicast's)

    def __post_init__(self) -> None:
        name = _encode_name(self.name, GROUP_NAME_MAX, "group name")
        raw = bytes((self.cast_type,)) + name + b"\x00" * (GROUP_NAME_MAX - len(name))
        object.__setattr__(self, "_raw", raw)

    def to_bytes(self) -> bytes:
        """The 16-byte wire form."""
        return self._raw


@dataclass(frozen=True, eq=False, slots=True)
class Multicast(_Group):
    """A topic: every member receives a copy. ``Multicast("chat.lobby")``; ``name`` at
    most 15 bytes."""

    cast_type: ClassVar[int] = CAST_MULTICAST

    def __str__(self) -> str:
        return f"multicast:{self.name}"


@dataclass(frozen=True, eq=False, slots=True)
class Anycast(_Group):
    """A service pool: exactly one member receives each message. ``Anycast("login")``;
    ``name`` at most 15 bytes."""

    cast_type: ClassVar[int] = CAST_ANYCAST

    def __str__(self) -> str:
        return f"anycast:{self.name}"


@functools.lru_cache(maxsize=65536)
def _from_bytes_cached(raw: bytes) -> Address:
    if len(raw) != ADDRESS_SIZE:
        raise InvalidArgument(f"an address is {ADDRESS_SIZE} bytes, got {len(raw)}")
    cast = raw[0]
    if cast == CAST_UNICAST:
        instance = int.from_bytes(raw[12:16], "big")
        return Unicast(_decode_name(raw[1:12], "server name"), instance)
    if cast == CAST_MULTICAST:
        return Multicast(_decode_name(raw[1:16], "group name"))
    if cast == CAST_ANYCAST:
        return Anycast(_decode_name(raw[1:16], "group name"))
    raise InvalidArgument(f"unknown cast type {cast} (expected 1 unicast, 2 multicast, 3 anycast)")


def describe_address(raw: bytes) -> str:
    """The text form of a 16-byte address, or a readable placeholder if it is not valid
    (for logs and error messages about bytes a peer sent, and the broker's stat). It
    leaves the address cache alone: a stat of 50,000 services filled it with as many
    objects, which the broker's memory and its garbage collector then carried."""
    if raw == SUBJECTS:
        return "subjects"
    try:
        return str(Address.from_bytes_uncached(raw))
    except InvalidArgument:
        return f"<invalid address {bytes(raw).hex()}>"


def server_name_bytes(server: str) -> bytes:
    """The 11-byte, NUL-padded wire form of a server name; InvalidArgument if it is not
    valid."""
    raw = _encode_name(server, SERVER_NAME_MAX, "server name")
    if server in _RESERVED_SERVER_NAMES:
        raise InvalidArgument(f"server name {server!r} is reserved for the text form")
    return raw + b"\x00" * (SERVER_NAME_MAX - len(raw))


def dynamic_instance(broker_slot: int, sequence: int) -> int:
    """The dynamic instance id a broker with ``broker_slot`` allocates as its ``sequence``-th.

    Dynamic ids are partitioned by broker: id = slot * 65536 + sequence, with
    slot in 1..65535 and sequence in 0..65535. Two brokers with different slots
    can never hand out the same id, so allocation needs no mesh-wide round trip
    and stays unique when brokers allocate at the same moment; the mesh only has
    to keep slots unique, which it does once, when a broker joins.
    """
    if not 1 <= broker_slot <= 0xFFFF:
        raise InvalidArgument(f"broker slot {broker_slot} is out of range 1..65535")
    if not 0 <= sequence <= 0xFFFF:
        raise InvalidArgument(f"sequence {sequence} is out of range 0..65535")
    return broker_slot * 65536 + sequence


# The multicast group every service of the reference client joins, so that
# ``Service.broadcast`` reaches it.
BROADCAST_GROUP = Multicast("$all")

# Where a service's message to a subject goes (its subject in the frame's extension
# block; docs/protocol.md §4.8): a multicast address no group can have -- its name holds
# a ":" -- so no service can join it, and the entry broker hands its frames to the
# subject layer (meshbus.broker.nats.services) rather than to members.
SUBJECTS = bytes((CAST_MULTICAST,)) + b":subjects" + bytes(GROUP_NAME_MAX - len(b":subjects"))
