"""The client side: connector, services, messages."""

from meshbus.client.connector import Connector, Undeliverable, connect
from meshbus.client.service import Message, Service

__all__ = ["Connector", "Message", "Service", "Undeliverable", "connect"]
