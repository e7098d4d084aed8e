"""Durable streams on a broker: ``host`` (the streams hosted here, their capture and
group commit, and the replicated streams' wiring), ``requests`` (the STREAM requests)
and ``upkeep`` (the store's housekeeping off the appends' path)."""
