"""Secure by default: which listen addresses a broker without users may take
(BrokerConfig.check_exposure; the processes are in tests/integration/test_secure_default.py)."""

from __future__ import annotations

import pytest

from meshbus.auth import Credentials
from meshbus.broker.config import AnonymousExposure, BrokerConfig
from meshbus.broker.security.users import UserTable
from meshbus.errors import InvalidArgument


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "localhost", "LocalHost"])
def test_loopback_is_open_without_users(host: str) -> None:
    BrokerConfig(host=host).check_exposure()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "a.example", "128.0.0.1"])
def test_anything_else_without_users_is_refused(host: str) -> None:
    with pytest.raises(AnonymousExposure) as caught:
        BrokerConfig(host=host, port=7400).check_exposure()
    message = str(caught.value)
    assert isinstance(caught.value, InvalidArgument)
    assert "\n" not in message
    assert "7400 without users" in message
    assert "[[users]]" in message
    assert "docs/security.md" in message
    assert "--allow-anonymous" in message


def test_an_ipv6_address_is_named_in_brackets() -> None:
    with pytest.raises(AnonymousExposure, match=r"on \[::\]:7400 "):
        BrokerConfig(host="::", port=7400).check_exposure()


def test_allow_anonymous_or_users_open_it() -> None:
    BrokerConfig(host="0.0.0.0", allow_anonymous=True).check_exposure()
    alice = Credentials.generate("alice")
    users = UserTable.from_config([{"name": "alice", "public_key": alice.public_key}], "t")
    BrokerConfig(host="0.0.0.0", users=users).check_exposure()


# -- the NATS listener (BrokerConfig.check_nats; docs/nats.md) ---------------------------------


def test_nats_on_loopback_is_open_and_beyond_it_needs_allow_anonymous() -> None:
    BrokerConfig().check_nats()  # no --nats-listen: nothing to check
    BrokerConfig(nats_listen="127.0.0.1:4222").check_nats()
    BrokerConfig(nats_listen="[::1]:4222").check_nats()
    with pytest.raises(AnonymousExposure, match=r"NATS clients on 0\.0\.0\.0:4222 without users"):
        BrokerConfig(nats_listen="0.0.0.0:4222").check_nats()
    BrokerConfig(nats_listen="0.0.0.0:4222", allow_anonymous=True).check_nats()


def test_nats_with_users_listens_anywhere_since_its_clients_sign_in() -> None:
    alice = Credentials.generate("alice")
    users = UserTable.from_config([{"name": "alice", "public_key": alice.public_key}], "t")
    BrokerConfig(nats_listen="127.0.0.1:4222", users=users).check_nats()
    BrokerConfig(nats_listen="0.0.0.0:4222", users=users).check_nats()
