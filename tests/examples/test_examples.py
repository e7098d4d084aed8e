"""Every program in examples/ runs against a real broker and prints what it says it
does: an example that rots fails here."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import BrokerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Each example's output, a regular expression per line.
EXPECTED = {
    "request_response.py": [
        r"sword: 120 gold \(from shop:[12]\)",
        r"shield: 80 gold \(from shop:[12]\)",
        r"potion: 5 gold \(from shop:[12]\)",
        r"no route: no route to anycast:nobody: .*",
    ],
    "pubsub.py": [r"p1: 150 points", r"p2: 150 points", r"p3: 150 points"],
    "game_shard.py": [
        r"login: \{'ok': True, 'token': 'ann'\}",
        r"players: 200, position updates sent: 6000, received: 6000",
        r"zone chat lines heard: [1-9]\d*",
    ],
    "reliable_groups.py": [
        *(rf"match-{m}: 20 events, in order: True, worker: workers:[12]" for m in range(4)),
        r"a lone reliable send: acknowledged",
    ],
    "durable_consumer.py": [
        r"stream orders on broker broker-\d+, 0 messages so far",
        *(rf"#{n + 1} \{{'order': {n}\}} from north, try 1" for n in range(5)),
        r"handled 5; pending now: 0",
    ],
}


def test_every_example_is_run_here_or_by_the_spark_suite() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([*EXPECTED, "spark_job.py"])
    # test_secure_mesh.py runs this one.
    files = sorted(p.name for p in (EXAMPLES / "secure_mesh").iterdir() if p.name != "__pycache__")
    assert files == ["client.py", "setup.sh"]


@pytest.mark.parametrize("example", EXPECTED)
async def test_an_example_prints_what_it_promises(broker: BrokerProcess, example: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / example),
        env={**os.environ, "MESHBUS_BROKER": broker.address},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert err == b"", err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == len(EXPECTED[example]), lines
    for line, pattern in zip(lines, EXPECTED[example], strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
