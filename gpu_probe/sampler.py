"""`GpuSampler`: reads every GPU every `interval_s`, keeps the latest snapshot, feeds the gauges.

Lifecycle: `await start()` initialises NVML (off the loop), takes a first sample and starts one
background task; `await aclose()` stops it and shuts NVML down. Without a GPU, `start()`
succeeds, `latest.no_gpu_reason` says why and no task runs. A failed sample is logged once per
distinct error and leaves the previous snapshot in place, whose `taken_at_s` then ages (stale
readings are the consumer's to judge). Clock and sleep are injected for simulated-time tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from gpu_probe.metrics import GpuGauges
from gpu_probe.nvml import NvmlApi, describe_nvml_error, to_text
from gpu_probe.probe import open_nvml, read_devices, read_readings
from gpu_probe.readings import GpuDevice, GpuSnapshot

__all__ = ["GpuSampler"]

log = logging.getLogger(__name__)


class GpuSampler:
    """Periodic NVML sampler; one per process, built by whoever builds the app."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        nvml: NvmlApi | None = None,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._nvml_arg = nvml
        self._gauges = GpuGauges(registry)
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._api: NvmlApi | None = None
        self._devices: tuple[GpuDevice, ...] = ()
        self._driver_version: str | None = None
        self._latest: GpuSnapshot | None = None
        self._last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._state = "new"  # new -> started -> closed
        self._nvml_lock = threading.Lock()  # NVML calls and shutdown never overlap

    @property
    def latest(self) -> GpuSnapshot | None:
        """The most recent successful snapshot (or the no-GPU answer); None before start()."""
        return self._latest

    @property
    def devices(self) -> tuple[GpuDevice, ...]:
        return self._devices

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Initialise NVML and take the first sample; without a GPU, record why and return."""
        if self._state != "new":
            raise RuntimeError(f"GpuSampler.start() on a {self._state} sampler")
        self._state = "started"
        api, reason = await asyncio.to_thread(open_nvml, self._nvml_arg)
        if api is None:
            self._latest = GpuSnapshot.no_gpu(reason or "NVML unavailable", self._clock())
            log.info("GPU sampler idle: %s", self._latest.no_gpu_reason)
            return
        self._api = api
        try:
            self._devices, self._driver_version = await asyncio.to_thread(self._read_inventory)
        except api.NVMLError as err:
            self._latest = GpuSnapshot.no_gpu(describe_nvml_error(err), self._clock())
            await self._shutdown_nvml()
            return
        if not self._devices:
            self._latest = GpuSnapshot.no_gpu("NVML reports no GPUs on this machine", self._clock())
            await self._shutdown_nvml()
            return
        await self.sample_once()
        self._task = asyncio.create_task(self._run(), name="gpupool-gpu-sampler")

    def _read_inventory(self) -> tuple[tuple[GpuDevice, ...], str | None]:
        assert self._api is not None
        with self._nvml_lock:
            devices = read_devices(self._api)
            try:
                driver: str | None = to_text(self._api.nvmlSystemGetDriverVersion())
            except self._api.NVMLError:
                driver = None
        return devices, driver

    def _read(self) -> GpuSnapshot:
        assert self._api is not None
        with self._nvml_lock:
            readings = read_readings(self._api, tuple(d.index for d in self._devices))
        return GpuSnapshot(
            taken_at_s=self._clock(),
            devices=self._devices,
            readings=readings,
            driver_version=self._driver_version,
        )

    async def sample_once(self) -> GpuSnapshot | None:
        """Take one sample now; returns it, or None when there is no GPU or the read failed."""
        api = self._api
        if api is None or self._state != "started":
            return None
        try:
            snapshot = await asyncio.to_thread(self._read)
        except api.NVMLError as err:
            message = describe_nvml_error(err)
            if message != self._last_error:
                log.warning("GPU sample failed: %s", message)
                self._last_error = message
            return None
        self._last_error = None
        self._latest = snapshot
        self._gauges.update(snapshot.readings)
        return snapshot

    async def _run(self) -> None:
        while True:
            await self._sleep(self._interval_s)
            try:
                await self.sample_once()
            except Exception:  # keep sampling; one bad read must not end telemetry
                log.exception("GPU sample raised")

    async def _shutdown_nvml(self) -> None:
        api, self._api = self._api, None
        if api is None:
            return

        def shutdown() -> None:
            with self._nvml_lock:
                try:
                    api.nvmlShutdown()
                except api.NVMLError as err:
                    log.debug("nvmlShutdown failed: %s", err)

        await asyncio.to_thread(shutdown)

    async def aclose(self) -> None:
        """Stop sampling and shut NVML down. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._shutdown_nvml()
