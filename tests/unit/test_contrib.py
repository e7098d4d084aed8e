"""contrib/: the sample production config is one the broker reads, and the systemd unit
runs a command that exists with flags that exist, agreeing with that config."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from meshbus.broker.config_file import read_config
from meshbus.cli.broker import broker

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "contrib" / "broker.toml"
UNIT = ROOT / "contrib" / "systemd" / "meshbus-broker.service"
INSTALLED_CONFIG = "/etc/meshbus/broker.toml"


def _unit() -> configparser.ConfigParser:
    # Strict: a key given twice in a section, or a section twice, is an error here (none
    # of this unit's keys may repeat); keys keep their case, and % is not interpolated.
    parser = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text(), str(UNIT))
    return parser


def test_the_sample_config_is_one_the_broker_reads() -> None:
    config = read_config(str(CONFIG))
    settings = config.settings
    assert settings["name"] == "a"
    assert {"tls_cert", "tls_key", "tls_ca", "broker_key", "data_dir"} <= set(settings)
    assert [b.name for b in config.tables.brokers] == ["a", "b", "c"]
    assert [u.name for u in config.tables.users] == ["game", "ops"]
    assert all(u.permissions is not None for u in config.tables.users)
    checked = CliRunner().invoke(broker, ["--check-config", str(CONFIG)])
    assert (checked.exit_code, checked.stdout) == (0, f"{CONFIG}: ok (2 users, 3 brokers)\n")


def test_the_unit_runs_the_broker_with_flags_it_has() -> None:
    unit = _unit()
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    flags = {opt for param in broker.params for opt in param.opts}
    for key in ("ExecStartPre", "ExecStart"):
        argv = shlex.split(service[key])
        assert Path(argv[0]).name == "meshbus", argv
        assert Path(argv[0]).is_absolute(), argv
        assert argv[1] == "broker", argv
        given = [arg for arg in argv[2:] if arg.startswith("--")]
        assert given, key
        assert set(given) <= flags, (key, given)
        assert argv[argv.index(given[0]) + 1] == INSTALLED_CONFIG
    assert shlex.split(service["ExecStartPre"])[2] == "--check-config"
    assert shlex.split(service["ExecStart"])[2] == "--config"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"  # reloads [[users]]
    assert f"install -o meshbus -m 0600 contrib/broker.toml {INSTALLED_CONFIG}" in UNIT.read_text()


def test_the_unit_and_the_sample_config_agree() -> None:
    service = _unit()["Service"]
    settings = read_config(str(CONFIG)).settings
    # The state directory systemd makes for the service is the broker's --data-dir.
    assert settings["data_dir"] == f"/var/lib/{service['StateDirectory']}"
    # systemctl stop waits out the drain, and more.
    assert float(service["TimeoutStopSec"]) > 2 * settings["drain_grace"]
    assert service["KillSignal"] == "SIGTERM"  # what drains a broker


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze on this machine")
    # verify insists that each command exists: this interpreter stands in for meshbus.
    argv0 = shlex.split(_unit()["Service"]["ExecStart"])[0]
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(argv0, sys.executable))
    verified = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert verified.returncode == 0, verified.stderr
    assert UNIT.name not in verified.stderr, verified.stderr  # no warning about the unit
