"""Group names are matched exactly: a name with ``*`` or ``>`` (a wildcard subject in
NATS) would join only its literal self, so every verb that names a group to join or
leave refuses it, before anything is sent; exact names work. Subjects take wildcards
(``subscribe``), and a publish refuses them (a message has one subject)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from meshbus import InvalidArgument, Multicast
from meshbus.client.service import Service
from meshbus.testing import FakeNetwork, address_of, start_broker
from tests.unit.client.conftest import Connect

BROKER = address_of("a")

VERBS: dict[str, Callable[[Service, str], Awaitable[object]]] = {
    "join multicast": lambda s, name: s.join(f"multicast:{name}"),
    "join anycast": lambda s, name: s.join(f"anycast:{name}"),
    "join an Address": lambda s, name: s.join(Multicast(name)),
    "leave": lambda s, name: s.leave(f"multicast:{name}"),
}


@pytest.fixture
async def service(network: FakeNetwork, connect: Connect) -> Any:
    await start_broker(network, "a")
    return await (await connect(BROKER, "names")).register()


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("name", ["chat.*", "chat.>", "*", ">"])
async def test_wildcard_names_are_refused(service: Service, verb: str, name: str) -> None:
    with pytest.raises(InvalidArgument, match=r"matched exactly, '\*' and '>' are not wildcards"):
        await VERBS[verb](service, name)
    assert service.groups == frozenset()


async def test_exact_names_are_joined_and_wildcards_subscribed(service: Service) -> None:
    await service.join("multicast:chat.lobby")
    await service.subscribe(["chat.*", ">"])
    assert service.groups == {Multicast("chat.lobby")}
    assert service.subjects == {"chat.*", ">"}


@pytest.mark.parametrize("name", ["chat.*", "chat.>", "*", ">"])
async def test_a_publish_on_a_wildcard_is_refused(service: Service, name: str) -> None:
    with pytest.raises(InvalidArgument, match="without wildcards"):
        await service.publish(name, b"x")
