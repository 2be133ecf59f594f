"""`benchmarks.admission.chat_tail`: what the agents did during each chat request's TTFT
window, from hand-made harness records whose answers are worked out below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.admission.chat_tail import ChatWindow, chat_windows, main, step_gaps


def _req(kind: str, send_s: float, ttft_ms: float | None, **extra: object) -> dict[str, object]:
    return {"type": "request", "kind": kind, "send_s": send_s, "ttft_ms": ttft_ms, **extra}


ROWS: list[dict[str, object]] = [
    # decoding from 0.5 s, tokens at 0.5, 0.52, 0.54, 0.60 (a 60 ms step), 0.62; ends 0.62
    _req("agent", 0.0, 500.0, e2e_ms=620.0, itl_ms=[20.0, 20.0, 60.0, 20.0]),
    # its first token at 0.55: inside the chat window below
    _req("agent", 0.45, 100.0, e2e_ms=300.0, itl_ms=[]),
    # sent at 0.4, first token at 1.0: waiting when the chat request was sent
    _req("agent", 0.4, 600.0, e2e_ms=700.0, itl_ms=[]),
    # chat sent at 0.51, first token at 0.61, 300 prompt tokens by usage
    _req("chat", 0.51, 100.0, prompt_tokens=300, planned_prompt_tokens=280),
    _req("chat", 2.0, None),  # failed: no window
    {"type": "run", "run_id": "r"},
]


def test_a_chat_window_counts_the_agents_around_it() -> None:
    (w,) = chat_windows(ROWS)
    # the first agent decodes at 0.51 (first 0.5, end 0.62); the second's first token (0.55)
    # lies in (0.51, 0.61]; the third was sent and had no token yet. The first agent's tokens
    # in the window: 0.52, 0.54, 0.60 (three steps), the longest gap from 0.50 on: 60 ms
    assert w == ChatWindow(
        send_s=0.51,
        ttft_ms=100.0,
        prompt_tokens=300,
        agent_firsts=1,
        agents_decoding=1,
        agents_waiting=2,
        steps=3,
        step_max_ms=w.step_max_ms,
    )
    assert w.step_max_ms == pytest.approx(60.0)


def test_each_agent_gap_is_classed_by_the_first_tokens_inside_it() -> None:
    # the first agent's gaps: (0.50, 0.52], (0.52, 0.54], (0.54, 0.60], (0.60, 0.62]; the
    # second agent's first token (0.55) ends inside the third, the chat's (0.61) in the fourth;
    # the other agents emit one token each: no gaps
    gaps = step_gaps(ROWS)
    assert {k: [round(g, 6) for g in v] for k, v in gaps.items()} == {
        "decode only": [20.0, 20.0],
        "agent prefill": [60.0],
        "chat prefill": [20.0],
    }


def test_the_report_lists_the_slow_ones_and_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "records-r1-x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main([str(tmp_path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 0.51 | 100 | 300 | 1 | 1 | 2 | 3 | 60 |" in out
    assert "| 257-512 | 1 | 100 | 100 | 100 | 100 |" in out
    assert "| agent prefill | 1 | 60.0 | 60.0 | 60.0 |" in out
    assert main([str(tmp_path), "--runs", "nope"]) == 1
