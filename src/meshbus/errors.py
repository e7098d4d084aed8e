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
    └── RegistrationError             register/join/leave refused (.code)
        └── AddressInUse              a fixed address is taken (.address)

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
