"""The request estimator: prompt tokens with the dev model's real tokenizer and with the byte
heuristic, online correction against usage counts, output-token caps, odd bodies.

Expected counts come from outside the code under test: the dev model's chat template rendered
with jinja2 the way transformers renders it, then encoded with `tokenizers` (what vLLM counts),
or a stated linear rule.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pools.devmodel import make_dev_model
from pools.testing.config import config_for_test, even_pools
from router.admission.estimate import Estimate, TokenEstimator, read_openai

_WORD_TEXT = (
    "the model reads a file and calls a tool to search the cache for the block it needs "
    "then writes the answer back to the user with a short note about latency and memory "
    "agent step result error function python json value key name data queue tenant"
)
WORDS = _WORD_TEXT.split()

EXPECTED = {"normal": 128, "agent": 512}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dev_model(tmp_path_factory.mktemp("model") / "tiny", "tiny")


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Oracle:
    return Oracle(model_dir)


class Oracle:
    """What vLLM counts for the dev model: the template rendered, then encoded."""

    def __init__(self, model_dir: Path) -> None:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
        self.template = env.from_string(cfg["chat_template"])
        self.bos = cfg["bos_token"]
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def chat(self, body: dict[str, Any]) -> int:
        messages = []
        for message in body["messages"]:
            message = dict(message)
            if message.get("tool_calls"):  # vLLM parses arguments into dicts first
                message["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": json.loads(a)}}
                    for c in message["tool_calls"]
                    for a in [c["function"]["arguments"]]
                ]
            messages.append(message)
        text = self.template.render(
            bos_token=self.bos,
            messages=messages,
            tools=body.get("tools"),
            add_generation_prompt=True,
        )
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=True).ids)


def words(rng: random.Random, n: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    if rng.random() < 0.3:
        text += f"\n\nsee src/file_{rng.randint(0, 999)}.py:{rng.randint(1, 400)} (line)"
    return text


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search the files for a pattern",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]


def chat_body(rng: random.Random) -> dict[str, Any]:
    """A chat request: plain, or an agent step with tools and a tool-call history."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(rng, rng.randint(5, 40))}]
    agent = rng.random() < 0.5
    for k in range(rng.randint(0, 4)):
        messages.append({"role": "user", "content": words(rng, rng.randint(3, 200))})
        if agent:
            call_id = f"call_{k}"
            args = json.dumps({"pattern": words(rng, 3), "limit": rng.randint(1, 50)})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "search", "arguments": args},
                        }
                    ],
                }
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": words(rng, rng.randint(5, 300)),
                }
            )
        else:
            content: Any = words(rng, rng.randint(3, 120))
            if rng.random() < 0.3:
                content = [{"type": "text", "text": content}]
            messages.append({"role": "assistant", "content": content})
    messages.append({"role": "user", "content": words(rng, rng.randint(2, 150))})
    body: dict[str, Any] = {"model": "tiny", "messages": messages}
    if agent:
        body["tools"] = TOOLS
    return body


def estimator(model_dir: Path | None, **kwargs: Any) -> TokenEstimator:
    return TokenEstimator(
        tokenizer_path=None if model_dir is None else model_dir / "tokenizer.json",
        expected_output_tokens=kwargs.pop("expected", EXPECTED),
        max_model_len_tokens=kwargs.pop("max_model_len_tokens", None),
        **kwargs,
    )


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


# -- prompt tokens -----------------------------------------------------------------------------


def test_tokenizer_counts_completion_prompts(model_dir: Path, oracle: Oracle) -> None:
    est = estimator(model_dir)
    assert est.source == "tokenizer"
    rng = random.Random(1)
    for _ in range(30):
        text = words(rng, rng.randint(1, 400))
        got = est.estimate({"prompt": text}, chat=False, class_name="normal")
        want = oracle.text(text)
        assert got.source == "tokenizer"
        assert got.prompt_tokens == want, text


CODE = """def count(self, groups: Sequence[str], limit: int | None = None) -> list[float]:
    totals = [0.0] * len(groups)  # one per group
    for group, pieces in enumerate(groups):
        if not pieces:
            continue
        totals[group] += sum(len(p) for p in pieces) / 4.0
    return totals
"""


@pytest.mark.parametrize(
    "text",
    [
        " leading space",
        "trailing space ",
        "double  spaces and   three",
        "tab\tand\nnewline\n\n  indented line",
        '{"path": "src/main.py", "content": "x = 1\\n", "n": 12345}',
        "ünïcødé and emoji 🙂 text",
        CODE,
    ],
)
def test_tokenizer_counts_odd_text_closely(model_dir: Path, oracle: Oracle, text: str) -> None:
    est = estimator(model_dir)
    for _ in range(2):  # cold, then from the memoised chunks
        got = est.estimate({"prompt": text}, chat=False, class_name="normal").prompt_tokens
        want = oracle.text(text)
        assert abs(got - want) <= max(1, 0.03 * want), (got, want)


def test_token_id_prompts_are_counted_exactly(model_dir: Path) -> None:
    for est in (estimator(model_dir), estimator(None)):
        one = est.estimate({"prompt": list(range(37))}, chat=False, class_name="normal")
        assert one.prompt_tokens == 37
        batch = est.estimate(
            {"prompt": [[5] * 10, [6] * 20], "max_tokens": 4}, chat=False, class_name="normal"
        )
        assert batch.prompt_tokens == 30
        assert batch.sequences == 2 and batch.output_tokens == 8


def test_tokenizer_chat_error_falls_below_5_percent(model_dir: Path, oracle: Oracle) -> None:
    est = estimator(model_dir)
    rng = random.Random(2)
    errors = []
    for _ in range(80):
        body = chat_body(rng)
        got = est.estimate(body, chat=True, class_name="agent")
        actual = oracle.chat(body)
        error = est.observe(got, class_name="agent", prompt_tokens=actual, completion_tokens=9)
        assert error is not None and error == pytest.approx((got.prompt_tokens - actual) / actual)
        errors.append(abs(error))
    assert max(errors[20:]) < 0.05, errors
    assert sum(errors[40:]) / 40 < 0.01


def test_chat_overhead_learned_when_the_prior_is_wrong(model_dir: Path, oracle: Oracle) -> None:
    """A template far heavier than the prior (64 extra tokens per message, 30 per request)."""
    est = estimator(model_dir)
    rng = random.Random(3)
    errors = []
    for _ in range(60):
        body = chat_body(rng)
        got = est.estimate(body, chat=True, class_name="normal")
        actual = oracle.chat(body) + 64 * len(body["messages"]) + 30
        error = est.observe(got, class_name="normal", prompt_tokens=actual, completion_tokens=1)
        assert error is not None
        errors.append(abs(error))
    assert max(errors[:3]) > 0.05  # the prior really was wrong
    assert max(errors[20:]) < 0.05, errors


def test_heuristic_starts_at_4_bytes_per_token() -> None:
    est = estimator(None)
    assert est.source == "heuristic"
    got = est.estimate({"prompt": "abcd" * 1000}, chat=False, class_name="normal")
    assert 1000 <= got.prompt_tokens <= 1002  # plus a BOS or so
    assert got.source == "heuristic"


def test_heuristic_converges_to_a_linear_rule() -> None:
    """Actual = 3 bytes a token, 7 per message, 3 per request, 40 more with tools."""
    est = estimator(None)
    rng = random.Random(4)
    errors = []
    for _ in range(60):
        body = chat_body(rng)
        text = sum(len(p.encode()) for p in _texts(body))
        actual = math.ceil(text / 3) + 7 * len(body["messages"]) + 3 + 40 * ("tools" in body)
        got = est.estimate(body, chat=True, class_name="normal")
        error = est.observe(got, class_name="normal", prompt_tokens=actual, completion_tokens=1)
        assert error is not None
        errors.append(abs(error))
    assert max(errors[:5]) > 0.1  # 4 bytes a token is 25 % off
    assert p95(errors[20:]) < 0.05, errors
    learned = est.coefficients
    assert learned["text"] == pytest.approx(1 / 3, rel=0.05)
    assert learned["message"] == pytest.approx(7, abs=2)


def test_the_learner_s_block_updates_fit_as_its_one_by_one_updates() -> None:
    """Past its first observations the learner updates by blocks (`_OnlineLinear.observe`):
    the same filter, so on one stream the two fit alike."""
    rng = random.Random(7)
    true = (0.27, 0.4, 6.0, 4.0, 9.0, 15.0, 1.0)
    stream = []
    for k in range(1500):
        if k == 500:  # a new template (it does not happen, but the learner must follow it)
            true = (0.3, 0.45, 10.0, 6.0, 9.0, 15.0, 1.0)
        chat = rng.random() < 0.8
        calls = rng.randint(0, 3) if chat and rng.random() < 0.3 else 0
        tools = 1.0 if calls or (chat and rng.random() < 0.2) else 0.0
        x = (
            float(rng.randint(10, 20_000)),
            float(rng.randint(50, 3000)) if tools else 0.0,
            1.0 if chat else 0.0,
            float(rng.randint(1, 20)) if chat else 0.0,
            float(calls),
            tools,
            0.0 if chat else float(rng.randint(1, 2)),
        )
        y = sum(a * b for a, b in zip(true, x, strict=True)) * (1 + rng.gauss(0, 0.02))
        stream.append((x, y))
    one_by_one, blocks = estimator(None)._model, estimator(None)._model
    first = blocks.sequential
    for k, (x, y) in enumerate(stream):
        one_by_one.update(x, y)
        blocks.observe(x, y)
        if k == first - 1:  # the first ones: one by one, the same numbers
            assert blocks.theta == one_by_one.theta
        if k == first + 5:  # then kept for the next block
            assert blocks.theta != one_by_one.theta
    blocks.flush()
    tail = stream[-300:]
    apart = max(abs(one_by_one.predict(x) - blocks.predict(x)) / y for x, y in tail)
    assert apart < 0.03
    error_one = sum(abs(one_by_one.predict(x) - y) / y for x, y in tail)
    error_blocks = sum(abs(blocks.predict(x) - y) / y for x, y in tail)
    assert error_blocks < 1.1 * error_one
    assert blocks.theta[0] == pytest.approx(0.3, rel=0.02)


def test_heuristic_against_the_real_template(oracle: Oracle) -> None:
    est = estimator(None)
    rng = random.Random(5)
    errors = []
    for _ in range(80):
        body = chat_body(rng)
        got = est.estimate(body, chat=True, class_name="normal")
        error = est.observe(
            got, class_name="normal", prompt_tokens=oracle.chat(body), completion_tokens=1
        )
        assert error is not None
        errors.append(abs(error))
    assert p95(errors[30:]) < 0.10, errors


def _texts(body: dict[str, Any]) -> list[str]:
    """The text the heuristic should weigh: contents, tool-call names and arguments, tools."""
    out = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(part["text"] for part in content)
        for call in message.get("tool_calls") or []:
            out += [call["function"]["name"], call["function"]["arguments"]]
    if "tools" in body:
        out.append(json.dumps(body["tools"]))
    return out


def test_repeated_history_counts_the_same(model_dir: Path) -> None:
    rng = random.Random(6)
    body = chat_body(rng)
    body["messages"].insert(1, {"role": "user", "content": words(rng, 900)})  # memoised whole
    warm = estimator(model_dir)
    first = warm.estimate(body, chat=True, class_name="agent")
    again = warm.estimate(body, chat=True, class_name="agent")
    fresh = estimator(model_dir).estimate(body, chat=True, class_name="agent")
    assert first.prompt_tokens == again.prompt_tokens == fresh.prompt_tokens


def test_short_messages_count_the_same_cold_and_warm(model_dir: Path) -> None:
    """Short pieces whose chunks were all seen are summed on the counter's fast path: the
    same counts as counted cold (spaces doubled, leading and trailing, a new first chunk)."""
    short = [
        "Say hello to the benchmark in a few words.",
        "  leading and  double spaces ",
        "What is the capital of France?",
        "Paris.",
        "",
        "capital Paris France",  # seen chunks, but "capital" never first
    ]
    messages = [{"role": "user", "content": m} for m in short]
    body = {"model": "m", "messages": messages}
    warm = estimator(model_dir)
    cold = warm.estimate(body, chat=True, class_name="normal")
    again = warm.estimate(body, chat=True, class_name="normal")
    assert cold.prompt_tokens == again.prompt_tokens
    assert cold.features == again.features
    # one new first chunk among known ones: the general path again, the same total
    messages.append({"role": "user", "content": "France capital"})
    grown = warm.estimate(body, chat=True, class_name="normal")
    fresh = estimator(model_dir).estimate(body, chat=True, class_name="normal")
    assert grown.features == fresh.features
    assert grown.features[0] > cold.features[0]


async def test_estimate_async_matches_sync(model_dir: Path, oracle: Oracle) -> None:
    rng = random.Random(7)
    seen = {"messages": [{"role": "user", "content": words(rng, 12_000)}]}  # known chunks
    unseen = " ".join(f"id{k:05d}q{rng.randint(0, 9)}" for k in range(3000))  # 30 KB, all new
    fresh = {"messages": [{"role": "user", "content": unseen}]}  # goes to a worker thread
    for body in (seen, fresh, chat_body(rng)):
        sync = estimator(model_dir).estimate(body, chat=True, class_name="normal")
        async_ = await estimator(model_dir).estimate_async(body, chat=True, class_name="normal")
        assert async_ == sync
    got = await estimator(model_dir).estimate_async(fresh, chat=True, class_name="normal")
    actual = oracle.chat(fresh)
    assert abs(got.prompt_tokens - actual) / actual < 0.05


async def test_estimate_now_declines_only_what_needs_a_thread(model_dir: Path) -> None:
    rng = random.Random(11)
    small = {"messages": [{"role": "user", "content": words(rng, 50)}]}
    unseen = " ".join(f"id{k:05d}q{rng.randint(0, 9)}" for k in range(3000))  # 30 KB, all new
    fresh = {"messages": [{"role": "user", "content": unseen}]}
    est = estimator(model_dir)
    now = est.estimate_input_now(read_openai(small, chat=True), class_name="normal")
    assert now == estimator(model_dir).estimate(small, chat=True, class_name="normal")
    # 30 KB never counted: declined (None), then counted in a worker thread as the sync path
    assert est.estimate_input_now(read_openai(fresh, chat=True), class_name="normal") is None
    threaded = await est.estimate_input_thread(read_openai(fresh, chat=True), class_name="normal")
    assert threaded == estimator(model_dir).estimate(fresh, chat=True, class_name="normal")


# -- output tokens ------------------------------------------------------------------------------


def test_output_capped_by_class_default_before_samples() -> None:
    est = estimator(None)
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    def out(**extra: Any) -> int:
        return est.estimate({**chat, **extra}, chat=True, class_name="normal").output_tokens

    assert out() == 128
    assert out(max_tokens=1000) == 128
    assert out(max_tokens=50) == 50
    assert out(max_completion_tokens=40, max_tokens=1000) == 40
    assert out(max_tokens=10, min_tokens=60) == 10
    assert out(max_tokens=1000, min_tokens=300) == 300
    assert out(n=3, max_tokens=20) == 60
    unknown = est.estimate(chat, chat=True, class_name="nobody")
    assert unknown.output_tokens == 256  # the config's default expected_output_tokens
    completions = est.estimate({"prompt": "hi"}, chat=False, class_name="normal")
    assert completions.output_tokens == 16  # vLLM's default max_tokens on /v1/completions
    nulled = est.estimate({"prompt": "hi", "max_tokens": None}, chat=False, class_name="agent")
    assert nulled.output_tokens == 512


def test_output_capped_by_observed_p95_after_20_samples() -> None:
    est = estimator(None, window=40)
    chat = {"messages": [{"role": "user", "content": "hello there"}]}
    seen = est.estimate(chat, chat=True, class_name="normal")
    for k in range(1, 20):  # 19 samples: not enough yet
        est.observe(seen, class_name="normal", prompt_tokens=10, completion_tokens=k)
    assert est.output_p95("normal") is None
    assert est.estimate(chat, chat=True, class_name="normal").output_tokens == 128
    est.observe(seen, class_name="normal", prompt_tokens=10, completion_tokens=20)
    assert est.output_p95("normal") == 19  # nearest rank of 1..20
    assert est.output_p95("agent") is None

    def out(**extra: Any) -> int:
        return est.estimate({**chat, **extra}, chat=True, class_name="normal").output_tokens

    assert out() == 19
    assert out(max_tokens=1000) == 19
    assert out(max_tokens=5) == 5
    # The window forgets: 40 long answers push the short ones out, within a recompute period.
    for _ in range(40):
        est.observe(seen, class_name="normal", prompt_tokens=10, completion_tokens=700)
    assert est.output_p95("normal") == 700
    assert out(max_tokens=1000) == 700


def test_completion_samples_are_per_sequence() -> None:
    est = estimator(None)
    three = est.estimate({"prompt": "x", "n": 3, "max_tokens": 50}, chat=False, class_name="agent")
    assert three.sequences == 3 and three.output_tokens == 150
    for _ in range(20):
        est.observe(three, class_name="agent", prompt_tokens=2, completion_tokens=90)
    assert est.output_p95("agent") == 30


def test_max_model_len_caps_output() -> None:
    est = estimator(None, max_model_len_tokens=100, expected={"normal": 500})
    ids = {"prompt": list(range(80)), "max_tokens": 1000}
    assert est.estimate(ids, chat=False, class_name="normal").output_tokens == 20
    over = {"prompt": list(range(150)), "max_tokens": 1000}
    assert est.estimate(over, chat=False, class_name="normal").output_tokens == 0
    chat = {"messages": [{"role": "user", "content": "x " * 200}]}  # ~100 tokens and more
    got = est.estimate(chat, chat=True, class_name="normal")
    assert got.output_tokens == max(0, 100 - got.prompt_tokens)


def test_total_and_blocks() -> None:
    estimate = Estimate(prompt_tokens=100, output_tokens=28, source="tokenizer")
    assert estimate.total_tokens == 128
    assert estimate.blocks(16) == 8
    assert Estimate(prompt_tokens=100, output_tokens=29, source="heuristic").blocks(16) == 9


def test_observe_reports_relative_error() -> None:
    est = estimator(None)
    made = Estimate(prompt_tokens=110, output_tokens=5, source="heuristic")
    assert est.observe(made, class_name="normal", prompt_tokens=100, completion_tokens=3) == (
        pytest.approx(0.1)
    )
    assert est.observe(made, class_name="normal", prompt_tokens=0, completion_tokens=3) is None


# -- config and fallbacks -----------------------------------------------------------------------


def _config(model_path: Path, max_len: int | None = 2048) -> Any:
    return config_for_test(
        model={"path": str(model_path), "max_model_len_tokens": max_len},
        pools=even_pools(),
        classes={"agent": {"expected_output_tokens": 300}},
    )


def test_from_config_uses_the_model_tokenizer(model_dir: Path) -> None:
    est = TokenEstimator.from_config(_config(model_dir))
    assert est.source == "tokenizer"
    got = est.estimate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
        chat=True,
        class_name="agent",
    )
    assert got.output_tokens == 300


def test_heuristic_without_tokenizer_json(tmp_path: Path, model_dir: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    est = TokenEstimator.from_config(_config(bare, max_len=None))
    assert est.source == "heuristic"
    got = est.estimate({"prompt": "word " * 400}, chat=False, class_name="normal")
    assert got.source == "heuristic" and 400 <= got.prompt_tokens <= 600


def test_unreadable_tokenizer_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    est = estimator(tmp_path)
    assert est.source == "heuristic"
    assert "cannot load tokenizer" in caplog.text


# -- odd bodies ---------------------------------------------------------------------------------

ODD_BODIES: list[object] = [
    None,
    [],
    "text",
    42,
    1.5,
    True,
    {},
    {"messages": "hello"},
    {"messages": [None, 1, "x", {"content": 5}, {"content": [1, None, {"text": 3}]}]},
    {"messages": [{"content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]},
    {"messages": [{"role": "assistant", "tool_calls": "x"}]},
    {"messages": [{"tool_calls": [None, {"function": "f"}, {"function": {"name": 1}}]}]},
    {"messages": [{"tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2]}}}]}]},
    {"messages": [{"content": "lone \ud800 surrogate and \udfff"}]},
    {"messages": [{"content": "x"}], "tools": "all"},
    {"messages": [{"content": "x"}], "tools": [{"f": object()}]},
    {"messages": [{"content": "x"}], "max_tokens": "10", "n": "2", "min_tokens": -4},
    {"messages": [{"content": "x"}], "max_tokens": True, "n": 10**12},
    {"messages": [{"content": "x"}], "max_tokens": float("nan"), "max_completion_tokens": -1},
    {"messages": [{"content": "x"}], "max_tokens": 1e300},
    {"prompt": None},
    {"prompt": {"a": 1}},
    {"prompt": [None, 1.5, "x"]},
    {"prompt": [[1, 2], [3], "x y", None, {"k": 1}]},
    {"prompt": "  spaces   everywhere  \n\t  "},
    {"prompt": "lone \ud800 surrogate"},
    {"prompt": ""},
    {"prompt": [], "best_of": 3},
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
bodies = st.dictionaries(
    st.sampled_from(
        ["messages", "prompt", "tools", "max_tokens", "max_completion_tokens", "n", "min_tokens"]
    ),
    json_values,
)


@pytest.mark.parametrize("body", ODD_BODIES, ids=range(len(ODD_BODIES)))
@pytest.mark.parametrize("chat", [True, False])
def test_odd_bodies_never_raise(model_dir: Path, body: object, chat: bool) -> None:
    for est in (estimator(model_dir, max_model_len_tokens=4096), estimator(None)):
        got = est.estimate(body, chat=chat, class_name="normal")
        assert got.prompt_tokens >= 0 and got.output_tokens >= 0 and got.sequences >= 1
        est.observe(got, class_name="normal", prompt_tokens=7, completion_tokens=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, chat=st.booleans())
def test_any_json_body_never_raises(model_dir: Path, body: dict[str, Any], chat: bool) -> None:
    est = estimator(model_dir, max_model_len_tokens=4096)
    got = est.estimate(body, chat=chat, class_name="normal")
    assert got.prompt_tokens >= 0 and got.output_tokens >= 0
