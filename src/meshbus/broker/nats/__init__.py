"""NATS clients of any language on the broker (``--nats-listen``; docs/nats.md): the
listener, each client's connection, and where a published message goes."""
