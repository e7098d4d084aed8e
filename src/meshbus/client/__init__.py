"""The client side: connector, services, messages."""

from meshbus.client.connecting import connect
from meshbus.client.connector import Connector
from meshbus.client.inbound import Undeliverable
from meshbus.client.message import Message
from meshbus.client.service import Service

__all__ = ["Connector", "Message", "Service", "Undeliverable", "connect"]
