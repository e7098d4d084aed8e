"""nats.js workers for `bench nats-clients --client nats.js`: the same two sides of each
scenario as bench/client.py's nats.py workers (receiver or responder, sender or
requester), each a Node.js process running tests/nats_js/bench.mjs with the nats.js the
tests pin (tests/nats_js/package-lock.json, installed by ``make nats-js``).

A worker process is started per scenario run -- Node starts in a few tens of
milliseconds, before the run's clock does -- and speaks a line protocol on its stdout:
``ready`` once it can take traffic, then ``done JSON`` with its figures. A responder
serves until its stdin is closed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from bench.client import Job
from bench.servers import BenchSetupError

# The tests' nats.js project: its package, and the worker script beside its test script.
NATS_JS_DIR = Path(__file__).resolve().parent.parent / "tests" / "nats_js"
_SCRIPT = NATS_JS_DIR / "bench.mjs"
# A worker that said ``done`` (or was told to stop) exits at once; this only bounds a bug.
_EXIT_TIMEOUT = 5.0


class _NodeWorker:
    """One bench.mjs process doing ``job``."""

    def __init__(self, node: str, job: Job) -> None:
        self._role = job.role
        self._process = subprocess.Popen(
            [
                node,
                str(_SCRIPT),
                job.role,
                job.host,
                str(job.port),
                str(job.count),
                str(job.size),
                str(job.concurrency),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def expect(self, what: str) -> dict[str, float]:
        """The next line, which must be ``what`` (its figures, for ``done``). The script
        bounds its own run (120 s), so a hung scenario ends this read with its exit."""
        assert self._process.stdout is not None
        word, _, rest = self._process.stdout.readline().partition(" ")
        if word.strip() != what:
            self._process.wait()
            assert self._process.stderr is not None
            raise BenchSetupError(
                f"a nats.js bench worker ({self._role}) did not say {what!r}: "
                f"exit status {self._process.returncode}\n{self._process.stderr.read()}"
            )
        figures: dict[str, float] = json.loads(rest) if rest else {}
        return figures

    def stop_serving(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()

    def close(self) -> None:
        """Ended and reaped: its stdin closed (a responder's cue), killed if it has not
        exited a moment later (a run that failed on the other side)."""
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        for pipe in (self._process.stdout, self._process.stderr):
            if pipe is not None:
                pipe.close()


class NodeWorkers:
    """Runs each scenario on two fresh nats.js processes (``bench.client.Workers`` does
    it on two nats.py ones)."""

    def __init__(self, node: str) -> None:
        self._node = node

    def run(self, serve: Job, drive: Job, *, stop_serving: bool) -> dict[str, float]:
        """``serve`` started and ready, then ``drive``: the figures of both (``stop_serving``:
        the serving side runs until told, after the driving side is done)."""
        with contextlib.ExitStack() as stack:
            serving = _NodeWorker(self._node, serve)
            stack.callback(serving.close)
            serving.expect("ready")
            driving = _NodeWorker(self._node, drive)
            stack.callback(driving.close)
            driving.expect("ready")
            driven = driving.expect("done")
            if stop_serving:
                serving.stop_serving()
            served = serving.expect("done")
        return {**served, **driven}


@contextlib.contextmanager
def node_workers() -> Iterator[NodeWorkers]:
    """NodeWorkers, once Node.js and the pinned nats.js are found."""
    node = shutil.which("node")
    if node is None:
        raise BenchSetupError(
            "node is not installed: `make nats-js` installs Node.js and nats.js "
            "(or run with --client nats.py)"
        )
    if not (NATS_JS_DIR / "node_modules" / "nats").is_dir():
        raise BenchSetupError(
            f"nats.js is not installed in {NATS_JS_DIR / 'node_modules'}: run `make nats-js`"
        )
    yield NodeWorkers(node)
