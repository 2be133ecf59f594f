"""The dev model: a Llama-shaped model folder vLLM can serve with `--load-format dummy`.

`make_dev_model(out_dir, shape)` writes `config.json`, a byte-level BPE tokenizer trained here
with `tokenizers` on a generated corpus (nothing is downloaded), `tokenizer_config.json` with a
chat template that renders tools and tool results, and `generation_config.json`. The output is
deterministic: the same shape gives byte-identical files.

Shapes: `tiny` (2 layers, head_dim 64: CPU vLLM's attention kernels need 64) for tests and the
default CPU fleet; `llama-3.1-8b` (the real 8B geometry) for KV and latency realism on a GPU.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

__all__ = [
    "SHAPES",
    "dev_model_fingerprint",
    "dev_model_hf_config",
    "is_dev_model",
    "make_dev_model",
]

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
]

_LLAMA_BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "max_position_embeddings": 8192,
        "vocab_size": 4096,
    },
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "max_position_embeddings": 131072,
        "vocab_size": 8192,  # the geometry that matters for KV; a small local tokenizer
    },
}

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\nYou may call these tools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|eot_id|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{%- endfor %}{%- endif %}"
    "<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "from",
    "at",
    "an",
    "which",
    "have",
    "not",
    "but",
    "had",
    "they",
    "all",
    "were",
    "there",
    "been",
    "one",
    "has",
    "more",
    "their",
    "if",
    "will",
    "would",
    "about",
    "can",
    "other",
    "into",
    "some",
    "these",
    "than",
    "time",
    "only",
    "its",
    "when",
    "what",
    "up",
    "out",
    "could",
    "so",
    "may",
    "two",
    "such",
    "them",
    "first",
    "over",
    "model",
    "token",
    "cache",
    "block",
    "pool",
    "agent",
    "tool",
    "request",
    "response",
    "stream",
    "server",
    "engine",
    "router",
    "gpu",
    "memory",
    "latency",
    "batch",
    "prefill",
    "decode",
    "context",
    "prompt",
    "queue",
    "tenant",
    "run",
    "step",
    "result",
    "error",
    "function",
    "call",
    "search",
    "file",
    "read",
    "write",
    "list",
    "open",
    "close",
    "python",
    "json",
    "value",
    "key",
    "name",
    "type",
    "data",
    "user",
    "system",
    "assistant",
    "message",
    "content",
    "answer",
    "question",
    "please",
    "thanks",
    "hello",
    "world",
    "def",
    "return",
    "import",
    "class",
    "self",
    "none",
    "true",
    "false",
    "print",
    "len",
    "range",
    "for",
    "while",
    "if",
    "else",
    "elif",
    "try",
]


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        k = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.append(f'{{"name": "{rng.choice(_WORDS)}", "arguments": {{}}}}')
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ",", ""]))
    return lines


def _train_tokenizer(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(4000, seed=1234), trainer=trainer)
    return tokenizer.to_str(pretty=False)


def dev_model_hf_config(shape: str) -> dict[str, Any]:
    """The geometry part of the dev model's config.json (what KV sizing reads), without making
    the folder; `make_dev_model` writes this plus the tokenizer's ids."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    return {**_LLAMA_BASE, **SHAPES[shape], "gpupool_dev_model_shape": shape}


def make_dev_model(out_dir: str | Path, shape: str = "tiny") -> Path:
    """Write the dev model of `shape` into `out_dir` (created if needed); returns the folder."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    geometry = SHAPES[shape]
    tokenizer_json = _train_tokenizer(geometry["vocab_size"])
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    # The trainer may stop short of vocab_size on a small corpus; the embedding table is sized
    # to the requested vocab (dummy weights) and must cover every id the tokenizer emits.
    vocab_size = max(geometry["vocab_size"], max(vocab.values()) + 1)
    bos_id = vocab["<|begin_of_text|>"]
    eos_id = vocab["<|eot_id|>"]
    config = {
        **dev_model_hf_config(shape),
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, vocab["<|end_of_text|>"]],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "model_max_length": geometry["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": bos_id,
        "eos_token_id": [eos_id, vocab["<|end_of_text|>"]],
        "do_sample": True,
        "temperature": 1.0,
    }
    files = {
        "config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n",
        "special_tokens_map.json": json.dumps(
            {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "pad_token")},
            indent=2,
            sort_keys=True,
        )
        + "\n",
        "generation_config.json": json.dumps(generation_config, indent=2, sort_keys=True) + "\n",
    }
    for name, text in files.items():
        (out / name).write_text(text)
    return out


def dev_model_fingerprint(folder: str | Path) -> str:
    """SHA-256 over the dev model's files, to check determinism and detect a stale folder."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.json")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def is_dev_model(folder: str | Path) -> bool:
    """True if `folder` holds a complete model folder (config and tokenizer)."""
    f = Path(folder)
    return (f / "config.json").is_file() and (f / "tokenizer.json").is_file()
