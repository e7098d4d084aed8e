"""`meshbus bench`: measured figures, optionally against nats-server in the same run.

The load drivers live in ``throughput`` (one producer -> one consumer, bytes
counted at the consumer) and ``latency`` (request/response with C in flight);
``wire`` adapts them to each system, ``servers`` starts what is measured.
"""
