"""The meshbus exception tree. Every error the library raises is one of these.

    MeshbusError
    ├── ProtocolError                 the bytes on a link broke the wire rules
    │   ├── FrameTooLarge             .size, .limit
    │   └── RemoteProtocolError       the broker told us we broke them (.code)
    ├── ConnectionError_              base of link-state errors
    │   ├── NotConnected              used after close(), or before connect()
    │   └── ConnectionLost            the broker or the network broke the link
    ├── RequestError                  a request got no response
    │   ├── Timeout                   the deadline passed (.timeout)
    │   └── NoRoute                   nobody serves that address (.address)
    ├── DeliveryFailed                a reliable send was never acknowledged (.address, .msg_id)
    ├── NoQueue                       next_message() on a service that has listeners
    ├── StreamError                   a stream request was refused (.code)
    └── RegistrationError             register/join/leave refused (.code)
        ├── AddressInUse              a fixed address is taken (.address)
        │   └── AlreadyConnected      ... by this connector itself
        └── JoinFailed                a join or leave was refused

"You closed it" (``NotConnected``) and "it broke" (``ConnectionLost``) are
different errors on purpose: the first is a bug in the caller, the second is
something to retry.
"""

from __future__ import annotations


class MeshbusError(Exception):
    """Base of every meshbus error."""


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
        self.limit = limit


class RemoteProtocolError(ProtocolError):
    """The peer reported that we broke the protocol; ``code`` is its ErrorCode."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ConnectionError_(MeshbusError):
    """Base of link-state errors."""


class NotConnected(ConnectionError_):
    """The connector is closed (you closed it) or was never connected."""


class ConnectionLost(ConnectionError_):
    """The link to the broker broke (the broker or the network closed it)."""


class RequestError(MeshbusError):
    """A request did not get a response."""


class Timeout(RequestError):
    """No response arrived before the request's deadline."""

    def __init__(self, message: str, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout


class NoRoute(RequestError):
    """No service is registered at, or member of, the destination address."""

    def __init__(self, message: str, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address


class RegistrationError(MeshbusError):
    """The broker refused a register, unregister, join or leave."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class AddressInUse(RegistrationError):
    """A fixed unicast address is already registered by another service."""

    def __init__(self, message: str, address: str, code: int = 0) -> None:
        super().__init__(message, code)
        self.address = address


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
        self.msg_id = msg_id


class NoQueue(MeshbusError):
    """``next_message()`` on a service whose messages go to listeners (``add_listener``)."""


class StreamError(MeshbusError):
    """A stream request was refused: no such stream or consumer, a bad config, storage."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code
