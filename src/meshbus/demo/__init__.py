"""``python -m meshbus.demo`` (``make demo``): the whole product in one command.

Three real brokers (each with a data dir and telemetry on; TLS, users and mesh trust
too, with a throwaway CA and keys made in the work dir: ``demo.secure``) carry a small MMO back
end (``demo.mmo``): a login pool answering anycast requests, game servers with a
service per player, chat rooms, a master doing interest management with
``subscribe_other``, and match results sent reliably into the durable stream
``results``. A Spark Structured Streaming job (``demo.leaderboard``) reads that
stream through the meshbus Spark source, keeps wins per player and publishes
leaderboard updates back to the bus, where the lobby services get them. In the
middle a broker is killed with kill -9 and a fourth one joins. At the end a
summary shows the traffic per cast type, lost and duplicated reliable messages
(which must be 0), the failover time and the top 5, and ``report.html`` is
written. The demo exits 0 only when all of that held, so it doubles as an
end-to-end test; every broker and Spark process is gone when it ends, Ctrl-C
included.
"""
