"""Payloads as JSON: ``send(..., json=value)`` and ``Message.json()``/``decode(Type)``.

msgspec does the work (a dependency already): it encodes dicts, lists, dataclasses,
msgspec Structs, enums, datetimes and UUIDs, and decodes into any of those types with
validation, faster than the standard library's json.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgspec

from meshbus.errors import InvalidArgument, InvalidPayload
from meshbus.protocol.codec import BytesLike

T = TypeVar("T")


class _NoJson:
    """The default of ``json=``: no JSON value given (None is a JSON value: null)."""

    def __repr__(self) -> str:
        return "<no json>"


NO_JSON: Final = _NoJson()

_encode = msgspec.json.Encoder().encode


def body(payload: BytesLike | None, json: object) -> BytesLike:
    """The bytes a send carries: ``payload``, or ``json`` encoded; exactly one is given."""
    if json is NO_JSON:
        if payload is None:
            raise InvalidArgument("nothing to send: give a payload (bytes) or json=value")
        return payload
    if payload is not None:
        raise InvalidArgument("give a payload or json=, not both")
    try:
        return _encode(json)
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidArgument(f"json= cannot be encoded as JSON: {exc}") from None


def decode(payload: bytes, type_: type[T] | Any = Any) -> T:
    """``payload`` as JSON, validated as ``type_`` when one is given."""
    try:
        return msgspec.json.decode(payload, type=type_)
    except msgspec.ValidationError as exc:
        raise InvalidPayload(f"the payload does not fit {_name(type_)}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidPayload(f"the payload is not JSON: {exc}") from None


def _name(type_: object) -> str:
    return getattr(type_, "__name__", None) or repr(type_)
