"""``meshbus broker``'s flags, made from the settings' declarations (meshbus.broker.config):
the same flags as before they were, the config built from them, a bad value refused alike
as a flag and in a config file, the table of docs/operations.md, and the CLI reaching the
broker through its config, run and process modules only."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import meshbus.broker.run
from meshbus.broker.config import (
    BrokerConfig,
    Fsync,
    PartitionHandling,
    StartSettings,
    settings_table,
)
from meshbus.cli.broker import broker

ROOT = Path(__file__).parents[3]

# `meshbus broker --help` before its flags were made from the declarations: the same set.
FLAGS = {
    "--config",
    "--check-config",
    "--listen",
    "--seed",
    "--advertise",
    "--name",
    "--max-connectors",
    "--capacity-boost",
    "--boost-window",
    "--heartbeat-interval",
    "--heartbeat-misses",
    "--peer-forget",
    "--partition-handling",
    "--drain-grace",
    "--join-timeout",
    "--data-dir",
    "--fsync",
    "--max-streams",
    "--max-stream-bytes",
    "--max-store-bytes",
    "--group-expiry",
    "--group-grace",
    "--telemetry-interval",
    "--trace-sample",
    "--max-frame",
    "--max-pending-bytes",
    "--max-services",
    "--max-groups-per-service",
    "--max-groups",
    "--raft-tick",
    "--replace-after",
    "--zone",
    "--meta-voter",
    "--raft-compact-entries",
    "--raft-compact-bytes",
    "--max-requests",
    "--max-request-timeout",
    "--max-handshaking",
    "--max-handshaking-per-source",
    "--handshake-timeout",
    "--max-operators",
    "--allow-anonymous",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--tls-verify-clients",
    "--allow-insecure-key-files",
    "--broker-key",
    "--monitor",
    "--monitor-token-hash",
    "--nats-listen",
    "--nats-advertise",
    "--nats-max-payload",
    "--nats-max-control-line",
    "--nats-ping-interval",
    "--nats-max-pings-out",
    "--max-subjects",
}


def test_the_flags_are_the_same_as_before() -> None:
    flags = [flag for param in broker.params for flag in param.opts]
    assert len(flags) == len(set(flags))
    assert set(flags) == FLAGS


@pytest.mark.parametrize(
    ("flag", "shown"),
    [
        ("--listen HOST:PORT", "[default: 127.0.0.1:7400]"),
        ("--seed HOST:PORT", ""),
        ("--max-connectors INTEGER RANGE", "[default: 50; x>=1]"),
        ("--join-timeout FLOAT RANGE", "[default: 30.0; x>0]"),
        ("--trace-sample FLOAT RANGE", "[default: 0.001; 0<=x<=1]"),
        ("--partition-handling [ignore|pause-minority]", "[default: ignore]"),
        ("--data-dir DIRECTORY", ""),
        ("--tls-cert FILE", ""),
        ("--monitor TEXT", ""),
        ("--allow-anonymous", ""),
    ],
)
def test_the_help_shows_each_flag_as_before(flag: str, shown: str) -> None:
    """A sample of --help's entries, as they were: the metavar, the default and the range."""
    ctx = click.Context(broker)
    records = [param.get_help_record(ctx) for param in broker.params]
    (help_text,) = [record[1] for record in records if record and record[0] == flag]
    assert help_text.endswith(f"  {shown}") if shown else "[default:" not in help_text


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[BrokerConfig]:
    """The configs ``meshbus broker`` would serve: none is served."""
    configs: list[BrokerConfig] = []

    async def serve(config: BrokerConfig, reread: Any) -> None:
        configs.append(config)

    monkeypatch.setattr(meshbus.broker.run, "serve", serve)
    return configs


def run_broker(configs: list[BrokerConfig], *args: str) -> BrokerConfig:
    result = CliRunner().invoke(broker, list(args))
    assert result.exit_code == 0, result.output
    return configs.pop()


def test_no_flags_is_the_declared_defaults(served: list[BrokerConfig]) -> None:
    config, default = run_broker(served), BrokerConfig()
    for each in fields(BrokerConfig):
        if each.name not in ("users", "brokers"):  # tables, equal only to themselves
            assert getattr(config, each.name) == getattr(default, each.name), each.name
    assert not config.users
    assert not config.brokers


def test_the_flags_and_a_config_file_build_the_config(
    served: list[BrokerConfig], tmp_path: Path
) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(
        'partition-handling = "pause-minority"\nmax-connectors = 7\nseed = "127.0.0.1:1"\n'
        'fsync = "always"\nmonitor = ":9100"\nallow-anonymous = true\nlisten = "[::1]:0"\n'
        'nats-listen = "127.0.0.1:4222"\nnats-max-payload = 4096\n'
    )
    config = run_broker(served, "--config", str(path), "--max-connectors", "8", "--fsync", "normal")
    assert config.partition_handling is PartitionHandling.PAUSE_MINORITY
    assert config.fsync is Fsync.NORMAL  # the flag wins
    assert config.max_connectors == 8
    assert config.seeds == ["127.0.0.1:1"]
    assert config.monitor == "127.0.0.1:9100"
    assert config.allow_anonymous
    assert (config.host, config.port) == ("::1", 0)
    assert (config.nats_listen, config.nats_max_payload) == ("127.0.0.1:4222", 4096)
    flags = run_broker(
        served, "--seed", "a:1", "--seed", "b:2", "--name", "x", "--advertise", "c:3"
    )
    assert (flags.seeds, flags.name, flags.advertise) == (["a:1", "b:2"], "x", "c:3")


# A bad value of each kind, as a flag's text: each refused with the same words as a flag
# and as a config file's key (meshbus.broker.settings uses click's).
BAD = [
    ("max-connectors", "many"),
    ("max-connectors", "0"),
    ("max-stream-bytes", str(2**62 + 1)),
    ("capacity-boost", "0.99"),
    ("join-timeout", "0"),
    ("trace-sample", "1.5"),
    ("max-frame", "255"),
    ("partition-handling", "pause_minority"),
    ("fsync", "sometimes"),
    ("listen", "nohost"),
    ("seed", "nohost"),
    ("advertise", "[::1]"),
    ("monitor", "nohost"),
    ("monitor-token-hash", "nope"),
    ("nats-listen", "nohost"),
    ("nats-max-payload", str(64 * 1024 * 1024 + 1)),
    ("nats-ping-interval", "0"),
    ("tls-cert", "{tmp}"),
    ("data-dir", "{tmp}/file"),
]


@pytest.mark.parametrize(("key", "value"), BAD)
def test_a_bad_value_is_refused_alike_as_a_flag_and_in_a_config_file(
    key: str, value: str, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    value = value.format(tmp=tmp_path)
    flag = CliRunner().invoke(broker, [f"--{key}", value])
    assert flag.exit_code == 2
    said = re.search(rf"Error: Invalid value for '--{key}': (.+)", flag.stderr.replace("\n", " "))
    assert said is not None, flag.stderr
    reason = said[1].strip()
    config = tmp_path / "broker.toml"
    config.write_text(f"{key} = {value!r}\n".replace("'", '"'))
    checked = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert checked.exit_code == 1
    assert checked.stderr == f"{config}:1: {key} = {value!r}: {reason}\n"


def test_a_misspelt_choice_names_the_setting_and_its_choices(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text('listen = "127.0.0.1:0"\npartition-handling = "pause_minority"\n')
    checked = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert checked.stderr == (
        f"{config}:2: partition-handling = 'pause_minority': 'pause_minority' is not one of "
        "'ignore', 'pause-minority'.\n"
    )
    started = CliRunner().invoke(broker, ["--config", str(config)])
    assert started.exit_code == 2
    assert "is not one of 'ignore', 'pause-minority'" in started.stderr


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("allow-anonymous = 'maybe'", "allow-anonymous = 'maybe': 'maybe' is not a valid boolean"),
        ("seed = [['a:1']]", "seed is a list of values, as --seed takes"),
        ("max-connectors = [1, 2]", "max-connectors is a string or a number"),
        ("max-connectors = 7.0", "max-connectors = 7.0: '7.0' is not a valid integer range."),
    ],
)
def test_a_config_value_is_read_as_its_flags_text(tmp_path: Path, line: str, says: str) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(line + "\n")
    checked = CliRunner().invoke(broker, ["--check-config", str(config)])
    assert checked.exit_code == 1
    assert checked.stderr.startswith(f"{config}:1: {says}")


def test_a_config_file_takes_a_flags_text_too(served: list[BrokerConfig], tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text('max-connectors = "7"\ncapacity-boost = 2\nallow-anonymous = "yes"\n')
    built = run_broker(served, "--config", str(config))
    assert (built.max_connectors, built.capacity_boost, built.allow_anonymous) == (7, 2.0, True)


def test_the_docs_table_is_the_declarations() -> None:
    """docs/operations.md's table of settings is made from the declarations; when they
    change, paste the table this test shows there."""
    text = (ROOT / "docs" / "operations.md").read_text()
    found = re.search(r"<!-- settings table -->\n(.*?)<!-- end of settings table -->", text, re.S)
    assert found is not None, "docs/operations.md has lost its table of settings"
    table = settings_table(StartSettings, BrokerConfig)
    assert found[1] == table, f"docs/operations.md's table of settings should be:\n{table}"


def test_broker_key_help_says_when_it_is_required(
    served: list[BrokerConfig], tmp_path: Path
) -> None:
    """--help says what the command does: a broker with [[users]] and no [[brokers]]
    starts without a key; one with [[brokers]] is refused without one."""
    helped = CliRunner().invoke(broker, ["--help"], terminal_width=1000)
    said = re.search(r"--broker-key FILE\s+(.+)", helped.stdout)
    assert said is not None, helped.stdout
    assert "Required when the config lists [[brokers]]" in said[1]
    assert "[[users]] and no [[brokers]] needs none" in said[1]
    from meshbus.auth import Credentials, brokers_entry, users_entry

    alice = Credentials.generate("alice")
    users = tmp_path / "users.toml"
    users.write_text(users_entry("alice", public_key=alice.public_key))
    users.chmod(0o600)
    assert run_broker(served, "--config", str(users)).broker_key is None
    b1 = Credentials.generate("b1")
    assert b1.public_key is not None
    mesh = tmp_path / "mesh.toml"
    mesh.write_text(users.read_text() + brokers_entry("b1", b1.public_key))
    mesh.chmod(0o600)
    refused = CliRunner().invoke(broker, ["--config", str(mesh), "--name", "b1"])
    assert refused.exit_code == 2
    assert "give it --name and --broker-key FILE" in refused.stderr
