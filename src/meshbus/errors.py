"""The meshbus exception tree. Every error the library raises is one of these.

    MeshbusError
    ├── InvalidArgument (ValueError)      an argument the library cannot use: an address,
    │                                     an option, a value out of range
    ├── InvalidPayload (ValueError)       Message.json()/decode(Type) on a payload that is
    │                                     not JSON of that shape
    ├── ProtocolError                     the bytes on a link broke the wire rules
    │   ├── FrameTooLarge                 .size, .limit
    │   └── RemoteProtocolError           the broker told us we broke them (.code)
    ├── AuthenticationFailed              the broker did not take this side's credentials
    │                                     (or wanted some and none were given)
    ├── LinkError                         base of link-state errors
    │   ├── NotConnected (ConnectionError)     used after close(), or before connect()
    │   ├── ConnectionLost (ConnectionError)   the broker or the network broke the link
    │   └── TLSError (ConnectionError)         TLS failed: a certificate or key that does not
    │                                          load, or a TLS handshake with a broker
    ├── RequestError                      a request got no response
    │   ├── Timeout (TimeoutError)        the deadline passed (.timeout)
    │   ├── NoRoute                       nobody serves that address (.address)
    │   └── TryAgain                      the broker that decides cannot answer now; the
    │                                     client asks again itself until the send's
    │                                     deadline, so it reaches the caller only as
    │                                     the cause of a Timeout
    ├── DeliveryFailed                    a reliable send was never acknowledged
    │                                     (.address, .msg_id)
    ├── NoQueue                           next_message() on a service that has listeners
    ├── WouldBlock                        send_nowait/send_many... could not send without
    │                                     waiting (a full write buffer, a failover)
    ├── StreamError                       a stream request was refused (.code)
    │   └── StreamExists                  a replicated stream of that name exists already
    ├── SparkSetupError                   Spark's Python workers cannot run meshbus's
    │                                     data source (meshbus.spark.register's check)
    ├── PermissionDenied (PermissionError) the broker's permissions for this user
    │                                     refused it: a register, join, request, send,
    │                                     stream or operator request
    └── RegistrationError                 register/join/leave refused (.code)
        ├── AddressInUse                  a fixed address is taken (.address)
        │   └── AlreadyConnected          ... by this connector itself
        └── JoinFailed                    a join or leave was refused

A name in parentheses is a builtin exception the class also derives from, so code
that knows nothing of meshbus catches ours too: ``except ValueError`` a bad
argument, ``except TimeoutError`` a timeout, ``except ConnectionError`` a link that
is gone or closed (as nats.py makes its ``TimeoutError`` an ``asyncio.TimeoutError``).

"You closed it" (``NotConnected``) and "it broke" (``ConnectionLost``) are
different errors on purpose: the first is a bug in the caller, the second is
something to retry.

An argument of the wrong *type* -- an int where an address or a name goes, a str
where bytes go -- raises Python's own ``TypeError``, not a MeshbusError: it is the
same programming error as ``len(5)``, found by reading the code, never a condition
to handle at run time. A value of the right type that the library cannot use is
``InvalidArgument``.

``FrameTooLarge`` is not a ``ValueError``: the same class reports a frame a peer
sent that is over the link's limit (``meshbus.protocol.codec.OversizedFrame``),
which is no argument of anyone's, and code around a decoder that catches
``ValueError`` must not swallow it.

This module imports nothing of meshbus: ``meshbus.address`` and the protocol
modules raise these errors, and must be importable before anything else.
"""

from __future__ import annotations


class MeshbusError(Exception):
    """Base of every meshbus error."""


class InvalidArgument(MeshbusError, ValueError):
    """An argument the library cannot use: a bad address text, a value out of range,
    an option that makes no sense. Also a ``ValueError``."""


class InvalidPayload(MeshbusError, ValueError):
    """``Message.json()`` or ``Message.decode(Type)`` on a payload that is not JSON of that
    shape: the message says where it failed. Also a ``ValueError``."""


class ProtocolError(MeshbusError):
    """Bytes on a link broke the wire protocol (see docs/protocol.md)."""


class FrameTooLarge(ProtocolError):
    """A frame exceeds the maximum frame size on this link."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"frame of {size} bytes exceeds the maximum frame size of {limit} bytes; "
            "send smaller payloads or raise --max-frame on both ends"
        )
        self.size = size
        """The frame's size in bytes."""
        self.limit = limit
        """The largest frame the link takes."""


class RemoteProtocolError(ProtocolError):
    """The peer reported that we broke the protocol; ``code`` is its ErrorCode."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        """The broker's error code (docs/protocol.md, "Error codes")."""


class AuthenticationFailed(MeshbusError):
    """The broker wants to know who connects, and did not take the credentials given --
    or none were given (``meshbus.connect(credentials=...)``, ``--creds``,
    ``MESHBUS_CREDS``). Not a ``ConnectionLost``: trying again with the same
    credentials fails again."""


class LinkError(MeshbusError):
    """Base of link-state errors."""


class NotConnected(LinkError, ConnectionError):
    """The connector is closed (you closed it) or was never connected. Also a builtin
    ``ConnectionError``."""


class ConnectionLost(LinkError, ConnectionError):
    """The link to the broker broke (the broker or the network closed it). Also a builtin
    ``ConnectionError``."""


class TLSError(LinkError, ConnectionError):
    """TLS failed: a certificate, key or CA file could not be loaded, or the TLS handshake
    with a broker did not succeed. The message names the cause and what to do (an
    unknown CA, a name that does not match, an expired certificate, a client certificate
    the broker requires, a broker that does not speak TLS). Also a builtin
    ``ConnectionError``; not a ``ConnectionLost``, since trying again will not help."""


class RequestError(MeshbusError):
    """A request did not get a response."""


class Timeout(RequestError, TimeoutError):
    """No response arrived before the request's deadline. Also a builtin ``TimeoutError``
    (which ``asyncio.TimeoutError`` is)."""

    def __init__(self, message: str, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout
        """The deadline that passed, in seconds (None when not known)."""


class NoRoute(RequestError):
    """No service is registered at, or member of, the destination address."""

    def __init__(self, message: str, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address
        """The address nobody serves, as text (None when not known)."""


class TryAgain(RequestError):
    """The broker answered ERROR TRY_AGAIN: the broker that decides (a message group's
    home) is out of reach, lost a moment ago or re-linking after a stall, and will answer
    soon. ``Service.send`` asks again until its deadline and then raises ``Timeout``
    with this as its cause; it is not in the ``meshbus`` namespace for that reason."""


class RegistrationError(MeshbusError):
    """The broker refused a register, unregister, join or leave."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        """The broker's error code (docs/protocol.md, "Error codes"); 0 if none."""


class AddressInUse(RegistrationError):
    """A fixed unicast address is already registered by another service."""

    def __init__(self, message: str, address: str, code: int = 0) -> None:
        super().__init__(message, code)
        self.address = address
        """The address that is taken, as text."""


class AlreadyConnected(AddressInUse):
    """This connector already serves that fixed address (Postina's AlreadyConnected)."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message, address)


class JoinFailed(RegistrationError):
    """The broker refused a join or leave of a group."""


class DeliveryFailed(MeshbusError):
    """A reliable send got no acknowledgement after every attempt of its RetryPolicy."""

    def __init__(self, message: str, address: str, msg_id: int) -> None:
        super().__init__(message)
        self.address = address
        """The destination, as text."""
        self.msg_id = msg_id
        """The message id ``send`` returned."""


class NoQueue(MeshbusError):
    """``next_message()`` on a service whose messages go to listeners (``add_listener``)."""


class WouldBlock(MeshbusError):
    """A send that may not wait (``Service.send_nowait``, ``Message.reply_nowait``) could
    not go out without waiting: the link's write buffer is over its high-water mark (the
    broker takes bytes slower than they are sent), or the connector is failing over.
    Nothing was sent; ``await svc.flush()`` waits until a send can go out again."""


class PermissionDenied(MeshbusError, PermissionError):
    """The user this connector signed in as may not do that: its message names the
    permission and the address, stream or right (docs/security.md, "Permissions").
    The link stays usable. Also a builtin ``PermissionError``."""


class StreamError(MeshbusError):
    """A stream request was refused: no such stream or consumer, a bad config, storage."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        """The broker's error code: NO_STREAM, STREAM_ERROR, UNAVAILABLE (its host is
        unreachable), PERMISSION_DENIED, TRY_AGAIN (docs/protocol.md)."""


class StreamExists(StreamError):
    """A replicated stream of that name exists already in the mesh: the meta group
    committed another add of it first (docs/raft.md, "The meta group")."""


class SparkSetupError(MeshbusError):
    """Spark cannot run the ``meshbus`` data source: its Python workers do not start, or
    cannot import meshbus (``meshbus.spark.register`` asks them). The message names the
    Python they run and what to set: ``PYSPARK_PYTHON``."""
