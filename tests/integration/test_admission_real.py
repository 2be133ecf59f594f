"""Admission in front of real CPU vLLM engines: a request that cannot fit waits and is served
when capacity frees (and the engine never holds both), a full queue answers 429 with
Retry-After, a queued client that disconnects leaves no trace on the engine, a deadline that
cannot be met is refused at once, and the official openai client rides out a 429.

KV pressure comes from the engine's real cache: the router is given a KV safety margin that
leaves room on the normal pool's engine for one of these requests and not two (computed from
the `num_gpu_blocks` the engine reports), so the real scrape, reservation and release path
decides; the engine itself is the session's shared one and is not restarted.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pools.launchers import InstanceSpec
from pools.testing.router_process import free_port
from tests.integration.conftest import RouterProcess, wait_for, write_router_config

pytestmark = pytest.mark.integration

PROMPT_WORDS = 500  # ~1,000 prompt tokens with the dev tokenizer (2 per word)
MAX_TOKENS = 256  # the class default estimate is 256 output tokens: estimate == real length
BLOCKS_FOR_ONE_AND_A_HALF = 1.6  # usable KV = 1.6 x one request: one fits, two do not


def _engine_metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _cache_config(url: str) -> tuple[int, int]:
    """The engine's (num_gpu_blocks, block_size) from `vllm:cache_config_info`."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next((x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")), "")
    blocks = re.search(r'num_gpu_blocks="(\d+)"', line)
    size = re.search(r'block_size="(\d+)"', line)
    assert blocks and size, "engine reports no cache_config_info"
    return int(blocks.group(1)), int(size.group(1))


def _body(tag: str, **extra: Any) -> dict[str, Any]:
    words = " ".join(f"{tag}{i % 97}" for i in range(PROMPT_WORDS))
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        **extra,
    }


@dataclass
class Admitted:
    router: RouterProcess
    engine_url: str

    @property
    def url(self) -> str:
        return self.router.url

    def post(self, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120, **kwargs)

    def pool_view(self) -> dict[str, Any]:
        view: dict[str, Any] = httpx.get(f"{self.url}/admin/pools", timeout=5).json()
        return view

    def queue_depth(self) -> int:
        depth: int = self.pool_view()["pools"]["normal"]["queue"]["depth"]
        return depth

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, value = line.rsplit(" ", 1)
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


class EnginePeak:
    """Samples the engine's running + waiting requests while a test runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with_queue = _engine_metric(self.url, "vllm:num_requests_running") + _engine_metric(
                self.url, "vllm:num_requests_waiting"
            )
            self.peak = max(self.peak, with_queue)
            time.sleep(0.05)

    def __enter__(self) -> EnginePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _start(
    tmp_path: Path, engines: list[InstanceSpec], *, max_depth: int = 4, max_wait_s: float = 60
) -> Admitted:
    # two engines: agent on one, normal on the other (whole instances)
    urls = [engines[0].url, engines[1].url]
    blocks, block_size = min(_cache_config(u) for u in urls)
    one = -(-(PROMPT_WORDS * 2 + MAX_TOKENS) // block_size)
    margin = 1 - BLOCKS_FOR_ONE_AND_A_HALF * one / (blocks - 1)
    config = write_router_config(
        tmp_path / "gpupool.yaml",
        urls,
        router={"kv_margin_frac": round(margin, 5)},
        pools={
            "agent": {"classes": ["agent"], "share": {"initial_frac": 0.5}},
            "normal": {
                "classes": ["normal"],
                "share": {"initial_frac": 0.5},
                "queue": {"max_depth": max_depth, "max_wait_s": max_wait_s},
            },
        },
    )
    router = RouterProcess(config, free_port(), tmp_path / "router.log")
    view = httpx.get(f"{router.url}/admin/pools", timeout=5).json()
    (normal_id,) = view["pools"]["normal"]["instances"]
    return Admitted(router, view["instances"][normal_id]["url"])


@pytest.fixture
def admitted(tmp_path: Path, real_engines: list[InstanceSpec]) -> Iterator[Admitted]:
    rig = _start(tmp_path, real_engines)
    try:
        yield rig
    finally:
        rig.router.stop()


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn(*args, **kwargs))
        except Exception as err:  # surfaced by the test's assertions
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_request_that_cannot_fit_waits_and_is_served(admitted: Admitted) -> None:
    with EnginePeak(admitted.engine_url) as peak:
        first, a = _in_thread(admitted.post, _body("a"))
        wait_for(lambda: _inflight(admitted) == 1 or a)
        assert not a, f"the first request ended before the test could queue behind it: {a}"
        second, b = _in_thread(admitted.post, _body("b"))
        wait_for(lambda: admitted.queue_depth() == 1 or b)
        assert not b, f"the second request was not queued: {b}"
        first.join(120)
        second.join(120)
    assert a[0].status_code == 200 and b[0].status_code == 200, (a, b)
    assert b[0].json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert peak.peak <= 1  # the engine never held both: its KV would not have
    assert admitted.metric("gpupool_queue_wait_seconds_count", pool="normal") >= 1
    assert admitted.metric("gpupool_queue_wait_seconds_sum", pool="normal") > 0.05
    assert _inflight(admitted) == 0
    reserved = admitted.pool_view()["instances"]
    assert all(i["kv_reserved_blocks"] == 0 for i in reserved.values())


def _inflight(rig: Admitted) -> int:
    return sum(i["inflight"] for i in rig.pool_view()["instances"].values())


def test_a_full_queue_answers_429_with_retry_after(
    tmp_path: Path, real_engines: list[InstanceSpec]
) -> None:
    rig = _start(tmp_path, real_engines, max_depth=1)
    try:
        # the first holds the engine ~4x longer than one request: the queue must still be full
        # when the third arrives (at 256 tokens the first ended ~1.1 s after it started, and on
        # a loaded machine the polls below once took 0.7 s of that: the third was queued, 200)
        first, a = _in_thread(rig.post, _body("c", max_tokens=4 * MAX_TOKENS))
        wait_for(lambda: _inflight(rig) == 1 or a)
        assert not a, a
        second, b = _in_thread(rig.post, _body("d"))
        wait_for(lambda: rig.queue_depth() == 1)
        refused = rig.post(_body("e"))
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "capacity_exceeded"
        assert error["retryable"] is True and error["retry_after_seconds"] >= 1
        first.join(120)
        second.join(120)
        assert a[0].status_code == 200 and b[0].status_code == 200
        assert rig.metric("gpupool_rejections_total", pool="normal", reason="queue_full") == 1
    finally:
        rig.router.stop()


def test_a_queued_client_that_disconnects_leaves_no_trace(admitted: Admitted) -> None:
    prompt_before = _engine_metric(admitted.engine_url, "vllm:prompt_tokens_total")
    # the first runs ~4x longer than the queued client's patience
    first, a = _in_thread(admitted.post, _body("f", max_tokens=4 * MAX_TOKENS))
    wait_for(lambda: _inflight(admitted) == 1 or a)
    assert not a, a

    def impatient() -> str:
        try:
            httpx.post(f"{admitted.url}/v1/chat/completions", json=_body("g"), timeout=1.0)
        except httpx.ReadTimeout:
            return "gave up"
        return "answered"

    ghost, g = _in_thread(impatient)
    wait_for(lambda: admitted.queue_depth() == 1 or g)
    ghost.join(10)
    assert g == ["gave up"]
    wait_for(lambda: admitted.queue_depth() == 0, timeout_s=2)
    assert _inflight(admitted) == 1  # left the queue while the first still held the engine
    first.join(120)
    assert a[0].status_code == 200
    first_prompt = a[0].json()["usage"]["prompt_tokens"]
    time.sleep(1.0)  # a dispatched ghost would have been prefilled by now
    prompt_after = _engine_metric(admitted.engine_url, "vllm:prompt_tokens_total")
    assert prompt_after - prompt_before == first_prompt  # only the first reached the engine
    assert admitted.metric("gpupool_requests_total", outcome="aborted") == 1
    assert _inflight(admitted) == 0


def test_an_unmeetable_deadline_is_refused_at_once(admitted: Admitted) -> None:
    # a short request and two scrapes so the router has measured the engine's prefill rate
    assert admitted.post({**_body("h"), "max_tokens": 4}).status_code == 200
    wait_for(
        lambda: (
            admitted.pool_view()["instances"][_normal_id(admitted)]["prefill_tokens_per_s"]
            is not None
        ),
        timeout_s=10,
    )
    prompt_before = _engine_metric(admitted.engine_url, "vllm:prompt_tokens_total")
    started = time.monotonic()
    reply = admitted.post(_body("i"), headers={"x-gpupool-deadline-ms": "2"})
    took_s = time.monotonic() - started
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["code"] == "deadline_unmeetable"
    assert took_s < 0.5
    assert _engine_metric(admitted.engine_url, "vllm:prompt_tokens_total") == prompt_before


def test_a_deadline_shorter_than_one_engine_step_is_refused_not_timed_out(
    admitted: Admitted,
) -> None:
    # a short prompt prefills in about a millisecond on a fast CPU, but its first token also
    # needs one decode step; once the router has measured the engine's TPOT, a 1 ms deadline
    # is refused up front (429), not left to pass at the engine (504)
    normal_id = _normal_id(admitted)

    def sampled() -> bool:
        """A sequence running across a scrape gives a TPOT sample; one request of 256 tokens
        can finish between two scrapes on a fast CPU (s50: no sample in 10 s after a lone
        request), so another is served until a scrape has seen one running."""
        if admitted.pool_view()["instances"][normal_id]["operating_point"]["samples"] > 0:
            return True
        assert admitted.post(_body("j")).status_code == 200
        return False

    wait_for(sampled, timeout_s=30)
    short = {**_body("k"), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    prompt_before = _engine_metric(admitted.engine_url, "vllm:prompt_tokens_total")
    reply = admitted.post(short, headers={"x-gpupool-deadline-ms": "1"})
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["code"] == "deadline_unmeetable"
    assert _engine_metric(admitted.engine_url, "vllm:prompt_tokens_total") == prompt_before


def _normal_id(rig: Admitted) -> str:
    (normal_id,) = rig.pool_view()["pools"]["normal"]["instances"]
    return str(normal_id)


def test_openai_client_retries_a_429_until_capacity_frees(
    tmp_path: Path, real_engines: list[InstanceSpec]
) -> None:
    rig = _start(tmp_path, real_engines, max_depth=0)  # no queue: busy means 429
    try:
        first, a = _in_thread(rig.post, _body("j"))
        wait_for(lambda: _inflight(rig) == 1 or a)
        assert not a, a
        client = openai.OpenAI(base_url=f"{rig.url}/v1", api_key="unused", max_retries=5)
        reply = client.chat.completions.create(
            model="tiny",
            messages=_body("k")["messages"],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        assert rig.metric("gpupool_rejections_total", pool="normal", reason="queue_full") >= 1
        first.join(120)
        assert a[0].status_code == 200
    finally:
        rig.router.stop()


def test_admission_metrics_from_real_engines(admitted: Admitted) -> None:
    assert admitted.post({**_body("l"), "max_tokens": 8}).status_code == 200
    normal = _normal_id(admitted)
    assert admitted.metric("gpupool_operating_point_limit", instance=normal) >= 1
    capacity = admitted.metric("gpupool_kv_capacity_blocks", instance=normal)
    assert capacity == _cache_config(admitted.engine_url)[0]
    text = httpx.get(f"{admitted.url}/metrics", timeout=5).text
    for name in (
        "gpupool_queue_depth",
        "gpupool_kv_reserved_blocks",
        "gpupool_instance_preemptions_total",
        "gpupool_token_estimate_error_ratio_bucket",
    ):
        assert name in text, name
    errors = admitted.metric("gpupool_token_estimate_error_ratio_count", source="tokenizer")
    assert errors >= 1
