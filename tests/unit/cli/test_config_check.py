"""The broker's config file checked: ``meshbus broker --check-config`` lists every error
with its line, and the key paths of errors find their lines (meshbus.broker.config_lines)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from meshbus.auth import Credentials, TokenKey, users_entry
from meshbus.broker.config_file import BadConfig, read_config, reread_users
from meshbus.broker.config_lines import KeyLines
from meshbus.cli.broker import broker

TEXT = """\
listen = "127.0.0.1:0"   # line 1
# a comment
[[users]]
name = "game"
public_key = "ed25519:..."
[users.permissions]
send = { allow = ["*"], deny = ["login:*"] }

[[users]]
name = "ops"
permissions.operator = ["stat"]
[users.permissions.streams]
read = [
    "scores.*",
]

[[brokers]]
name = "a"
"""


@pytest.mark.parametrize(
    ("key", "line"),
    [
        ("listen", 1),
        ("users[1]", 3),
        ("users[1].public_key", 5),
        ("users[1].permissions", 6),
        ("users[1].permissions.send", 7),
        ("users[1].permissions.send.deny", 7),  # inside an inline table: its key's line
        ("users[2]", 9),
        ("users[2].name", 10),
        ("users[2].permissions.operator", 11),  # a dotted key
        ("users[2].permissions.streams.read", 13),
        ("users[2].permissions.register", 9),  # not in the file: the nearest around it
        ("brokers", 17),
        ("brokers[1].public_key", 17),
        ("users[3]", 3),  # no third [[users]]: the first line of users
        ("nothing.at.all", 1),
    ],
)
def test_a_key_path_finds_its_line(key: str, line: int) -> None:
    assert KeyLines(TEXT).line_of(key) == line


def test_check_config_reports_every_error_with_its_line(tmp_path: Path) -> None:
    alice = Credentials.generate("alice")
    config = tmp_path / "broker.toml"
    config.write_text(
        'listen = "127.0.0.1:0"\n'  # 1
        "max-conectors = 7\n"  # 2: an unknown key
        'max-connectors = "many"\n'  # 3: a bad flag value
        f'[[users]]\nname = "alice"\npublic_key = "{alice.public_key}"\n'  # 4-6
        '[users.permissions]\nsend = ["*"]\njoin = ["game01:1"]\n'  # 7-9: not a group
        '[[users]]\nname = "bob"\npublic_key = "ed25519:AAAA"\n'  # 10-12: a bad key
    )
    result = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{config}:2: unknown key 'max-conectors' (did you mean 'max-connectors'?); the keys "
        "are the broker's long flag names (see meshbus broker --help), [[users]] and "
        "[[brokers]]",
        f"{config}:3: max-connectors = 'many': 'many' is not a valid integer range.",
        f"{config}:9: user 'alice': permissions.join pattern 'game01:1': only multicast "
        "and anycast addresses are groups",
        f"{config}:12: user 'bob': an Ed25519 key is 32 bytes; this one is 3",
    ]


def test_every_bad_user_is_reported_not_just_the_first(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        '[[users]]\nname = "a"\n'  # 1-2: no credential
        f'[[users]]\nname = "b"\ntoken_hash = "{TokenKey(bytes(32))}"\n'  # 3-5: fine
        "[users.permissions]\n"  # 6
        'join = ["multicast:chat"]\n'  # 7
        'request = ["nope"]\n'  # 8: not an address
        '[[users]]\nname = "c"\ncertificate = "c"\n'  # 9-11: fine
        '[[users]]\nname = "c"\ncertificate = "c2"\n'  # 12-14: a second "c"
    )
    with pytest.raises(BadConfig) as caught:
        read_config(str(config))
    assert [line for line, _ in caught.value.errors] == [1, 8, 13]
    assert "user 'a' needs exactly one of public_key" in str(caught.value)
    assert "permissions.request pattern 'nope'" in str(caught.value)
    assert "two users are named 'c'" in str(caught.value)


def test_a_good_file_is_ok(tmp_path: Path) -> None:
    alice = Credentials.generate("alice")
    config = tmp_path / "broker.toml"
    config.write_text("max-connectors = 7\n" + users_entry("alice", public_key=alice.public_key))
    result = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert (result.exit_code, result.stdout) == (0, f"{config}: ok (1 users, 0 brokers)\n")


def test_a_syntax_error_has_its_line_and_a_missing_file_its_reason(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text('listen = "127.0.0.1:0"\n\nmax-connectors = \n')
    result = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"{config}:3: is not valid TOML: ")
    result = CliRunner().invoke(broker, ["--check-config", str(tmp_path / "none.toml")])
    assert result.exit_code == 1
    assert "none.toml: cannot read it: No such file or directory" in result.stderr


def test_a_reload_refuses_changed_brokers(tmp_path: Path) -> None:
    """The mesh's brokers are read at start only: a reload of a file whose [[brokers]]
    changed is refused whole, users included."""
    a, b = Credentials.generate("a"), Credentials.generate("b")
    config = tmp_path / "broker.toml"
    config.write_text(f'[[brokers]]\nname = "a"\npublic_key = "{a.public_key}"\n')
    started = read_config(str(config)).tables
    assert list(reread_users(str(config), started.brokers)) == []
    config.write_text(
        users_entry("alice", public_key=b.public_key)
        + f'[[brokers]]\nname = "b"\npublic_key = "{b.public_key}"\n'
    )
    with pytest.raises(BadConfig, match=r"broker\.toml:11: \[\[brokers\]\] changed"):
        reread_users(str(config), started.brokers)
