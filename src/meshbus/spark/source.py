"""The ``meshbus`` data source: what Spark instantiates, and where each check runs.

Spark calls the methods below on the driver, each in a Python worker of its own:

* ``schema()`` at ``load()`` of a read (never for a write): the read options are
  checked and the stream is looked up here, so a wrong option, a missing stream or
  an unreachable mesh fails ``load()`` itself -- before a streaming query starts.
* ``reader()`` when a batch read is planned: the stream's range is fixed here.
* ``streamReader()`` at the start of a streaming query (and again to plan its
  tasks): no I/O, the offsets calls do it.
* ``writer()`` at ``save()``; ``streamWriter()`` when the first micro-batch runs,
  and again before each micro-batch's commit: the DataFrame's columns and the
  options are checked and the mesh is pinged (a ~3 ms round trip).
"""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from meshbus.spark import bus
from meshbus.spark.options import option_error, parse_read, parse_write
from meshbus.spark.reader import SCHEMA, BatchReader, StreamReader
from meshbus.spark.writer import BatchWriter, StreamWriter


class MeshbusDataSource(DataSource):
    """``spark.read/readStream/write/writeStream.format("meshbus")``; see docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "meshbus"

    def schema(self) -> StructType:
        # Only load() asks, so this is a read; whether a batch or a streaming one is not
        # known yet: check what both accept, the rest when the reader is made.
        options = parse_read(self.options, streaming=None)
        bus.stream_info(options.bus, options.stream)
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(parse_read(self.options, streaming=False), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(parse_read(self.options, streaming=True), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise option_error("messages sent cannot be overwritten; write with mode('append')")
        return BatchWriter(parse_write(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return StreamWriter(parse_write(self.options), schema)
