"""kvcache_model geometry: known KV bytes per token, HF config families, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcache_model.errors import KVCacheModelError, ModelConfigError, UnknownModelError
from kvcache_model.geometry import ModelGeometry, blocks_for_tokens
from kvcache_model.known import known_model_names, load_geometry, load_known_config
from pools.devmodel import SHAPES

# Published KV bytes per token (bf16 KV cache, all layers).
KNOWN_KV_BYTES_PER_TOKEN = {
    "llama-3.1-8b": 131072,  # 32 layers x 2 x 8 KV heads x 128 x 2 B
    "llama-3.1-70b": 327680,  # 80 x 2 x 8 x 128 x 2
    "qwen2.5-7b": 57344,  # 28 x 2 x 4 x 128 x 2
    "mixtral-8x7b": 131072,  # 32 x 2 x 8 x 128 x 2
    "deepseek-v3": 70272,  # MLA: 61 x (512 + 64) x 2
}

# Published parameter counts (billions) and our tolerance.
KNOWN_PARAMS_B = {
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6,
    "qwen2.5-7b": 7.61,
    "mixtral-8x7b": 46.7,
    "deepseek-v3": 671.0,
    "gemma-2-9b": 9.24,
    "qwen3-8b": 8.19,
}


@pytest.mark.parametrize(("name", "expected"), sorted(KNOWN_KV_BYTES_PER_TOKEN.items()))
def test_known_kv_bytes_per_token(name: str, expected: int) -> None:
    assert load_geometry(name).kv_bytes_per_token() == expected


@pytest.mark.parametrize(("name", "expected_b"), sorted(KNOWN_PARAMS_B.items()))
def test_param_counts_match_published(name: str, expected_b: float) -> None:
    got_b = load_geometry(name).param_count / 1e9
    error = (got_b - expected_b) / expected_b
    assert abs(error) < 0.01, (
        f"{name}: {got_b:.2f} B params vs published {expected_b} B ({error:+.1%})"
    )


def test_moe_active_params() -> None:
    mixtral = load_geometry("mixtral-8x7b")
    assert mixtral.active_param_count / 1e9 == pytest.approx(12.9, rel=0.01)
    assert mixtral.num_experts == 8 and mixtral.experts_per_token == 2
    dsv3 = load_geometry("deepseek-v3")
    assert dsv3.active_param_count / 1e9 == pytest.approx(37.0, rel=0.03)
    assert dsv3.moe_layer_count == 58  # first 3 layers dense


def test_deepseek_v3_is_mla_with_fp8_weights() -> None:
    g = load_geometry("deepseek-v3")
    assert g.mla is not None and g.mla.latent_dim == 576
    assert g.weight_bytes_per_param == 1.0  # fp8 checkpoint
    assert g.kv_bytes_per_token("fp8") == 61 * 576
    # The latent is replicated on every tensor-parallel rank, not split.
    assert g.kv_bytes_per_token(tensor_parallel_size=8) == 70272


def test_tensor_parallel_splits_kv_heads_like_vllm() -> None:
    g = load_geometry("llama-3.1-70b")
    assert g.kv_bytes_per_token(tensor_parallel_size=4) == 327680 // 4
    assert g.kv_bytes_per_token(tensor_parallel_size=8) == 327680 // 8
    # tp above the KV head count replicates heads: one per rank.
    assert g.kv_bytes_per_token(tensor_parallel_size=16) == 327680 // 8


def test_fp8_kv_cache_halves_bytes() -> None:
    g = load_geometry("llama-3.1-8b")
    assert g.kv_bytes_per_token("fp8") == 65536
    assert g.kv_bytes_per_token("fp8_e4m3") == 65536


def test_dev_model_folder_geometry(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 8192,
        **SHAPES["tiny"],
    }
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
    g = ModelGeometry.from_path(tmp_path / "tiny")
    assert g.name == "tiny"
    assert g.kv_bytes_per_token() == 1024  # 2 layers x 2 x 2 KV heads x 64 x 2 B
    assert g.blocks_from_kv_cache_bytes(64 * 2**20, 128) == 512
    # The file itself works too.
    assert ModelGeometry.from_path(tmp_path / "tiny" / "config.json").kv_bytes_per_token() == 1024


def test_real_dev_model_folder_if_present() -> None:
    folder = Path(".gpupool/models/tiny")
    if not (folder / "config.json").is_file():
        pytest.skip("dev model not made (gpupool dev-model)")
    assert load_geometry(str(folder)).kv_bytes_per_token() == 1024


def test_gemma2_interleaves_sliding_and_global_layers() -> None:
    g = load_geometry("gemma-2-9b")
    assert g.layer_kinds[:4] == ("sliding", "full", "sliding", "full")
    assert g.sliding_layer_count == 21 and g.sliding_window_tokens == 4096
    per_layer = g.kv_bytes_per_token_per_layer()
    assert per_layer == 2 * 8 * 256 * 2
    # Below the window every layer holds every token.
    assert g.kv_bytes_for_tokens(4000) == 42 * per_layer * 4000
    # Above it, sliding layers stop growing.
    assert g.kv_bytes_for_tokens(8192) == per_layer * (21 * 8192 + 21 * 4096)


def test_gemma3_nested_text_config_and_5_to_1_pattern() -> None:
    g = load_geometry("gemma-3-27b")
    assert g.model_type == "gemma3_text"
    assert g.num_layers == 62 and g.sliding_window_tokens == 1024
    assert g.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    assert g.sliding_layer_count == 52
    assert g.vocab_size == 262208  # HF default filled in
    assert g.kv_bytes_per_token() == 62 * 2 * 16 * 128 * 2


def test_blocks_for_sequence_with_sliding_layers_is_smaller() -> None:
    g = load_geometry("gemma-3-27b")
    full = blocks_for_tokens(32768, 16)
    assert g.blocks_for_sequence(32768, 16) < full
    assert g.blocks_for_sequence(512, 16) == blocks_for_tokens(512, 16)


def test_layer_types_field_wins() -> None:
    config = load_known_config("llama-3.1-8b")
    config["layer_types"] = ["sliding_attention", "full_attention"] * 16
    config["sliding_window"] = 4096
    g = ModelGeometry.from_hf_config(config)
    assert g.sliding_layer_count == 16


def test_qwen_sliding_window_ignored_unless_enabled() -> None:
    g = load_geometry("qwen2.5-7b")
    assert g.sliding_layer_count == 0 and g.sliding_window_tokens is None
    config = load_known_config("qwen2.5-7b")
    config.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    g = ModelGeometry.from_hf_config(config)
    assert g.sliding_layer_count == 8


def test_mistral_v01_sliding_window_applies_to_all_layers() -> None:
    config = load_known_config("llama-3.1-8b")
    config.update(model_type="mistral", sliding_window=4096, vocab_size=32000)
    g = ModelGeometry.from_hf_config(config)
    assert g.sliding_layer_count == 32
    assert g.kv_bytes_for_tokens(10_000) == g.kv_bytes_for_tokens(4096)


def test_qwen3_moe_family() -> None:
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    g = ModelGeometry.from_hf_config(config, name="qwen3-30b-a3b")
    assert g.param_count / 1e9 == pytest.approx(30.5, rel=0.01)
    assert g.active_param_count / 1e9 == pytest.approx(3.3, rel=0.05)
    assert g.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2


def test_missing_fields_are_named_all_at_once() -> None:
    config = load_known_config("llama-3.1-8b")
    del config["num_hidden_layers"], config["vocab_size"]
    with pytest.raises(ModelConfigError) as info:
        ModelGeometry.from_hf_config(config)
    assert info.value.missing_fields == ("num_hidden_layers", "vocab_size")
    assert "num_hidden_layers" in str(info.value) and "vocab_size" in str(info.value)


def test_mla_missing_fields() -> None:
    config = load_known_config("deepseek-v3")
    del config["kv_lora_rank"]
    with pytest.raises(ModelConfigError, match="kv_lora_rank"):
        ModelGeometry.from_hf_config(config)


def test_unknown_family_is_a_clear_error() -> None:
    with pytest.raises(ModelConfigError, match=r"unsupported model family 'mamba'") as info:
        ModelGeometry.from_hf_config({"model_type": "mamba", "hidden_size": 768})
    assert info.value.model_type == "mamba"
    with pytest.raises(ModelConfigError, match="model_type"):
        ModelGeometry.from_hf_config({"hidden_size": 768})


def test_hf_defaults_for_kv_heads_and_head_dim() -> None:
    config = load_known_config("llama-3.1-8b")
    del config["num_key_value_heads"]
    g = ModelGeometry.from_hf_config(config)
    assert g.num_kv_heads == 32 and g.head_dim == 128


def test_unknown_model_reference(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"llama-3\.1-8b"):
        load_geometry("gpt-17")
    with pytest.raises(UnknownModelError):
        ModelGeometry.from_path(tmp_path)  # folder without config.json
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError):
        ModelGeometry.from_path(tmp_path)


def test_one_rooted_error_hierarchy() -> None:
    for err in (ModelConfigError, UnknownModelError):
        assert issubclass(err, KVCacheModelError) and issubclass(err, ValueError)


def test_known_models_ship_with_the_package() -> None:
    names = known_model_names()
    for required in KNOWN_KV_BYTES_PER_TOKEN:
        assert required in names
    assert load_geometry("LLAMA-3.1-8B").name == "llama-3.1-8b"


def test_dtype_override_and_float32_checkpoints() -> None:
    config = load_known_config("llama-3.1-8b")
    config["torch_dtype"] = "float32"
    assert ModelGeometry.from_hf_config(config).dtype == "bfloat16"  # as vLLM serves it
    assert ModelGeometry.from_hf_config(config, dtype="float32").kv_bytes_per_token() == 262144
