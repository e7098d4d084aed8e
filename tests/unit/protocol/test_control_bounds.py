"""Every number a client or a peer sends in a control body has bounds: a value outside
them is the sender's PROTOCOL_ERROR at decode, never an OverflowError in the broker or a
number SQLite cannot store."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from meshbus.protocol.codec import FrameError, decode_body
from meshbus.protocol.control import BODY_TYPES, StreamRequest, encode_in_bounds
from meshbus.protocol.layout import ControlType, ErrorCode
from tests.unit.protocol.test_codec import SAMPLE_BODIES

# Fields of bodies a client or a peer sends, that must be bounded (and the bound kept).
MUST_BE_BOUNDED = {
    "StreamRequest": {
        "max_msgs", "max_bytes", "max_age", "dedupe_window", "from_seq", "max_count",
        "ack_wait", "max_deliver", "start_seq", "seqs[]",
    },
    "Register": {"instance"},
    "Drain": {"grace"},
    "GroupBind": {"expiry"},
    "Load": {"connectors", "capacity", "slot"},
    "Routes": {"seq", "ops[][0]"},
    "Routed": {"seq"},
    "Hello": {"protocol", "max_frame", "slot", "tag"},
    "Ready": {"counts{}"},
    "Groups": {"ops[][3]"},
    "NatsMessages": {"msgs[][2]"},
}  # fmt: skip


def bounded(
    t: msgspec.inspect.Type, path: str
) -> list[tuple[str, float | None, float | None, bool]]:
    """(path, lowest, highest, float?) of every bounded number inside type ``t``."""
    if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        is_float = isinstance(t, msgspec.inspect.FloatType)
        if t.ge is None and t.le is None:
            return []
        return [(path, t.ge, t.le, is_float)]
    if isinstance(t, msgspec.inspect.ListType):
        return bounded(t.item_type, path + "[]")
    if isinstance(t, msgspec.inspect.DictType):
        return bounded(t.value_type, path + "{}")
    if isinstance(t, msgspec.inspect.TupleType):
        return [b for i, item in enumerate(t.item_types) for b in bounded(item, f"{path}[{i}]")]
    return []


CASES = [
    (ctype, f.name + rest, low, high, is_float)
    for ctype, cls in BODY_TYPES.items()
    for f in msgspec.inspect.type_info(cls).fields  # type: ignore[attr-defined]
    for rest, low, high, is_float in bounded(f.type, "")
]


def test_every_field_a_sender_controls_is_bounded() -> None:
    found: dict[str, set[str]] = {}
    for ctype, path, _, _, _ in CASES:
        found.setdefault(BODY_TYPES[ctype].__name__, set()).add(path)
    for body, fields in MUST_BE_BOUNDED.items():
        assert fields <= found.get(body, set()), body


def with_value(ctype: ControlType, path: str, value: Any) -> bytes:
    """The sample body of ``ctype`` as a map, with ``value`` at ``path``."""
    body = msgspec.msgpack.decode(msgspec.msgpack.encode(SAMPLE_BODIES[ctype]))
    name, _, rest = path.partition("[") if "[" in path else path.partition("{")
    if not rest and "{" not in path:
        body[name] = value
    elif path.endswith("{}"):
        body[name] = {"x": value}
    elif path.endswith("[]"):
        body[name] = [value]
    else:  # a tuple in a list: name[][i]
        index = int(path.rsplit("[", 1)[1].rstrip("]"))
        item = list(body[name][0]) if body.get(name) else None
        assert item is not None, f"the sample of {ctype.name} needs an item in {name}"
        item[index] = value
        body[name] = [item]
    return msgspec.msgpack.encode(body)


@pytest.mark.parametrize(
    ("ctype", "path", "low", "high", "is_float"),
    CASES,
    ids=[f"{BODY_TYPES[c].__name__}.{p}" for c, p, *_ in CASES],
)
def test_out_of_range_is_a_protocol_error(
    ctype: ControlType, path: str, low: float | None, high: float | None, is_float: bool
) -> None:
    outside: list[Any] = [-(2**63), -1] if low == 0 else [-(2**63)]  # what msgpack carries
    if high is not None:
        outside.append(2**64 - 1)
    if low is not None:
        outside.append(low - 1)
        assert decode_body(ctype, with_value(ctype, path, low)) is not None
    if high is not None:
        outside.append(high + 1 if not is_float else high * 1.5 + 1)
        assert decode_body(ctype, with_value(ctype, path, high)) is not None
    if is_float:
        outside += [math.nan, math.inf, -math.inf]
    for value in outside:
        if high is not None and low is not None and low <= value <= high:
            continue
        with pytest.raises(FrameError) as error:
            decode_body(ctype, with_value(ctype, path, value))
        assert error.value.code == ErrorCode.PROTOCOL_ERROR
        assert "malformed" in str(error.value)


def test_a_sender_may_check_the_bounds_first() -> None:
    encode_in_bounds(ControlType.STREAM, StreamRequest(op="add", max_msgs=2**40))
    with pytest.raises(ValueError, match="out of range") as error:
        encode_in_bounds(ControlType.STREAM, StreamRequest(op="add", max_msgs=2**64 - 1))
    assert str(error.value) == (
        "a number out of range in the STREAM request: "
        "Expected `int` <= 1099511627776 - at `$.max_msgs`"
    )
