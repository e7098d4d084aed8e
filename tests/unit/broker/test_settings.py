"""Each broker setting is declared once (meshbus.broker.config, with meshbus.broker.settings):
what every declaration must have, and the checks that come from it for a config built in
code. The flags and the config file made from them: tests/unit/cli/test_broker_flags.py."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import fields
from typing import Any

import pytest

from meshbus.auth import TokenHash
from meshbus.broker.config import (
    BadSetting,
    BrokerConfig,
    Declared,
    Fsync,
    PartitionHandling,
    StartSettings,
    declared_settings,
)
from meshbus.errors import InvalidArgument, MeshbusError

SETTINGS = [*declared_settings(StartSettings), *declared_settings(BrokerConfig)]
NUMBERS = [each for each in SETTINGS if each.type in (int, float)]

# BrokerConfig's fields that are no setting of their own (meshbus.broker.config says why).
NOT_SETTINGS = {
    "host",
    "port",
    "slot",
    "default_request_timeout",
    "sweep_interval",
    "users",
    "brokers",
    "broker_key",
}

# What a setting may be: a choice is an enum, never a str that only some texts fit.
TYPES = {bool, int, float, str, list[str], TokenHash | None}


def by_key(declared: Declared) -> str:
    return declared.key


def test_every_field_is_a_setting_or_said_not_to_be() -> None:
    settings = {each.name for each in declared_settings(BrokerConfig)}
    assert {each.name for each in fields(BrokerConfig)} - settings == NOT_SETTINGS
    assert {each.name for each in declared_settings(StartSettings)} == {
        each.name for each in fields(StartSettings)
    }


def test_the_keys_are_unique_and_dashed() -> None:
    keys = [each.key for each in SETTINGS]
    assert len(keys) == len(set(keys))
    assert all(re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", key) for key in keys), keys


@pytest.mark.parametrize("declared", SETTINGS, ids=by_key)
def test_every_setting_has_a_type_a_default_and_a_help(declared: Declared) -> None:
    assert declared.type in TYPES or (
        isinstance(declared.type, type) and issubclass(declared.type, enum.Enum)
    )
    if declared.choices:
        assert declared.default in declared.choices
    elif declared.default is not None:
        assert isinstance(declared.default, list if declared.multiple else declared.type)
    assert declared.check(declared.default) == declared.default
    assert declared.help.endswith(".")
    assert "  " not in declared.help


def test_the_choices_are_enums() -> None:
    choices = {each.key: each.type for each in SETTINGS if each.choices}
    assert choices == {"partition-handling": PartitionHandling, "fsync": Fsync}
    assert [choice.value for choice in PartitionHandling] == ["ignore", "pause-minority"]
    assert [choice.value for choice in Fsync] == ["normal", "always"]


@pytest.mark.parametrize("declared", NUMBERS, ids=by_key)
def test_every_bound_of_a_number_is_checked_on_both_sides(declared: Declared) -> None:
    """The bound itself (unless open) and one step inside pass; one step outside (the bound
    itself when open) is a BadSetting, from a config built in code and from a flag's text."""
    setting = declared.setting
    assert setting.min is not None, "every number has a lower bound"
    for bound, is_open, outward in (
        (setting.min, setting.min_open, -1),
        (setting.max, setting.max_open, +1),
    ):
        if bound is None:
            continue
        if declared.type is int:
            assert isinstance(bound, int), "an integer's bounds are integers"
            inside, outside = bound - outward, bound + outward
        else:
            inside = math.nextafter(bound, -outward * math.inf)
            outside = math.nextafter(bound, outward * math.inf)
        good = [inside] if is_open else [bound, inside]
        bad = [bound, outside] if is_open else [outside]
        for value in good:
            assert held(declared, value) == value
            assert declared.from_text(str(value)) == value
        for value in bad:
            with pytest.raises(BadSetting) as caught:
                held(declared, value)
            assert str(caught.value) == (
                f"{declared.key} = {value!r}: {value} is not in the range {declared.range_text}."
            )
            with pytest.raises(BadSetting, match="is not in the range"):
                declared.from_text(str(value))


def held(declared: Declared, value: Any) -> Any:
    """``value`` of ``declared`` as the config built with it holds it."""
    cls = BrokerConfig if declared in declared_settings(BrokerConfig) else StartSettings
    return getattr(cls(**{declared.name: value}), declared.name)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"partition_handling": "pause_minority"},
            "partition-handling = 'pause_minority': 'pause_minority' is not one of "
            "'ignore', 'pause-minority'.",
        ),
        (
            {"fsync": "sometimes"},
            "fsync = 'sometimes': 'sometimes' is not one of 'normal', 'always'.",
        ),
        ({"max_connectors": "many"}, "max-connectors = 'many': 'many' is not a valid integer"),
        ({"max_connectors": True}, "max-connectors = True: True is not a valid integer"),
        ({"max_connectors": 7.0}, "max-connectors = 7.0: 7.0 is not a valid integer"),
        ({"capacity_boost": None}, "capacity-boost = None: None is not a valid float"),
        ({"zone": "rack 1"}, "zone = 'rack 1': 'rack 1' is not a zone"),
        ({"meta_voters": ["a", "b"]}, "meta-voter = ['a', 'b']: name 1, 3 or 5 distinct"),
        ({"meta_voters": ["a", "a", "b"]}, "meta-voter = ['a', 'a', 'b']: name 1, 3 or 5"),
    ],
)
def test_a_value_that_does_not_fit_is_a_bad_setting_never_a_default(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadSetting) as caught:
        BrokerConfig(**settings)
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, InvalidArgument | MeshbusError)
    assert caught.value.key == message.split(" = ")[0]


def test_a_choice_given_as_its_text_becomes_its_member() -> None:
    config = BrokerConfig(partition_handling="pause-minority", fsync=Fsync.ALWAYS)
    assert config.partition_handling is PartitionHandling.PAUSE_MINORITY
    assert config.fsync is Fsync.ALWAYS
    assert BrokerConfig().partition_handling is PartitionHandling.IGNORE


def test_a_float_setting_takes_an_integer() -> None:
    assert BrokerConfig(peer_forget=3).peer_forget == 3
