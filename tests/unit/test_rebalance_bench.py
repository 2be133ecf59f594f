"""The day-night benchmark's per-phase arithmetic, on hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.rebalance.day_night import render, summarize


def chat(t: float, ttft_ms: float, status: int = 200) -> dict[str, object]:
    return {
        "type": "request",
        "class_name": "normal",
        "kind": "chat",
        "scheduled_s": t,
        "send_s": t,
        "status": status,
        "error_code": None if status == 200 else "queue_timeout",
        "ttft_ms": ttft_ms if status == 200 else None,
        "e2e_ms": ttft_ms + 100 if status == 200 else None,
        "output_tokens": 11,
    }


def agent(t: float, ttft_ms: float, tokens: int) -> dict[str, object]:
    return {
        **chat(t, ttft_ms),
        "class_name": "agent",
        "kind": "agent",
        "e2e_ms": ttft_ms + 10 * (tokens - 1),
        "output_tokens": tokens,
    }


def test_phases_goodput_and_failures(tmp_path: Path) -> None:
    folder = tmp_path / "rebalanced"
    folder.mkdir()
    records = [
        chat(10, 100),  # day: meets 800 ms
        chat(20, 900),  # day: misses TTFT
        chat(70, 100, status=429),  # evening: failed
        agent(130, 500, 60),  # night: meets (TPOT 10 ms), 60 tokens
        agent(140, 4000, 60),  # night: misses the 3000 ms TTFT
        chat(200, 50),  # morning
    ]
    (folder / "records-rebalanced.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + "\n"
    )
    (folder / "t0.json").write_text(json.dumps({"first_request_unix_s": 1000.0}))
    (folder / "timeline.json").write_text(
        json.dumps(
            [
                {
                    "unix_s": 1010.0,
                    "placed": {"agent": 0.33},
                    "target": {"agent": 0.33},
                    "draining": 0,
                    "queue": {},
                    "pressure": None,
                },
                {
                    "unix_s": 1130.0,
                    "placed": {"agent": 0.67},
                    "target": {"agent": 0.67},
                    "draining": 1,
                    "queue": {},
                    "pressure": None,
                },
            ]
        )
    )
    move = {"from_pool": "normal", "to_pool": "agent", "share_frac": 0.34}
    (folder / "decisions.json").write_text(
        json.dumps(
            [
                {
                    "at_unix_s": 1131.5,
                    "reason": "drain_done",
                    "drain_s": 1.5,
                    "ended_by": "finished",
                },
                {
                    "at_unix_s": 1130.0,
                    "reason": "moved",
                    "kind": "auto",
                    "move": move,
                    "smoothed_pressure": {"agent": 2.0, "normal": 0.1},
                },
            ]
        )
    )
    r = summarize(tmp_path, "rebalanced")
    day, evening, night = r["phases"]["day"], r["phases"]["evening"], r["phases"]["night"]
    assert day["chat_requests"] == 2 and day["chat_slo_attainment"] == 0.5
    assert evening["failed"] == 1 and evening["failed_codes"] == ["429 queue_timeout"]
    assert night["agent_steps"] == 2
    assert night["agent_goodput_tokens_per_s"] == pytest.approx(60 / 60)
    assert r["moves"] == [
        {"t_s": 130.0, "kind": "auto", "move": move, "smoothed": {"agent": 2.0, "normal": 0.1}}
    ]
    assert r["drains"] == [{"t_s": 131.5, "drain_s": 1.5, "ended_by": "finished"}]
    assert r["agent_share_min_max"] == [0.33, 0.67]
    text = render(tmp_path, ["static", "rebalanced"])
    assert "| rebalanced | day | 50.0% |" in text
