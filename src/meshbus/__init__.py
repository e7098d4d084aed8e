"""meshbus: a message-routing bus for game and service back ends.

    async with meshbus.connect("127.0.0.1:7400", server="game01") as conn:
        login = await conn.register(instance=1)
        await login.join(meshbus.Anycast("login"))
        async for msg in login:
            await msg.reply(b"ok")

The public surface is what ``__all__`` lists; every other module is private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from meshbus.address import Address, Anycast, Multicast, Unicast
from meshbus.compiled import select as _select_hot_path
from meshbus.errors import (
    AddressInUse,
    AlreadyConnected,
    AuthenticationFailed,
    ConnectionLost,
    DeliveryFailed,
    FrameTooLarge,
    InvalidArgument,
    InvalidPayload,
    JoinFailed,
    MeshbusError,
    NoQueue,
    NoRoute,
    NotConnected,
    PermissionDenied,
    ProtocolError,
    RegistrationError,
    RemoteProtocolError,
    RequestError,
    SparkSetupError,
    StreamError,
    StreamExists,
    Timeout,
    TLSError,
    WouldBlock,
)

if TYPE_CHECKING:
    from meshbus.auth import Credentials
    from meshbus.client.connecting import connect
    from meshbus.client.connector import Connector
    from meshbus.client.delivery import RetryPolicy
    from meshbus.client.inbound import Undeliverable
    from meshbus.client.message import Message
    from meshbus.client.reliable import ReliableConfig
    from meshbus.client.service import Service
    from meshbus.client.streams import Consumer, StreamInfo, StreamMessage

__version__ = "0.1.0"

# Before any module of the hot path is imported (address and errors import none):
# compiled or pure Python, for the whole process (meshbus.compiled).
_select_hot_path()

# The client and the credentials are imported when first used, not with the package: a
# broker process (``python -m meshbus broker``) uses neither, and importing them took a
# third of its start-up.
_LAZY = {
    "Credentials": "meshbus.auth",
    "Connector": "meshbus.client.connector",
    "Message": "meshbus.client.message",
    "Service": "meshbus.client.service",
    "Undeliverable": "meshbus.client.inbound",
    "connect": "meshbus.client.connecting",
    "RetryPolicy": "meshbus.client.delivery",
    "ReliableConfig": "meshbus.client.reliable",
    "Consumer": "meshbus.client.streams",
    "StreamInfo": "meshbus.client.streams",
    "StreamMessage": "meshbus.client.streams",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it like any other name
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Address",
    "AddressInUse",
    "AlreadyConnected",
    "Anycast",
    "AuthenticationFailed",
    "ConnectionLost",
    "Connector",
    "Consumer",
    "Credentials",
    "DeliveryFailed",
    "FrameTooLarge",
    "InvalidArgument",
    "InvalidPayload",
    "JoinFailed",
    "MeshbusError",
    "Message",
    "Multicast",
    "NoQueue",
    "NoRoute",
    "NotConnected",
    "PermissionDenied",
    "ProtocolError",
    "RegistrationError",
    "ReliableConfig",
    "RemoteProtocolError",
    "RequestError",
    "RetryPolicy",
    "Service",
    "SparkSetupError",
    "StreamError",
    "StreamExists",
    "StreamInfo",
    "StreamMessage",
    "TLSError",
    "Timeout",
    "Undeliverable",
    "Unicast",
    "WouldBlock",
    "__version__",
    "connect",
]
