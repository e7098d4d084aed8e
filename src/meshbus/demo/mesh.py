"""The demo's brokers: real ``meshbus broker`` processes, each with its own data dir,
telemetry, TLS and users on (demo.secure), that are always gone when the demo ends --
also on Ctrl-C or a crash."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass

from meshbus.broker.process import BrokerStartError, spawn_broker
from meshbus.demo.secure import DemoSecurity

STARTUP_TIMEOUT = 20.0
TELEMETRY_INTERVAL = 1.0
TRACE_SAMPLE = 0.02


class StepFailed(Exception):
    """A demo step did not behave as described."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise StepFailed(what)


@dataclass
class DemoBroker:
    process: asyncio.subprocess.Process
    name: str
    address: str


class DemoMesh:
    """The brokers the demo started, by name."""

    def __init__(self, data_root: str, security: DemoSecurity) -> None:
        self.data_root = data_root
        self.security = security
        self.brokers: dict[str, DemoBroker] = {}

    @property
    def addresses(self) -> str:
        """Every running broker, as ``meshbus.connect`` takes them (for failover)."""
        return ",".join(b.address for b in self.brokers.values() if b.process.returncode is None)

    async def start(self, name: str, seed: DemoBroker | None = None) -> DemoBroker:
        """A broker that joins through ``seed`` (or founds the mesh); ready once joined."""
        args = [
            *self.security.broker_args(name),
            "--data-dir", os.path.join(self.data_root, name),
            "--telemetry-interval", str(TELEMETRY_INTERVAL),
            "--trace-sample", str(TRACE_SAMPLE),
        ]  # fmt: skip
        if seed is not None:
            args += ["--seed", seed.address]
        try:
            process, _, address, _ = await spawn_broker(*args, timeout=STARTUP_TIMEOUT)
        except BrokerStartError as exc:
            raise StepFailed(str(exc)) from exc
        broker = self.brokers[name] = DemoBroker(process, name, address)
        return broker

    def kill(self, name: str) -> None:
        """kill -9: no goodbye to anyone."""
        self.brokers[name].process.kill()

    async def stop(self) -> dict[str, int]:
        """SIGTERM every broker still running (they drain), SIGKILL what does not stop."""
        return dict(
            zip(
                self.brokers,
                await asyncio.gather(*(_stop(b.process) for b in self.brokers.values())),
                strict=True,
            )
        )

    def kill_all(self) -> None:
        """The last resort on the way out (Ctrl-C during a step): nothing left behind."""
        for broker in self.brokers.values():
            if broker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    broker.process.kill()


async def _stop(process: asyncio.subprocess.Process) -> int:
    if process.returncode is not None:
        return process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(process.wait(), 15)
    except TimeoutError:
        process.kill()
        return await process.wait()
