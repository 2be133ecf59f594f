"""A router `kill -9` right after its last client got `[DONE]`: the ledger has a record for every
response whose final bytes reached the client (router.ledger_durable). A real `gpupool serve`
process in front of a fake engine; the small, deterministic form of
`python -m benchmarks.faults_ledger_kill`."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.faults_ledger_kill import router_config, stream_then_kill
from benchmarks.reliability.faults import Reply, RouterProcess, ledger_rows
from pools.testing.fake_engine import FakeEngineState, make_fake_engine
from pools.testing.serve import serve_asgi

MODEL = Path(__file__).resolve().parents[2] / ".gpupool" / "models" / "tiny"


async def twenty_then_kill(config: Path, log: Path) -> list[Reply]:
    """`gpupool serve` with `config`: 20 streams, 5 at a time, SIGKILL right after the last
    [DONE]; the replies (each checked to have got its final bytes)."""
    router = RouterProcess("serve", config, log)
    try:
        await router.wait_ready()
        replies, _ = await stream_then_kill(
            router, requests=20, concurrency=5, max_tokens=8, kill_after_done=20
        )
        assert await router.wait_exit(10) == -9
    finally:
        await router.stop()
    assert [r.kind for r in replies] == ["ok"] * 20  # every client got its final bytes
    return replies


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "batched"])
async def test_kill_9_after_the_last_done_loses_no_record(tmp_path: Path, durable: bool) -> None:
    state = FakeEngineState(ttft_s=0.002, itl_s=0.002, keep_requests=False)
    async with serve_asgi(make_fake_engine(state)) as engine_url:
        # no periodic flush within the test: what is on disk was committed per request
        config = router_config(
            tmp_path,
            [engine_url],
            durable=durable,
            model_path=MODEL,
            router={"ledger_flush_interval_s": 600.0},
        )
        replies = await twenty_then_kill(config, tmp_path / "router.log")
    rows = ledger_rows(tmp_path / "ledger.sqlite")  # integrity checked
    recorded = [r.request_id for r in replies if r.request_id in rows]
    if durable:
        assert len(recorded) == 20
        assert {rows[rid]["completion_tokens"] for rid in recorded} == {8}
    else:  # the batched ledger (the behaviour before) held them all in memory
        assert recorded == []
