"""The error tree is complete, and the calls that need no broker keep it.

* Every class in ``meshbus.errors`` is a MeshbusError, and the tree drawn in the
  module's docstring is the tree of the classes -- names, parents and the builtin
  each also derives from -- so the documentation cannot drift from the code.
* Every public call that needs no broker, given a value it cannot use, raises
  ``InvalidArgument``, which is also a ``ValueError``; ``connect`` does so before any
  I/O. An argument of the wrong *type* stays Python's own ``TypeError`` (errors.py
  says why).

The calls that need a broker -- a connector's and a service's -- are checked in
tests/integration/test_errors.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable

import pytest

import meshbus
from meshbus import errors
from meshbus.address import Address, Anycast, Multicast, Unicast
from meshbus.errors import InvalidArgument, MeshbusError

# A broker address where nothing listens: a call that got as far as I/O would fail with
# ConnectionLost, not InvalidArgument.
NOWHERE = "127.0.0.1:1"

_TREE_LINE = re.compile(r"^ {4}(?P<rails>[ │]*)[├└]── (?P<name>\w+)(?: \((?P<builtin>\w+)\))?")


def documented_tree() -> dict[str, tuple[str, str | None]]:
    """Each class below MeshbusError as the docstring draws it: (parent, builtin)."""
    assert errors.__doc__ is not None
    tree: dict[str, tuple[str, str | None]] = {}
    path = ["MeshbusError"]
    for line in errors.__doc__.splitlines():
        match = _TREE_LINE.match(line)
        if match is None:
            continue
        depth = len(match["rails"]) // 4 + 1
        del path[depth:]
        tree[match["name"]] = (path[depth - 1], match["builtin"])
        path.append(match["name"])
    return tree


def module_classes() -> dict[str, type[BaseException]]:
    return {
        name: value
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    }


def test_the_docstring_draws_every_class_of_the_module() -> None:
    assert "    MeshbusError\n" in (errors.__doc__ or "")
    assert set(documented_tree()) | {"MeshbusError"} == set(module_classes())


@pytest.mark.parametrize("name", sorted(set(module_classes()) - {"MeshbusError"}))
def test_each_class_has_the_parent_and_builtin_the_docstring_says(name: str) -> None:
    cls = module_classes()[name]
    parent, builtin = documented_tree()[name]
    ours = [base for base in cls.__bases__ if issubclass(base, MeshbusError)]
    builtins = [base.__name__ for base in cls.__bases__ if not issubclass(base, MeshbusError)]
    assert [base.__name__ for base in ours] == [parent]
    assert builtins == ([builtin] if builtin else [])


def test_every_class_is_a_meshbus_error_and_the_root_only_an_exception() -> None:
    assert errors.MeshbusError.__bases__ == (Exception,)
    for cls in module_classes().values():
        assert issubclass(cls, MeshbusError), cls


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (meshbus.InvalidArgument("x"), ValueError),
        (meshbus.Timeout("x", 1.0), TimeoutError),
        (meshbus.ConnectionLost("x"), ConnectionError),
        (meshbus.NotConnected("x"), ConnectionError),
    ],
)
def test_code_that_knows_nothing_of_meshbus_catches_ours(
    error: MeshbusError, builtin: type[Exception]
) -> None:
    with pytest.raises(builtin) as caught:  # `except builtin:` in code without meshbus
        raise error
    assert caught.value is error
    assert str(caught.value) == "x"  # OSError's "[Errno ...]" formatting stays out of it


# -- bad values to calls that need no broker -------------------------------------------------

SYNC_CALLS: dict[str, Callable[[], object]] = {
    "Address.parse without ':'": lambda: Address.parse("game01"),
    "Address.parse, instance not a number": lambda: Address.parse("game01:x"),
    "Address.parse, instance out of range": lambda: Address.parse("game01:0"),
    "Address.parse, unicast: without instance": lambda: Address.parse("unicast:game01"),
    "Address.parse, group name too long": lambda: Address.parse("multicast:" + "x" * 16),
    "Address.from_bytes, wrong size": lambda: Address.from_bytes(b"x"),
    "Address.from_bytes, unknown cast": lambda: Address.from_bytes(bytes([9]) + bytes(15)),
    "Address.from_bytes, no name": lambda: Address.from_bytes(bytes([2]) + bytes(15)),
    "Unicast, server name too long": lambda: Unicast("x" * 12, 1),
    "Unicast, reserved server name": lambda: Unicast("multicast", 1),
    "Unicast, empty server name": lambda: Unicast("", 1),
    "Unicast, instance 0": lambda: Unicast("game01", 0),
    "Unicast, instance too large": lambda: Unicast("game01", 1 << 32),
    "Multicast, empty name": lambda: Multicast(""),
    "Multicast, name too long": lambda: Multicast("x" * 16),
    "Anycast, ':' in the name": lambda: Anycast("a:b"),
    "RetryPolicy, ack_timeout 0": lambda: meshbus.RetryPolicy(ack_timeout=0),
    "RetryPolicy, ack_timeout NaN": lambda: meshbus.RetryPolicy(ack_timeout=math.nan),
    "RetryPolicy, backoff below 1": lambda: meshbus.RetryPolicy(backoff=0.5),
    "RetryPolicy, max_interval 0": lambda: meshbus.RetryPolicy(max_interval=0),
    "RetryPolicy, max_attempts 0": lambda: meshbus.RetryPolicy(max_attempts=0),
    "RetryPolicy.interval(0)": lambda: meshbus.RetryPolicy().interval(0),
    "ReliableConfig, dedupe_window 0": lambda: meshbus.ReliableConfig(dedupe_window=0),
    "ReliableConfig, max_unacked 0": lambda: meshbus.ReliableConfig(max_unacked=0),
    "ReliableConfig, suspicion 0": lambda: meshbus.ReliableConfig(suspicion=0),
    "ReliableConfig, group_expiry 0": lambda: meshbus.ReliableConfig(group_expiry=0),
    "ReliableConfig, group_expiry NaN": lambda: meshbus.ReliableConfig(group_expiry=math.nan),
}


@pytest.mark.parametrize("call", SYNC_CALLS.values(), ids=SYNC_CALLS.keys())
def test_a_bad_value_is_an_invalid_argument(call: Callable[[], object]) -> None:
    with pytest.raises(InvalidArgument) as raised:
        call()
    assert isinstance(raised.value, ValueError)
    assert str(raised.value)  # a message to act on


CONNECT_CALLS: dict[str, Callable[[], Awaitable[meshbus.Connector]]] = {
    "no broker": lambda: meshbus.connect("", server="x"),
    "no broker in a list": lambda: meshbus.connect([" ", ""], server="x"),
    "broker port not a number": lambda: meshbus.connect("localhost:x", server="x"),
    "broker port out of range": lambda: meshbus.connect("127.0.0.1:70000", server="x"),
    "one bad broker of several": lambda: meshbus.connect([NOWHERE, "h:x"], server="x"),
    "server name too long": lambda: meshbus.connect(NOWHERE, server="x" * 12),
    "reserved server name": lambda: meshbus.connect(NOWHERE, server="anycast"),
    "empty server name": lambda: meshbus.connect(NOWHERE, server=""),
    "max_frame below the minimum": lambda: meshbus.connect(NOWHERE, server="x", max_frame=255),
    "max_inbox 0": lambda: meshbus.connect(NOWHERE, server="x", max_inbox=0),
    "timeout 0": lambda: meshbus.connect(NOWHERE, server="x", timeout=0),
    "timeout NaN": lambda: meshbus.connect(NOWHERE, server="x", timeout=math.nan),
    "negative failover_timeout": lambda: meshbus.connect(NOWHERE, server="x", failover_timeout=-1),
    "negative keepalive": lambda: meshbus.connect(NOWHERE, server="x", keepalive=-1),
    "negative request_timeout": lambda: meshbus.connect(NOWHERE, server="x", request_timeout=-1),
}


@pytest.mark.parametrize("call", CONNECT_CALLS.values(), ids=CONNECT_CALLS.keys())
async def test_connect_refuses_a_bad_value_before_any_io(
    call: Callable[[], Awaitable[meshbus.Connector]],
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await call()
    assert isinstance(raised.value, ValueError)


TYPE_ERRORS: dict[str, Callable[[], object]] = {
    "Unicast, server name not a str": lambda: Unicast(5, 1),  # type: ignore[arg-type]
    "Unicast, instance not an int": lambda: Unicast("game01", "1"),  # type: ignore[arg-type]
    "Multicast, name as bytes": lambda: Multicast(b"chat"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", TYPE_ERRORS.values(), ids=TYPE_ERRORS.keys())
def test_a_wrong_type_stays_a_type_error(call: Callable[[], object]) -> None:
    with pytest.raises(TypeError) as raised:
        call()
    assert not isinstance(raised.value, MeshbusError)
