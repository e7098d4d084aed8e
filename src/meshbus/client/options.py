"""The keyword options of the sending verbs, named once for the verbs that pass them on
(``Connector.send``/``publish``/``request`` to the service they send from)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict


class PublishOptions(TypedDict, total=False):
    """``Service.publish``'s options."""

    json: object
    headers: Mapping[str, str] | None
    priority: int
    reliable: bool
    echo: bool


class SendOptions(PublishOptions, total=False):
    """``Service.send``'s options."""

    notify: bool
    group: str | bytes | None
    final: bool
    publish_id: bytes
    timeout: float | None


class RequestOptions(TypedDict, total=False):
    """``Service.request``'s options."""

    json: object
    headers: Mapping[str, str] | None
    timeout: float
