"""What the client's calls take for an address: an ``Address``, or its text form.

Both ``Service`` (meshbus.client.service) and ``conn.streams``
(meshbus.client.streams) take them, so the parsing lives below both.
"""

from __future__ import annotations

import functools

from meshbus.address import Address

AddressLike = Address | str


def as_address(value: AddressLike) -> Address:
    """Accept an Address or its text form (``game01:1``, ``multicast:chat``, ``anycast:login``)."""
    if isinstance(value, Address):
        return value
    if isinstance(value, str):
        return _parse(value)
    raise TypeError(f"expected an Address or its text form, not {type(value).__name__}")


# Most senders name a few addresses over and over: parse each text form once.
_parse = functools.lru_cache(maxsize=4096)(Address.parse)
