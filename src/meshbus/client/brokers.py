"""Which brokers a connector may link to: the address list ``meshbus.connect`` takes,
its defaults, and the environment variables that stand in for arguments.

Apart from the connector, so the CLI can parse its options without importing the
client (a broker process, ``meshbus broker``, starts faster without it).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshbus.errors import InvalidArgument
from meshbus.util import hostport_text, parse_hostport

DEFAULT_PORT = 7400
DEFAULT_BROKER = f"127.0.0.1:{DEFAULT_PORT}"
# The client's configuration from the environment; an argument given wins.
BROKER_ENV = "MESHBUS_BROKER"
TLS_CA_ENV = "MESHBUS_TLS_CA"


def broker_list(brokers: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list of ``HOST:PORT``, each as ``HOST:PORT`` (a bare ``HOST``
    means port 7400); InvalidArgument names a bad entry."""
    items = brokers.split(",") if isinstance(brokers, str) else list(brokers)
    addresses = [item.strip() for item in items if item.strip()]
    if not addresses:
        raise InvalidArgument("no broker address given; expected HOST:PORT[,HOST:PORT...]")
    try:
        return [
            hostport_text(*parse_hostport(item, default_port=DEFAULT_PORT)) for item in addresses
        ]
    except ValueError as exc:
        raise InvalidArgument(f"broker address {exc}") from exc
