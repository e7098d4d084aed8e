"""``meshbus nats-server``: a broker that starts as nats-server does, so that a NATS
client's test harness can run it in nats-server's place (docs/nats.md, "In place of
nats-server").

It reads nats-server's command line as Go's flag package does (``-p 4222``, ``--port=4222``,
``-port 4222`` alike) for the flags a harness passes: ``-a``/``--addr``/``--net``,
``-p``/``--port`` (``-1``: any free port), ``-m``/``--http_port`` (/varz, /healthz on
the broker's monitor), ``-n``/``--name``, ``--user`` and ``--pass`` (one user, who may do
everything), ``--tls``, ``--tlscert``, ``--tlskey``, ``--tlscacert``, ``--tlsverify``,
``--ports_file_dir``; and takes the log flags (``-D``, ``-V``, ``-DV``, ``-T``, ``-l``)
without acting on them. Once the listener is up it writes nats-server's ready lines to
stderr -- ``Listening for client connections on HOST:PORT``, then ``Server is ready`` --
and, with ``--ports_file_dir``, the ports file nats-server writes
(``nats-server_<pid>.ports``). Anything else -- JetStream, clusters, a config file -- is
refused with a line saying so: a harness that needs them needs nats-server.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from meshbus.broker.config import BrokerConfig

# nats-server's flags (every spelling) and the name they are read as; None: a flag with
# no value that is taken and does nothing here (logging).
_VALUED = {
    "a": "addr", "addr": "addr", "net": "addr",
    "p": "port", "port": "port",
    "m": "http_port", "http_port": "http_port",
    "n": "name", "name": "name", "server_name": "name",
    "user": "user", "pass": "pass",
    "tlscert": "tlscert", "tlskey": "tlskey", "tlscacert": "tlscacert",
    "ports_file_dir": "ports_file_dir",
    "l": None, "log": None, "P": None, "pid": None,
}  # fmt: skip
_SWITCHES = {"tls": "tls", "tlsverify": "tlsverify"}
_IGNORED_SWITCHES = {"D", "V", "DV", "VV", "DVV", "T", "debug", "trace", "logtime", "s", "syslog"}


class NatsServerArgs:
    """nats-server's command line, as far as this shim reads it."""

    def __init__(self, args: list[str]) -> None:
        self.values: dict[str, str] = {}
        self.switches: set[str] = set()
        rest = list(args)
        while rest:
            arg = rest.pop(0)
            if not arg.startswith("-") or arg in ("-", "--"):
                raise click.UsageError(f"meshbus nats-server takes flags only, not {arg!r}")
            name, equals, value = arg.lstrip("-").partition("=")
            if name in _SWITCHES:
                self.switches.add(_SWITCHES[name])
            elif name in _IGNORED_SWITCHES:
                pass
            elif name in _VALUED:
                if not equals:
                    if not rest:
                        raise click.UsageError(f"flag {arg} needs a value")
                    value = rest.pop(0)
                key = _VALUED[name]
                if key is not None:
                    self.values[key] = value
            else:
                raise click.UsageError(
                    f"meshbus nats-server does not take {arg}: it starts a meshbus broker "
                    "with a NATS listener in nats-server's place (core NATS only; no "
                    "JetStream, clusters or config files). Use nats-server for those."
                )

    def port(self, key: str, default: int) -> int:
        text = self.values.get(key, str(default))
        try:
            port = int(text)
        except ValueError:
            raise click.UsageError(f"{key} is a port number, not {text!r}") from None
        if not -1 <= port <= 65535:
            raise click.UsageError(f"{key} {port} is not a port (0 to 65535, or -1 for any)")
        return max(port, 0)


@click.command(
    "nats-server",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def nats_server(args: tuple[str, ...]) -> None:
    """Run a broker in nats-server's place: nats-server's flags (-a, -p, -m, --user,
    --pass, --tls...) and its ready lines, for NATS client test harnesses."""
    import uvloop

    from meshbus.broker.run import START_ERRORS, serve

    parsed = NatsServerArgs(list(args))
    config = _config(parsed)

    def announce(broker_address: str, nats_address: str) -> None:
        _log(f"Listening for client connections on {nats_address}")
        if config.monitor:
            _log(f"Starting http monitor on {config.monitor}")
        ports_dir = parsed.values.get("ports_file_dir")
        if ports_dir:  # before the ready line, as nats-server writes it
            _write_ports(Path(ports_dir), nats_address, config.monitor, bool(config.tls_cert))
        _log("Server is ready")

    try:
        uvloop.run(serve(config, announce=announce))
    except OSError as exc:
        raise click.ClickException(str(exc)) from exc
    except START_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc


def _config(parsed: NatsServerArgs) -> BrokerConfig:
    from meshbus.auth import TokenKey, users_entry
    from meshbus.broker.config_file import config_from_text

    values = parsed.values
    host = values.get("addr", "0.0.0.0")
    port = parsed.port("port", 4222)
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "nats_listen": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        # nats-server listens wherever it is told; so does this, as it would.
        "allow_anonymous": True,
    }
    if "name" in values:
        settings["name"] = values["name"]
    if "http_port" in values:
        settings["monitor"] = f"{host}:{parsed.port('http_port', 8222)}"
    if "user" in values:
        user = values["user"]
        token_hash = str(TokenKey.of(user, values.get("pass", "")))
        entry = users_entry(user, token_hash=token_hash, allow_all=True)
        settings["users"] = config_from_text(entry, "--user").tables.users
    if "tls" in parsed.switches or "tlscert" in values:
        settings["tls_cert"] = values.get("tlscert", "")
        settings["tls_key"] = values.get("tlskey", "")
        settings["tls_ca"] = values.get("tlscacert", "")
        settings["tls_verify_clients"] = "tlsverify" in parsed.switches
        if not (settings["tls_cert"] and settings["tls_key"]):
            raise click.UsageError("--tls needs --tlscert and --tlskey")
    return BrokerConfig(**settings)


def _log(line: str) -> None:
    """One line as nats-server logs it: [PID] DATE TIME [INF] text."""
    now = time.time()
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now))
    micros = int(now % 1 * 1_000_000)
    sys.stderr.write(f"[{os.getpid()}] {stamp}.{micros:06d} [INF] {line}\n")
    sys.stderr.flush()


def _write_ports(directory: Path, nats: str, monitor: str, tls: bool) -> None:
    """nats-server's ports file: where a harness that started it on -p -1 finds its ports."""
    scheme = "tls" if tls else "nats"
    ports: dict[str, list[str]] = {"nats": [f"{scheme}://{nats}"]}
    if monitor:
        ports["monitoring"] = [f"http://{monitor}"]
    path = directory / f"nats-server_{os.getpid()}.ports"
    path.write_text(json.dumps(ports))
