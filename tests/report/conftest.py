"""The report suite's fixtures: one local SparkSession, and rows built from JSON records.

The analysis tests build DataFrames in the ``meshbus`` data source's columns from
handcrafted telemetry and trace records (``stream_rows``), so their answers are known;
the end-to-end test reads real streams of real brokers (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="the spark extra is not installed")
pytest.importorskip("pyarrow", reason="the spark extra is not installed")
pytest.importorskip("matplotlib", reason="the spark extra is not installed")
if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
    pytest.skip("Spark needs Java (no java on PATH, no JAVA_HOME)", allow_module_level=True)

from pyspark.sql import DataFrame, SparkSession

import meshbus.spark
from meshbus.report.job import local_spark


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """The report's own local[2] session (``local_spark``, as ``meshbus report`` starts
    it; 6-10 s), for the whole run. ``meshbus report`` run in this process uses it too.
    Spark's log goes to a file, as the command's does."""
    log_path = tmp_path_factory.mktemp("spark") / "spark.log"
    with log_path.open("wb") as log, local_spark(log) as session:
        yield session


def stream_rows(spark: SparkSession, stream: str, records: Sequence[Any]) -> DataFrame:
    """``records`` as the data source would read them from ``stream``: one row each,
    the record as the JSON payload (a ``bytes`` record is used as the payload as is)."""
    rows = []
    for seq, record in enumerate(records, 1):
        payload = record if isinstance(record, bytes) else json.dumps(record).encode()
        at = record.get("at", 0.0) if isinstance(record, dict) else 0.0
        stored = datetime.fromtimestamp(at or 0.0, UTC).replace(tzinfo=None)
        rows.append((stream, seq, stored, "pub:65536", "multicast:t", None, 0, payload, None))
    return spark.createDataFrame(rows, meshbus.spark.SCHEMA)


def telemetry(broker: str, at: float, **fields: Any) -> dict[str, Any]:
    """A telemetry record: ``fields`` set counters (by counter name) or top-level keys;
    the rest are 0."""
    from meshbus.report.analysis import COUNTERS

    counters = {c: fields.pop(c, 0) for c in COUNTERS}
    record: dict[str, Any] = {
        "broker": broker,
        "at": at,
        "interval": 1.0,
        "connectors": 0,
        "services": 0,
        "routes": 0,
        "pending": 0,
        "counters": counters,
        "links": [],
    }
    record.update(fields)
    return record


def trace(
    src: str, msg_id: int, hop: str, broker: str, at: float, sent_at: float | None = None
) -> dict[str, Any]:
    return {
        "src": src,
        "msg_id": msg_id,
        "dst": "multicast:chat",
        "hop": hop,
        "broker": broker,
        "at": at,
        "sent_at": sent_at,
    }
