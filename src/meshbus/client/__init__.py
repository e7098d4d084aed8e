"""The client side: connector, services, messages."""

from meshbus.client.connector import Connector, connect
from meshbus.client.service import Message, Service

__all__ = ["Connector", "Message", "Service", "connect"]
