"""``meshbus report``: the brokers' telemetry and traces, analysed with Spark (docs/report.md).

* ``analysis``: the numbers, as pure functions on Spark DataFrames;
* ``job``: finding the streams, the local SparkSession, reading and collecting;
* ``plots`` and ``render``: the matplotlib plots, and the self-contained HTML page;
* ``cli``: the ``report`` click command.

Needs the ``spark`` extra (pyspark, pyarrow, matplotlib) and Java. Importing this
package, ``cli`` or ``job`` imports none of them (``meshbus --help`` must work
without them); ``analysis``, ``plots`` and ``render`` do.
"""

# The streams a broker writes with --telemetry-interval: PREFIX + its (sanitised) name.
TELEMETRY_PREFIX = "telemetry."
TRACES_PREFIX = "traces."
