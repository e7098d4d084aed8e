"""`meshbus bench`: measured figures, optionally against nats-server in the same run.

The commands: ``cli`` (the group; unicast, request, tables), ``traffic`` (cross,
fanout: traffic across brokers), ``membership`` (failover, join) and ``routes``.

The load drivers live in ``throughput`` (one producer -> one consumer, bytes
counted at the consumer) and ``latency`` (request/response with C in flight);
``wire`` adapts them to each system. What is measured is started by ``servers``
(one meshbus broker, one nats-server), ``cluster`` (a meshbus mesh, a nats-server
cluster) and ``brokers`` (meshbus broker processes, the one place a mesh is
started). ``runs`` alternates the systems of a --vs-nats run, ``harness`` holds
the connectors and probes of the mesh-operation commands, ``report`` the tables
and last lines.
"""
