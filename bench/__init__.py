"""`python -m bench`: measured figures, optionally against nats-server in the same run.

The benchmark rig of a meshbus checkout, run from the repository root with
``.venv/bin/python -m bench COMMAND``; it is not part of the installed ``meshbus``
package (setuptools packages only what is under ``src/``).

The commands: ``cli`` (the group; unicast, request, tables; ``__main__`` runs it),
``traffic`` (cross, fanout: traffic across brokers), ``membership`` (failover, join),
``handshake`` (connect time with and without a sign-in), ``routes``, ``reliable`` and
``chaos`` (exactly-once sends and message groups while the mesh is shaken),
``streams`` (durable stream appends and reads against NATS JetStream, whose raw driver
is ``jetstream``; with --replicas 3, ``replicated``: a stream of three replicas against
JetStream R3, and the leader's failover) and ``spark`` (Spark reading and writing the bus
against Parquet).

The load drivers live in ``throughput`` (one producer -> one consumer, bytes
counted at the consumer) and ``latency`` (request/response with C in flight);
``wire`` adapts them to each system. What is measured is started by ``servers``
(one meshbus broker, one nats-server), ``cluster`` (a meshbus mesh, a nats-server
cluster) and ``brokers`` (meshbus broker processes, the one place a mesh is
started). ``security`` makes the users, broker keys and certificates of --auth and --tls,
``runs`` alternates the systems of a --vs-nats run, ``harness`` holds
the connectors and probes of the mesh-operation commands, ``report`` the tables
and last lines, and ``tables`` times the broker's routing and pending tables in
process.
"""
