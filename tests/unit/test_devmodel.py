"""The dev model: deterministic files, a working tokenizer, a chat template that renders tools."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer

from pools.devmodel import SHAPES, dev_model_fingerprint, make_dev_model
from router.cli import main


def test_deterministic(tmp_path: Path) -> None:
    a = make_dev_model(tmp_path / "a")
    b = make_dev_model(tmp_path / "b")
    assert dev_model_fingerprint(a) == dev_model_fingerprint(b)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes(tmp_path: Path, shape: str) -> None:
    folder = make_dev_model(tmp_path / shape, shape)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["head_dim"] == SHAPES[shape]["head_dim"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode("hello tool call 12345 ünïcødé").ids
    assert ids and max(ids) < config["vocab_size"]
    assert tok.decode(ids) == "hello tool call 12345 ünïcødé"
    assert tok.token_to_id("<tool_call>") is not None


def test_tiny_has_cpu_friendly_geometry(tmp_path: Path) -> None:
    config = json.loads((make_dev_model(tmp_path / "t") / "config.json").read_text())
    assert config["head_dim"] == 64  # CPU attention kernels need 64
    eight = SHAPES["llama-3.1-8b"]
    assert (eight["num_hidden_layers"], eight["num_key_value_heads"], eight["head_dim"]) == (
        32,
        8,
        128,
    )


def test_chat_template_renders_tools_and_tool_results(tmp_path: Path) -> None:
    cfg = json.loads((make_dev_model(tmp_path / "t") / "tokenizer_config.json").read_text())
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
    env.filters["tojson"] = json.dumps
    out = env.from_string(cfg["chat_template"]).render(
        bos_token=cfg["bos_token"],
        tools=[{"type": "function", "function": {"name": "search"}}],
        messages=[
            {"role": "user", "content": "find it"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "search", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "found"},
        ],
        add_generation_prompt=True,
    )
    assert out.startswith("<|begin_of_text|>") and "search" in out
    assert "tool<|end_header_id|>\n\nfound<|eot_id|>" in out
    assert "<tool_call>" in out and out.endswith("assistant<|end_header_id|>\n\n")


def test_cli(tmp_path: Path) -> None:
    assert main(["dev-model", "--out", str(tmp_path / "m"), "--shape", "tiny"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
