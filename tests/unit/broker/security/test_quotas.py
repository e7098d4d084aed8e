"""A user's ``[users.quotas]`` read and checked (meshbus.broker.security.quotas), and the usage
table that holds each user's figures against them (meshbus.broker.core.usage)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from meshbus.address import Multicast, server_name_bytes
from meshbus.auth import Credentials
from meshbus.broker.config_file import read_config
from meshbus.broker.core.endpoint import Endpoint, is_peer
from meshbus.broker.core.link import Link
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.core.usage import QuotaExceeded, UsageTable
from meshbus.broker.security.quotas import MAX_QUOTA, QUOTA_KEYS, BadQuotas, Quotas
from meshbus.broker.security.users import User, UserTable
from meshbus.cli.broker import broker
from meshbus.testing import Hub

ALICE = Credentials.generate("alice")


def test_a_table_sets_the_quotas_it_names_and_the_rest_keep_their_defaults() -> None:
    quotas = Quotas.from_table({"connections": 3, "stream_bytes": 0}, "alice")
    assert quotas == Quotas(connections=3, stream_bytes=0)
    assert Quotas.from_table({}, "alice") == Quotas(
        connections=64, services=100_000, memberships=100_000, requests=65_536
    )
    assert Quotas().stream_bytes is None, "no quota unless set"


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        ({"conections": 3}, "quotas.conections", "unknown key quotas.conections"),
        ({"services": "many"}, "quotas.services", "quotas.services is a whole number"),
        ({"services": True}, "quotas.services", "quotas.services is a whole number"),
        ({"requests": 1.5}, "quotas.requests", "quotas.requests is a whole number"),
        ({"memberships": -1}, "quotas.memberships", f"it is 0 to {MAX_QUOTA}"),
        ({"stream_bytes": MAX_QUOTA + 1}, "quotas.stream_bytes", f"it is 0 to {MAX_QUOTA}"),
        (["connections"], "quotas", "quotas is a table"),
    ],
)
def test_a_bad_table_names_the_user_and_the_key(table: object, key: str, words: str) -> None:
    with pytest.raises(BadQuotas) as caught:
        Quotas.from_table(table, "alice")
    assert caught.value.key == key
    assert str(caught.value).startswith("user 'alice': ")
    assert words in str(caught.value)


def test_the_config_file_gives_each_user_its_quotas(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[[users]]\nname = "alice"\npublic_key = "{ALICE.public_key}"\n'
        "[users.quotas]\nconnections = 3\nservices = 10\n"
    )
    (alice,) = read_config(str(config)).tables.users
    assert alice.quotas == Quotas(connections=3, services=10)


def test_check_config_reports_a_bad_quota_with_its_line(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[[users]]\nname = "alice"\npublic_key = "{ALICE.public_key}"\n'  # 1-3
        "[users.quotas]\nconnections = 3\nservices = -5\n"  # 4-6
        f'[[users]]\nname = "bob"\npublic_key = "{ALICE.public_key}"\n'  # 7-9
        "quotas = { conections = 1 }\n"  # 10
    )
    result = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{config}:6: user 'alice': quotas.services is -5; it is 0 to {MAX_QUOTA}",
        f"{config}:10: user 'bob': unknown key quotas.conections (the keys are connections, "
        "services, memberships, requests, stream_bytes)",
    ]


# -- the usage table ------------------------------------------------------------------------


def register(hub: Hub, link: Link) -> bytes:
    return hub.routing.allocate_dynamic(server_name_bytes("svc"), link, link.session, link.epoch)


def usage_of(hub: Hub, quotas: Quotas) -> UsageTable:
    users = UserTable([User("alice", certificate="alice", quotas=quotas), User("bob", "bob")])
    return UsageTable(lambda: users, hub.routing)


def test_each_figure_is_summed_over_the_users_links_from_the_tables() -> None:
    hub = Hub()
    usage = usage_of(hub, Quotas(connections=2, services=3, memberships=1, requests=1))
    first, second, bobs = hub.connector("a1"), hub.connector("a2"), hub.connector("b")
    first.user = second.user = "alice"
    bobs.user = "bob"
    for link in (first, second, bobs):
        usage.link_opened(link)
    assert usage.used("alice", "connections") == 2
    assert usage.refusal("bob", "connections") == ""
    with pytest.raises(QuotaExceeded) as caught:
        usage.check(first.user, "connections")
    assert caught.value.args[0] == (
        "limit exceeded: user 'alice' already has 2 links open to this broker, and its quota "
        "is 2 (quotas.connections of its [[users]] entry in the broker's config); close one "
        "first"
    )
    one = register(hub, first)
    register(hub, second)
    register(hub, second)
    register(hub, bobs)
    assert usage.used("alice", "services") == 3
    assert "quotas.services" in usage.refusal("alice", "services")
    hub.routing.join(one, Multicast("g").to_bytes())
    assert usage.used("alice", "memberships") == 1
    hub.pending.add(one, 1, first, 10.0, one, tally=usage.tally_for_request("alice"))
    assert usage.used("alice", "requests") == 1
    assert "quotas.requests" in usage.refusal("alice", "requests")
    assert usage.tally_for_request("alice") is None, "at its quota"
    hub.pending.drop_link(first)  # as the broker does when the link closes
    usage.link_closed(first)
    assert usage.used("alice", "connections") == 1
    assert usage.used("alice", "services") == 2, "the closed link's services are not its"
    assert usage.used("alice", "requests") == 0


def test_stream_bytes_are_held_until_the_stream_is_deleted_by_anyone() -> None:
    hub = Hub()
    usage = usage_of(hub, Quotas(stream_bytes=100))
    link = hub.connector("a")
    link.user = "alice"
    usage.link_opened(link)
    usage.check(link.user, "stream_bytes", 100)
    usage.stream_added("alice", "s", 100)
    with pytest.raises(QuotaExceeded):
        usage.check(link.user, "stream_bytes", 1)
    usage.link_closed(link)
    assert usage.used("alice", "stream_bytes") == 100, "the stream outlives the link"
    usage.stream_deleted("s")
    assert usage.used("alice", "stream_bytes") == 0
    assert usage.refusal("bob", "stream_bytes", 1 << 40) == "", "bob has no stream quota"


def test_a_link_without_a_user_has_no_quota() -> None:
    hub = Hub()
    usage = usage_of(hub, Quotas(connections=0))
    link = hub.connector("anonymous")
    usage.link_opened(link)
    usage.check(link.user, "connections")
    assert usage.snapshot()["alice"]["connections"] == {"used": 0, "quota": 0}
    assert set(usage.snapshot()["bob"]) == set(QUOTA_KEYS)


def test_the_usage_table_needs_no_broker() -> None:
    """A plain class over a routing table and a pending table of any endpoints."""
    routing: RoutingTable[Endpoint] = RoutingTable(slot=1, is_remote=is_peer)
    users = UserTable([User("alice", certificate="alice")])
    usage = UsageTable(lambda: users, routing)
    assert usage.used("alice", "services") == 0
    assert usage.snapshot() == {
        "alice": {key: {"used": 0, "quota": getattr(Quotas(), key)} for key in QUOTA_KEYS}
    }
