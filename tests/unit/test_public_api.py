"""The public surface changes only on purpose: this test pins it."""

from __future__ import annotations

import importlib

import meshbus
from meshbus.errors import MeshbusError

EXPECTED_ALL = [
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

EXPECTED_EXCEPTIONS = {
    "AddressInUse",
    "AuthenticationFailed",
    "AlreadyConnected",
    "DeliveryFailed",
    "JoinFailed",
    "NoQueue",
    "SparkSetupError",
    "StreamError",
    "StreamExists",
    "ConnectionLost",
    "FrameTooLarge",
    "InvalidArgument",
    "InvalidPayload",
    "MeshbusError",
    "NoRoute",
    "NotConnected",
    "PermissionDenied",
    "ProtocolError",
    "RegistrationError",
    "RemoteProtocolError",
    "RequestError",
    "TLSError",
    "Timeout",
    "WouldBlock",
}


def test_all_is_pinned() -> None:
    assert meshbus.__all__ == EXPECTED_ALL


def test_every_name_is_importable() -> None:
    module = importlib.import_module("meshbus")
    for name in meshbus.__all__:
        assert hasattr(module, name), name
    namespace: dict[str, object] = {}
    exec("from meshbus import *", namespace)
    assert set(EXPECTED_ALL) <= set(namespace)


def test_version_is_a_string() -> None:
    assert isinstance(meshbus.__version__, str)
    assert meshbus.__version__.count(".") >= 1


def test_exceptions_derive_from_meshbus_error() -> None:
    exceptions = {
        name
        for name in meshbus.__all__
        if isinstance(getattr(meshbus, name), type)
        and issubclass(getattr(meshbus, name), BaseException)
    }
    assert exceptions == EXPECTED_EXCEPTIONS
    for name in exceptions:
        assert issubclass(getattr(meshbus, name), MeshbusError), name
    assert meshbus.MeshbusError is MeshbusError


def test_exception_tree() -> None:
    assert issubclass(meshbus.FrameTooLarge, meshbus.ProtocolError)
    assert issubclass(meshbus.RemoteProtocolError, meshbus.ProtocolError)
    assert issubclass(meshbus.Timeout, meshbus.RequestError)
    assert issubclass(meshbus.NoRoute, meshbus.RequestError)
    assert issubclass(meshbus.AddressInUse, meshbus.RegistrationError)
    # Code that knows nothing of meshbus catches ours with the builtin it expects.
    assert issubclass(meshbus.InvalidArgument, ValueError)
    assert issubclass(meshbus.InvalidPayload, ValueError)
    assert issubclass(meshbus.Timeout, TimeoutError)
    assert issubclass(meshbus.ConnectionLost, ConnectionError)
    assert issubclass(meshbus.NotConnected, ConnectionError)
    assert issubclass(meshbus.TLSError, ConnectionError)
    # A TLS failure needs fixing: failover code that retries ConnectionLost skips it.
    assert not issubclass(meshbus.TLSError, meshbus.ConnectionLost)
    # "You closed it" and "it broke" are different errors.
    assert not issubclass(meshbus.NotConnected, meshbus.ConnectionLost)
    assert not issubclass(meshbus.ConnectionLost, meshbus.NotConnected)


def test_exceptions_carry_typed_fields() -> None:
    exc = meshbus.FrameTooLarge(2000, 1024)
    assert (exc.size, exc.limit) == (2000, 1024)
    assert "1024" in str(exc)
    assert meshbus.RemoteProtocolError(4, "x").code == 4
    assert meshbus.NoRoute("x", "game01:1").address == "game01:1"
    assert meshbus.Timeout("x", 1.5).timeout == 1.5
    assert meshbus.AddressInUse("x", "game01:1", 8).address == "game01:1"
