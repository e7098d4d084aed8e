"""The handlers of control frames, registered in the core's dispatch table."""
