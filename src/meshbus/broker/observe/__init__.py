"""Watching a broker from outside, changing nothing: stat, telemetry, monitoring over
HTTP, and the event loop's lag."""
