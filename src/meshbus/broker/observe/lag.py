"""How late the event loop runs: the one number that says whether a broker stalls.

Everything a broker does runs on one event loop; while one callback runs, no frame
is read, no heartbeat sent. A timer asks to wake every ``interval`` seconds and
records how much later than asked it woke: that is the loop's lag, the longest
any callback (a burst of frames, a big table change, a store operation) kept the
loop. ``meshbus stat`` shows the maximum and the 99th percentile since the
broker started; the goal is a maximum under 50 ms (docs/architecture.md §4.4).

The samples go into fixed buckets, so the memory is constant and a percentile is
the upper bound of the bucket it falls in.

Lateness is wall-clock time, and a broker that shares its cores with busier
processes wakes late without having stalled at all. So each sample also takes the
CPU time the loop's thread used since it went to sleep: the lateness that CPU time
can explain is the broker's own doing (a long callback); the rest was time spent
waiting for a core. ``max_own`` is the largest such own lateness: the figure that
says whether the broker's code keeps its loop, where ``max`` says what its peers saw.
"""

from __future__ import annotations

import bisect

# Bucket upper bounds in milliseconds; the last bucket takes everything above.
BOUNDS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000)


class LoopLag:
    def __init__(self) -> None:
        self.max_ms = 0.0
        self.max_own_ms = 0.0
        self.samples = 0
        self.sum_ms = 0.0  # of every sample: the histogram's sum (broker/observe/monitor.py)
        self._counts = [0] * (len(BOUNDS_MS) + 1)

    def record(self, lag_s: float, busy_s: float) -> None:
        """One wake-up ``lag_s`` late, the loop's thread having used ``busy_s`` of CPU
        since it went to sleep."""
        ms = max(0.0, lag_s * 1000)
        self.max_ms = max(self.max_ms, ms)
        self.max_own_ms = max(self.max_own_ms, min(ms, busy_s * 1000))
        self.samples += 1
        self.sum_ms += ms
        self._counts[bisect.bisect_left(BOUNDS_MS, ms)] += 1

    def percentile(self, fraction: float) -> float:
        """The upper bound (ms) of the bucket holding the ``fraction`` quantile; the
        maximum itself for the last bucket, and 0 with no sample."""
        if not self.samples:
            return 0.0
        rank = fraction * self.samples
        seen = 0
        for i, count in enumerate(self._counts):
            seen += count
            if seen >= rank and count:
                return float(BOUNDS_MS[i]) if i < len(BOUNDS_MS) else self.max_ms
        return self.max_ms

    def counts(self) -> list[int]:
        """The samples in each bucket of ``BOUNDS_MS``, then those above the last bound."""
        return list(self._counts)

    def snapshot(self) -> dict[str, float]:
        return {
            "max": round(self.max_ms, 3),
            "max_own": round(self.max_own_ms, 3),
            "p99": self.percentile(0.99),
            "samples": self.samples,
        }
