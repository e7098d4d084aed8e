"""The meshbus broker daemon (``meshbus broker``)."""

from meshbus.broker.server import Broker, BrokerConfig, serve

__all__ = ["Broker", "BrokerConfig", "serve"]
