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
        "ack_wait", "max_deliver", "start_seq", "seqs[]", "replicas",
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


# A RAFT frame's numbers sit in structs inside lists (one Raft message, its entries, its
# snapshot): each, at its place in the sample, with a value past its bounds.
RAFT_OUTSIDE = [
    (("messages", 0, 0), 10**3),  # kind: a U8
    (("messages", 0, 1), 0),  # sender: a node id, 1..2**32-1
    (("messages", 0, 1), 2**32),
    (("messages", 0, 2), 0),  # to
    (("messages", 0, 3), -1),  # term
    (("messages", 0, 3), 2**63),
    (("messages", 0, 4), -1),  # index
    (("messages", 0, 7), 2**63),  # commit
    (("messages", 0, 15), 2**32),  # epoch: a U32
    (("messages", 0, 6, 0, 0), -1),  # an entry's term
    (("messages", 0, 6, 0, 1), 2**63),  # an entry's index
    (("messages", 0, 6, 1, 3), [1, 2, 0]),  # a voter below the node ids
    (("messages", 0, 6, 1, 3), [1, 2, 3, 4, 5, 6, 7]),  # more voters than members
    (("incarnation",), -1),
    (("incarnation",), 2**63),
    (("join", 0), 0),  # the joiner's node id
    (("join", 2, 1, 0), 2**32),  # a member's node id
    (("join", 2, 1, 2), 2**63),  # a member's incarnation
    (("messages", 0, 11, 0), -1),  # the snapshot's index
]


def _sample_at(path: tuple[str | int, ...]) -> Any:
    target: Any = msgspec.msgpack.decode(msgspec.msgpack.encode(SAMPLE_BODIES[ControlType.RAFT]))
    for step in path:
        target = target[step]
    return target


def raft_with(path: tuple[str | int, ...], value: Any) -> bytes:
    body = msgspec.msgpack.decode(msgspec.msgpack.encode(SAMPLE_BODIES[ControlType.RAFT]))
    target = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return msgspec.msgpack.encode(body)


@pytest.mark.parametrize(("path", "value"), RAFT_OUTSIDE, ids=[str(p) for p, _ in RAFT_OUTSIDE])
def test_a_raft_frame_out_of_range_is_a_protocol_error(
    path: tuple[str | int, ...], value: Any
) -> None:
    assert decode_body(ControlType.RAFT, raft_with(path, _sample_at(path))) is not None
    with pytest.raises(FrameError) as error:
        decode_body(ControlType.RAFT, raft_with(path, value))
    assert error.value.code == ErrorCode.PROTOCOL_ERROR


def test_a_raft_frame_has_bounded_lists() -> None:
    sample = msgspec.msgpack.decode(msgspec.msgpack.encode(SAMPLE_BODIES[ControlType.RAFT]))
    message = sample["messages"][0]
    for field, copies in (("messages", 257), ("replicas", 6)):
        body = dict(sample, **{field: [message if field == "messages" else "b"] * copies})
        with pytest.raises(FrameError):
            decode_body(ControlType.RAFT, msgspec.msgpack.encode(body))
    too_many_entries = list(message)
    too_many_entries[6] = [message[6][0]] * 65
    body = dict(sample, messages=[too_many_entries])
    with pytest.raises(FrameError):
        decode_body(ControlType.RAFT, msgspec.msgpack.encode(body))
    with pytest.raises(FrameError):
        decode_body(ControlType.RAFT, msgspec.msgpack.encode(dict(sample, group="")))
