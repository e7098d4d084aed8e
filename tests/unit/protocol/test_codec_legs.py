"""The codec's two legs alike: the compiled one (meshbus.compiled) against its source.

The source is loaded a second time, as a module of its own, beside the compiled codec
this process runs; hypothesis then gives both the same bytes, cut the same way, and the
same frames to encode. What each returns -- and what each raises, its type, message
and wire code -- must be the same. (Both legs are one source, so this checks the
compiler, and the parts of the source it compiles differently: a call against the type
hints may get mypyc's TypeError instead; no caller in meshbus makes one.)
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshbus.protocol.codec as running_codec
from meshbus.compiled import is_compiled, source_path
from meshbus.protocol.layout import DATA_HEADER, KIND_CONTROL, KIND_DATA, ControlType

pytestmark = pytest.mark.skipif(
    not is_compiled(running_codec),
    reason="the codec runs from its source here: one leg, nothing to compare",
)


def _source_codec() -> ModuleType:
    name = "meshbus_codec_source"  # a module of its own: the compiled one stays in place
    spec = importlib.util.spec_from_file_location(name, source_path("meshbus.protocol.codec"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses looks its module up
    spec.loader.exec_module(module)
    return module


LEGS = {"compiled": running_codec, "source": _source_codec()}


def _outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """What a call gave, comparable across legs: frames as plain tuples, errors by their
    type's name, message and wire code."""
    try:
        result = call(*args, **kwargs)
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc), getattr(exc, "code", None))
    return ("returned", _plain(result))


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if type(value).__name__ == "DataFrame":
        return (
            "data",
            *(
                getattr(value, field)
                for field in (
                    "dst",
                    "src",
                    "payload",
                    "msg_id",
                    "response_for",
                    "flags",
                    "hops",
                    "link_tag",
                    "timeout_ms",
                )
            ),
        )
    if type(value).__name__ == "ControlFrame":
        return ("control", value.type, value.body, value.correlation)
    return value


# -- what the wire may bring ----------------------------------------------------------

_u8 = st.integers(0, 255)
_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)


@st.composite
def _data_frame(draw: st.DrawFn) -> bytes:
    payload = draw(st.binary(max_size=80))
    declared = DATA_HEADER.size + len(payload) - 4 + draw(st.sampled_from([0, 0, 0, -1, 1, -60]))
    header = DATA_HEADER.pack(
        max(declared, 0),
        draw(st.sampled_from([KIND_DATA, KIND_DATA, KIND_DATA, KIND_CONTROL, 7])),
        draw(st.sampled_from([1, 1, 1, 0, 2])),  # the version
        draw(_u8),  # flags: REQUEST and RESPONSE together are refused
        draw(_u8),
        draw(st.binary(min_size=16, max_size=16)),
        draw(st.binary(min_size=16, max_size=16)),
        draw(_u32),
        draw(_u64),
        draw(_u64),
        draw(_u32),
    )
    return header + payload


@st.composite
def _control_frame(draw: st.DrawFn) -> bytes:
    known = draw(st.sampled_from([int(t) for t in ControlType]))
    ctype = draw(st.sampled_from([known, known, 999]))
    body = draw(st.binary(max_size=40))
    declared = 12 + len(body) - 4 + draw(st.sampled_from([0, 0, 0, -9, 3]))
    header = struct.pack(">IBBHI", max(declared, 0), KIND_CONTROL, 1, ctype, draw(_u32))
    return header + body


_wire = st.lists(
    st.one_of(_data_frame(), _control_frame(), st.binary(min_size=1, max_size=12)),
    max_size=12,
).map(b"".join)


def _decoded(
    codec: ModuleType, data: bytes, cuts: list[int], max_frame: int, one: bool
) -> list[Any]:
    """Every outcome of feeding ``data`` in pieces cut at ``cuts``, taking the frames
    after each piece (with ``frames``, or with ``next_frame`` when ``one``)."""
    decoder = codec.FrameDecoder(max_frame)
    outcomes: list[Any] = []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        outcomes.append(_outcome(decoder.feed, data[start:end]))
        for _ in range(len(data) + 1):
            if one:
                outcome = _outcome(decoder.next_frame)
                done = outcome == ("returned", None)
            else:
                outcome = _outcome(decoder.frames)
                done = outcome == ("returned", [])
            outcomes.append(outcome)
            if done or outcome[0] == "raised":
                break
    outcomes.append(decoder.buffered)
    return outcomes


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=_wire,
    cut_at=st.lists(st.integers(0, 2000), max_size=4),
    max_frame=st.sampled_from([64, 100, 1024 * 1024]),
    one=st.booleans(),
)
def test_both_legs_decode_alike(data: bytes, cut_at: list[int], max_frame: int, one: bool) -> None:
    cuts = sorted({c for c in cut_at if 0 < c < len(data)})
    compiled, source = (_decoded(leg, data, cuts, max_frame, one) for leg in LEGS.values())
    assert compiled == source


@settings(max_examples=200)
@given(data=_wire, pos=st.integers(0, 40), max_frame=st.sampled_from([64, 100, 1024 * 1024]))
def test_both_legs_measure_a_frame_alike(data: bytes, pos: int, max_frame: int) -> None:
    """``frame_extent``, which the broker's hot path calls on every read."""
    buffers = (data, bytearray(data), memoryview(data))
    compiled, source = (
        [_outcome(leg.frame_extent, b, pos, len(data), max_frame) for b in buffers]
        for leg in LEGS.values()
    )
    assert compiled == source


@settings(max_examples=300)
@given(
    dst=st.binary(min_size=15, max_size=17),
    src=st.binary(min_size=16, max_size=16),
    payload=st.one_of(st.binary(max_size=200), st.binary(max_size=50).map(bytearray)),
    numbers=st.lists(st.integers(-1, 2**64), min_size=6, max_size=6),
    max_frame=st.sampled_from([64, 100, 1024 * 1024]),
)
def test_both_legs_encode_alike(
    dst: bytes, src: bytes, payload: bytes, numbers: list[int], max_frame: int
) -> None:
    """Out-of-range numbers and over-long payloads included: the same bytes, or the same
    error."""
    msg_id, response_for, flags, hops, link_tag, timeout_ms = numbers
    compiled, source = (
        _outcome(
            leg.encode_data,
            dst,
            src,
            payload,
            msg_id=msg_id,
            response_for=response_for,
            flags=flags % 257,
            hops=hops % 257,
            link_tag=link_tag,
            timeout_ms=timeout_ms,
            max_frame=max_frame,
        )
        for leg in LEGS.values()
    )
    assert compiled == source


@given(
    ctype=st.integers(0, 70000),
    raw=st.binary(max_size=60),
    correlation=st.integers(-1, 2**32),
    max_frame=st.sampled_from([None, 16, 1024]),
)
def test_both_legs_encode_a_control_frame_alike(
    ctype: int, raw: bytes, correlation: int, max_frame: int | None
) -> None:
    compiled, source = (
        _outcome(leg.encode_control_raw, ctype, raw, correlation, max_frame=max_frame)
        for leg in LEGS.values()
    )
    assert compiled == source
