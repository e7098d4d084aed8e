"""meshbus: a message-routing bus for game and service back ends.

    async with await meshbus.connect("127.0.0.1:7400", server="game01") as conn:
        login = await conn.register(instance=1)
        await login.join(meshbus.Anycast("login"))
        async for msg in login:
            await msg.reply(b"ok")

The public surface is what ``__all__`` lists; every other module is private.
"""

from meshbus.address import Address, Anycast, Multicast, Unicast
from meshbus.auth import Credentials
from meshbus.client import Connector, Message, Service, Undeliverable, connect
from meshbus.client.delivery import RetryPolicy
from meshbus.client.reliable import ReliableConfig
from meshbus.client.streams import Consumer, StreamInfo, StreamMessage
from meshbus.errors import (
    AddressInUse,
    AlreadyConnected,
    AuthenticationFailed,
    ConnectionLost,
    DeliveryFailed,
    FrameTooLarge,
    InvalidArgument,
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
    Timeout,
    TLSError,
)

__version__ = "0.1.0"

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
    "StreamInfo",
    "StreamMessage",
    "TLSError",
    "Timeout",
    "Undeliverable",
    "Unicast",
    "__version__",
    "connect",
]
