"""Durable streams at rest: the store interface, its in-memory and SQLite stores, the
on-disk blocks and their checks, offline salvage, and the stores' errors.

Knows nothing of brokers or links: a broker hosts streams on a store, and the Spark
source and ``meshbus stream salvage`` open a store file directly.
"""
