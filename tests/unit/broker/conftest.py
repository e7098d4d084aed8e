"""Every test here runs on a SimLoop (fake time, no I/O: see fakes.py) with ``random``
seeded, so each run takes the same course."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator, Mapping

import pytest

from tests.unit.broker.fakes import FakeClock, FakeNetwork, SimLoop, running_sim_loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"sim": SimLoop}


@pytest.fixture(autouse=True)
def seeded_random() -> Iterator[None]:
    """The broker's own random choices (claim back-off, anycast picks) the same each run."""
    state = random.getstate()
    random.seed(20240601)
    yield
    random.setstate(state)


@pytest.fixture
async def clock() -> FakeClock:
    return running_sim_loop().clock


@pytest.fixture
async def network() -> FakeNetwork:
    return FakeNetwork()
