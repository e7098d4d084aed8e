"""Addresses: the 16-byte wire form, the text form, and their validation rules."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshbus.address import (
    ADDRESS_SIZE,
    CAST_ANYCAST,
    CAST_MULTICAST,
    CAST_UNICAST,
    DYNAMIC_INSTANCE_MIN,
    GROUP_NAME_MAX,
    SERVER_NAME_MAX,
    Address,
    Anycast,
    Multicast,
    Unicast,
    dynamic_instance,
    server_name_bytes,
)
from meshbus.errors import InvalidArgument

# -- wire form -----------------------------------------------------------------


def test_limits_match_the_architecture() -> None:
    assert ADDRESS_SIZE == 16
    assert SERVER_NAME_MAX == 11
    assert GROUP_NAME_MAX == 15
    assert DYNAMIC_INSTANCE_MIN == 65536


def test_unicast_wire_form_is_exact() -> None:
    raw = Unicast("game01", 0x01020304).to_bytes()
    assert raw == b"\x01game01\x00\x00\x00\x00\x00\x01\x02\x03\x04"
    assert len(raw) == 16


def test_multicast_wire_form_is_exact() -> None:
    raw = Multicast("chat.lobby").to_bytes()
    assert raw == b"\x02chat.lobby\x00\x00\x00\x00\x00"
    assert len(raw) == 16


def test_anycast_wire_form_is_exact() -> None:
    raw = Anycast("login").to_bytes()
    assert raw == b"\x03login" + b"\x00" * 10
    assert len(raw) == 16


@pytest.mark.parametrize(
    "address",
    [
        Unicast("a", 1),
        Unicast("x" * 11, 0xFFFFFFFF),
        Unicast("é" * 5 + "a", 65536),
        Multicast("t"),
        Multicast("m" * 15),
        Anycast("a" * 15),
        Anycast("€" * 5),
    ],
    ids=str,
)
def test_bytes_round_trip(address: Address) -> None:
    raw = address.to_bytes()
    assert len(raw) == ADDRESS_SIZE
    back = Address.from_bytes(raw)
    assert back == address
    assert type(back) is type(address)
    assert back.to_bytes() == raw
    # bytearray and memoryview inputs decode the same way.
    assert Address.from_bytes(bytearray(raw)) == address
    assert Address.from_bytes(memoryview(raw)) == address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("game01:1", Unicast("game01", 1)),
        ("game01:65537", Unicast("game01", 65537)),
        ("unicast:game01:7", Unicast("game01", 7)),
        ("multicast:chat.lobby", Multicast("chat.lobby")),
        ("anycast:login", Anycast("login")),
    ],
)
def test_parse(text: str, expected: Address) -> None:
    assert Address.parse(text) == expected


@pytest.mark.parametrize(
    ("address", "text"),
    [
        (Unicast("game01", 65537), "game01:65537"),
        (Multicast("chat.lobby"), "multicast:chat.lobby"),
        (Anycast("login"), "anycast:login"),
    ],
)
def test_str_round_trip(address: Address, text: str) -> None:
    assert str(address) == text
    assert Address.parse(text) == address


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("game01", "has no ':'"),
        ("game01:x", "not a decimal integer"),
        ("game01:", "not a decimal integer"),
        ("game01:0", "out of range"),
        ("unicast:game01", "expected unicast:SERVER:INSTANCE"),
        ("multicast:", "empty"),
        ("anycast:", "empty"),
        (":5", "empty"),
        ("multicast:a:b", "NUL or ':'"),
        ("abcdefghijkl:1", "limit is 11 bytes"),
        ("multicast:abcdefghijklmnop", "limit is 15 bytes"),
        ("Multicast:chat", "lower case; did you mean multicast:chat?"),
        ("ANYCAST:login", "lower case; did you mean anycast:login?"),
        ("Unicast:game01:5", "lower case; did you mean unicast:game01:5?"),
    ],
)
def test_parse_rejects(text: str, error: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(error)):
        Address.parse(text)


# -- names ----------------------------------------------------------------------


def test_server_name_at_limit_fits() -> None:
    assert Unicast("a" * 11, 1).server == "a" * 11
    assert server_name_bytes("a" * 11) == b"a" * 11
    assert server_name_bytes("ab") == b"ab" + b"\x00" * 9


def test_server_name_too_long_names_the_limit() -> None:
    with pytest.raises(InvalidArgument, match=r"limit is 11 bytes"):
        Unicast("a" * 12, 1)


@pytest.mark.parametrize("cls", [Multicast, Anycast])
def test_group_name_too_long_names_the_limit(cls: type[Multicast] | type[Anycast]) -> None:
    assert cls("g" * 15).name == "g" * 15
    with pytest.raises(InvalidArgument, match=r"limit is 15 bytes"):
        cls("g" * 16)


def test_server_name_limit_counts_utf8_bytes_not_characters() -> None:
    # 'é' is 2 bytes: 5 of them plus one ASCII letter is 11 bytes, 6 of them are 12.
    assert len(Unicast("é" * 5 + "a", 1).to_bytes()) == 16
    with pytest.raises(InvalidArgument, match=r"12 bytes in UTF-8.*limit is 11 bytes"):
        Unicast("é" * 6, 1)


def test_group_name_limit_counts_utf8_bytes_not_characters() -> None:
    # '€' is 3 bytes: 5 of them are 15 bytes, one more letter makes 16.
    assert Multicast("€" * 5).to_bytes() == b"\x02" + "€".encode() * 5
    with pytest.raises(InvalidArgument, match=r"16 bytes in UTF-8.*limit is 15 bytes"):
        Multicast("€" * 5 + "a")


@pytest.mark.parametrize(
    "make", [lambda: Unicast("", 1), lambda: Multicast(""), lambda: Anycast("")]
)
def test_empty_names_are_rejected(make: object) -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        make()  # type: ignore[operator]


@pytest.mark.parametrize("bad", ["a\x00b", "a:b", ":", "\x00"])
def test_nul_and_colon_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="NUL or ':'"):
        Unicast(bad, 1)
    with pytest.raises(InvalidArgument, match="NUL or ':'"):
        Multicast(bad)
    with pytest.raises(InvalidArgument, match="NUL or ':'"):
        Anycast(bad)


@pytest.mark.parametrize("name", ["unicast", "multicast", "anycast"])
def test_reserved_server_names(name: str) -> None:
    with pytest.raises(InvalidArgument, match="reserved"):
        Unicast(name, 1)
    # Group names have no such restriction: the prefix already says what they are.
    assert Multicast(name).name == name


def test_non_str_names_raise_type_error() -> None:
    with pytest.raises(TypeError):
        Unicast(b"game", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Multicast(5)  # type: ignore[arg-type]


# -- instances ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance", "fixed"), [(1, True), (65535, True), (65536, False), (2**32 - 1, False)]
)
def test_instance_in_range(instance: int, fixed: bool) -> None:
    address = Unicast("s", instance)
    assert address.is_fixed is fixed
    assert address.to_bytes()[12:] == instance.to_bytes(4, "big")
    assert Address.from_bytes(address.to_bytes()) == address


@pytest.mark.parametrize("instance", [0, -1, 2**32, 2**40])
def test_instance_out_of_range(instance: int) -> None:
    with pytest.raises(InvalidArgument, match="out of range"):
        Unicast("s", instance)


def test_instance_must_be_an_int() -> None:
    with pytest.raises(TypeError):
        Unicast("s", True)
    with pytest.raises(TypeError):
        Unicast("s", 1.0)  # type: ignore[arg-type]


def test_is_group() -> None:
    assert not Unicast("s", 1).is_group
    assert Multicast("m").is_group
    assert Anycast("a").is_group


def test_addresses_are_frozen() -> None:
    address = Unicast("s", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        address.instance = 2  # type: ignore[misc]


# -- hashing, equality, ordering --------------------------------------------------


def test_equality_and_hash() -> None:
    assert Unicast("s", 1) == Unicast("s", 1)
    assert hash(Unicast("s", 1)) == hash(Unicast("s", 1))
    assert Unicast("s", 1) != Unicast("s", 2)
    assert Unicast("s", 1) != Unicast("t", 1)
    # Same name, different cast type: different addresses.
    assert Multicast("x") != Anycast("x")
    assert len({Multicast("x"), Anycast("x"), Multicast("x")}) == 2
    assert {Unicast("s", 1): "a"}[Address.parse("s:1")] == "a"


def test_not_equal_to_other_types() -> None:
    assert Unicast("s", 1) != "s:1"
    assert Unicast("s", 1) != Unicast("s", 1).to_bytes()
    with pytest.raises(TypeError):
        _ = Unicast("s", 1) < "s:2"  # type: ignore[operator]


def test_ordering_follows_wire_bytes() -> None:
    a = [Anycast("a"), Multicast("z"), Unicast("b", 1), Unicast("a", 2), Unicast("a", 1)]
    assert sorted(a) == [
        Unicast("a", 1),
        Unicast("a", 2),
        Unicast("b", 1),
        Multicast("z"),
        Anycast("a"),
    ]
    assert Unicast("a", 1) < Unicast("a", 2) <= Unicast("a", 2)
    assert Anycast("a") > Multicast("z") >= Multicast("z")
    # Big-endian instances sort numerically.
    assert Unicast("a", 255) < Unicast("a", 256)


# -- decoding invalid bytes ------------------------------------------------------


@pytest.mark.parametrize("cast", [0, 4, 5, 0xFF])
def test_from_bytes_rejects_unknown_cast_type(cast: int) -> None:
    raw = bytes((cast,)) + b"name" + b"\x00" * 11
    with pytest.raises(InvalidArgument, match="cast type"):
        Address.from_bytes(raw)


@pytest.mark.parametrize("length", [0, 1, 15, 17, 32])
def test_from_bytes_rejects_bad_length(length: int) -> None:
    raw = (Unicast("s", 1).to_bytes() * 3)[:length]
    with pytest.raises(InvalidArgument, match="16 bytes"):
        Address.from_bytes(raw)


_PAD = "not a NUL-padded name"


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"\x01" + b"\x00" * 11 + b"\x00\x00\x00\x01", _PAD),  # empty server name
        (b"\x01\x00abc" + b"\x00" * 7 + b"\x00\x00\x00\x01", _PAD),  # NUL before the name
        (b"\x01ab\x00cd" + b"\x00" * 6 + b"\x00\x00\x00\x01", _PAD),  # NUL inside the name
        (b"\x01game01" + b"\x00" * 5 + b"\x00\x00\x00\x00", "out of range"),  # instance 0
        (b"\x01\xff\xfe" + b"\x00" * 9 + b"\x00\x00\x00\x01", "not UTF-8"),
        (b"\x01a:b" + b"\x00" * 8 + b"\x00\x00\x00\x01", "NUL or ':'"),
        (b"\x01unicast" + b"\x00" * 4 + b"\x00\x00\x00\x01", "reserved"),
        (b"\x02" + b"\x00" * 15, _PAD),  # empty group name
        (b"\x03\xc3" + b"\x00" * 14, "not UTF-8"),  # truncated UTF-8 sequence
    ],
)
def test_from_bytes_rejects_invalid_contents(raw: bytes, error: str) -> None:
    assert len(raw) == 16
    with pytest.raises(InvalidArgument, match=re.escape(error)):
        Address.from_bytes(raw)


# -- dynamic ids ------------------------------------------------------------------


def test_dynamic_instance_values() -> None:
    assert dynamic_instance(1, 0) == 65536
    assert dynamic_instance(1, 1) == 65537
    assert dynamic_instance(2, 0) == 131072
    assert dynamic_instance(0xFFFF, 0xFFFF) == 2**32 - 1
    for slot, seq in [(1, 0), (7, 123), (0xFFFF, 0xFFFF)]:
        assert not Unicast("s", dynamic_instance(slot, seq)).is_fixed


@pytest.mark.parametrize(("slot", "seq"), [(0, 0), (0x10000, 0), (1, -1), (1, 0x10000)])
def test_dynamic_instance_rejects_out_of_range(slot: int, seq: int) -> None:
    with pytest.raises(InvalidArgument, match="out of range"):
        dynamic_instance(slot, seq)


@given(
    st.integers(1, 0xFFFF),
    st.integers(0, 0xFFFF),
    st.integers(1, 0xFFFF),
    st.integers(0, 0xFFFF),
)
def test_dynamic_instances_of_different_slots_never_collide(
    slot_a: int, seq_a: int, slot_b: int, seq_b: int
) -> None:
    a = dynamic_instance(slot_a, seq_a)
    b = dynamic_instance(slot_b, seq_b)
    assert a >= DYNAMIC_INSTANCE_MIN
    assert (a == b) == ((slot_a, seq_a) == (slot_b, seq_b))
    assert divmod(a, 65536) == (slot_a, seq_a)


# -- properties ---------------------------------------------------------------------

_NAME_CHARS = st.characters(blacklist_characters="\x00:", blacklist_categories=("Cs",))


def _names(limit: int) -> st.SearchStrategy[str]:
    return st.text(_NAME_CHARS, min_size=1, max_size=limit).filter(
        lambda s: len(s.encode()) <= limit
    )


_server_names = _names(SERVER_NAME_MAX).filter(
    lambda s: s not in ("unicast", "multicast", "anycast")
)

addresses = st.one_of(
    st.builds(Unicast, _server_names, st.integers(1, 2**32 - 1)),
    st.builds(Multicast, _names(GROUP_NAME_MAX)),
    st.builds(Anycast, _names(GROUP_NAME_MAX)),
)


@given(addresses)
def test_round_trip_property(address: Address) -> None:
    raw = address.to_bytes()
    assert len(raw) == ADDRESS_SIZE
    assert raw[0] == address.cast_type
    assert Address.from_bytes(raw) == address
    assert Address.parse(str(address)) == address


@given(addresses, addresses)
def test_order_and_equality_agree_with_bytes(a: Address, b: Address) -> None:
    assert (a == b) == (a.to_bytes() == b.to_bytes())
    assert (a < b) == (a.to_bytes() < b.to_bytes())
    if a == b:
        assert hash(a) == hash(b)


@given(st.binary(min_size=16, max_size=16))
def test_from_bytes_accepts_only_canonical_forms(raw: bytes) -> None:
    """Any 16 bytes either decode to an address that encodes back to them, or raise
    InvalidArgument."""
    try:
        address = Address.from_bytes(raw)
    except InvalidArgument:
        return
    assert address.to_bytes() == raw
    assert raw[0] in (CAST_UNICAST, CAST_MULTICAST, CAST_ANYCAST)


def test_describing_an_address_leaves_the_address_cache_alone() -> None:
    """The broker describes every service in a detailed stat: through the cache, 50,000
    services left 50,000 Address objects behind (memory, and work for the collector)."""
    from meshbus.address import _from_bytes_cached, describe_address

    before = _from_bytes_cached.cache_info().currsize
    texts = [describe_address(Unicast("described", i).to_bytes()) for i in range(1, 101)]
    assert texts[0] == "described:1"
    assert _from_bytes_cached.cache_info().currsize == before
