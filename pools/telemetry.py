"""Engine telemetry: parsing vLLM's `/metrics` and scraping every instance on an interval.

`parse_vllm_metrics(text, taken_at_s)` is pure and fast (it reads only the lines it needs). It
accepts the names the installed vLLM exports and the older ones: `vllm:gpu_cache_usage_perc`
(before 0.12) for `vllm:kv_cache_usage_perc`, `vllm:time_per_output_token_seconds` for
`vllm:inter_token_latency_seconds`; `vllm:cache_config_info`'s labels are read by name
(`block_size`, `num_gpu_blocks`) and the rest ignored, since the set changes between versions.
Series with several `engine` labels (data parallel) are summed; KV usage is averaged.

`TelemetryScraper` is the component that scrapes (start()/aclose(), injected clock); every
reading carries the time it was taken, and `Fleet` decides staleness and health from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pools.fleet import Fleet
from pools.periodic import Periodic

__all__ = ["InstanceReading", "TelemetryScraper", "parse_vllm_metrics"]

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:time_per_output_token_seconds_sum": "itl_sum_legacy",
    "vllm:time_per_output_token_seconds_count": "itl_count_legacy",
    "vllm:request_prompt_tokens_sum": "prompt_sum",
    "vllm:request_prefill_time_seconds_sum": "prefill_sum",
}


@dataclass(frozen=True, slots=True)
class InstanceReading:
    """One scrape of one engine. Counters are cumulative since the engine started."""

    taken_at_s: float  # the scraper's clock when the reading arrived
    kv_usage_frac: float  # 0..1
    running: int
    waiting: int
    num_gpu_blocks: int | None
    block_size: int | None
    preemptions_total: float
    prefix_cache_hits_total: float
    prefix_cache_queries_total: float
    ttft_sum_s: float
    ttft_count: float
    itl_sum_s: float
    itl_count: float
    prompt_tokens_sum: float = 0.0  # prompt tokens of finished requests
    prefill_time_sum_s: float = 0.0  # their prefill time (scheduled -> first token)
    # the scraper's clock when it sent the request: the engine's values are no older (None:
    # unknown, e.g. a reading built elsewhere)
    requested_at_s: float | None = None


def parse_vllm_metrics(text: str, taken_at_s: float) -> InstanceReading:
    """Parse the Prometheus text of a vLLM engine. Raises ValueError if it has no vLLM gauges."""
    totals: dict[str, float] = {}
    kv_values: list[float] = []
    num_blocks: int | None = None
    block_size: int | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.rfind(" ")
        if space < 0:
            continue
        name = line[:brace] if 0 <= brace < space else line[:space]
        if name == "vllm:cache_config_info":
            labels = dict(_LABEL.findall(line[brace:space]))
            with contextlib.suppress(KeyError, ValueError):
                num_blocks = (num_blocks or 0) + int(labels["num_gpu_blocks"])
            with contextlib.suppress(KeyError, ValueError):
                block_size = int(labels["block_size"])
            continue
        key = _GAUGES.get(name)
        if key is None:
            continue
        try:
            value = float(line[space + 1 :])
        except ValueError:
            continue
        if key == "kv":
            kv_values.append(value)
        else:
            totals[key] = totals.get(key, 0.0) + value
    if not kv_values and "running" not in totals:
        raise ValueError("no vLLM metrics found (is this a vLLM engine with stats enabled?)")
    return InstanceReading(
        taken_at_s=taken_at_s,
        kv_usage_frac=min(1.0, max(0.0, sum(kv_values) / len(kv_values))) if kv_values else 1.0,
        running=int(totals.get("running", 0)),
        waiting=int(totals.get("waiting", 0)),
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        preemptions_total=totals.get("preemptions", 0.0),
        prefix_cache_hits_total=totals.get("prefix_hits", 0.0),
        prefix_cache_queries_total=totals.get("prefix_queries", 0.0),
        ttft_sum_s=totals.get("ttft_sum", 0.0),
        ttft_count=totals.get("ttft_count", 0.0),
        itl_sum_s=totals.get("itl_sum", totals.get("itl_sum_legacy", 0.0)),
        itl_count=totals.get("itl_count", totals.get("itl_count_legacy", 0.0)),
        prompt_tokens_sum=totals.get("prompt_sum", 0.0),
        prefill_time_sum_s=totals.get("prefill_sum", 0.0),
    )


class TelemetryScraper:
    """Scrapes every instance of `fleet` each `interval_s`, each with `timeout_s`; a failed or
    unparsable scrape counts against the instance's health, a good one restores it.

    Each instance is scraped on its own schedule: one slow `/metrics` must not hold back the
    readings of the others (they would go stale, and stale counts as full)."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._loops: dict[str, Periodic] = {}
        self._running = False

    async def start(self) -> None:
        await self.scrape_all()
        self._running = True
        for instance_id in self._fleet.instance_ids():
            self.track(instance_id)

    def track(self, instance_id: str) -> None:
        """Scrape an instance that joined the fleet after `start` (its loop ends when it
        leaves the fleet). No-op before `start` and for an instance already scraped."""
        loop = self._loops.get(instance_id)
        if not self._running or (loop is not None and loop.running):
            return
        # scrapes `interval_s` apart start to start, the first at once; a failed one is
        # logged and the next comes on time
        self._loops[instance_id] = loop = Periodic(
            f"telemetry-scraper-{instance_id}",
            lambda: self.scrape(instance_id),
            self._interval_s,
            first_delay_s=0.0,
            clock=self._clock,
            active=lambda: self._fleet.get(instance_id) is not None,
        )
        loop.start()

    async def aclose(self) -> None:
        self._running = False
        loops, self._loops = list(self._loops.values()), {}
        await asyncio.gather(*(loop.aclose() for loop in loops))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(i) for i in self._fleet.instance_ids()))

    async def scrape(self, instance_id: str) -> None:
        state = self._fleet.get(instance_id)
        if state is None:
            return
        requested_at_s = self._clock()
        try:
            async with self._session.get(
                f"{state.spec.url}/metrics", timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"/metrics answered {resp.status}")
                text = await resp.text()
            reading = parse_vllm_metrics(text, self._clock())
            reading = dataclasses.replace(reading, requested_at_s=requested_at_s)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as err:
            self._fleet.record_failure(instance_id, str(err) or type(err).__name__)
            return
        self._fleet.record_reading(instance_id, reading)
