"""The meshbus broker daemon (``meshbus broker``).

The server is imported on first use, not with the package: a Spark worker reading a
broker's store file (``meshbus.storage.sqlite``) needs none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshbus.broker.run import serve
    from meshbus.broker.server import Broker, BrokerConfig

__all__ = ["Broker", "BrokerConfig", "serve"]


def __getattr__(name: str) -> Any:
    if name == "serve":
        from meshbus.broker import run

        return run.serve
    if name in __all__:
        from meshbus.broker import server

        return getattr(server, name)
    raise AttributeError(f"module 'meshbus.broker' has no attribute {name!r}")
