"""The handlers of control frames, registered in the core's dispatch table: admission
(the handshake and sign-in), services (register, join), operator (stat, drain, ping,
bye), guarantees (members, message groups)."""
