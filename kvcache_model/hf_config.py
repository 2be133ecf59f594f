"""Turn a HF `config.json` (a dict) into a `ModelGeometry`.

Families: Llama, Mistral, Qwen2/Qwen3 (and their MoE variants), Mixtral, Gemma/Gemma 2/Gemma 3
(interleaved sliding-window and global layers), DeepSeek-V2/V3 (MLA). Multimodal configs whose
language model sits under `text_config` (Gemma 3) are read from there. Fields HF itself
defaults (`num_key_value_heads` = heads, `head_dim` = hidden / heads) are defaulted the same
way; any other missing field is collected and reported at once in a `ModelConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcache_model.dtypes import dtype_bytes, normalise_dtype
from kvcache_model.errors import InvalidInputError, ModelConfigError
from kvcache_model.geometry import LayerKind, MlaDims, ModelGeometry
from kvcache_model.params import MoeShape, ParamCounts, count_params

__all__ = ["SUPPORTED_MODEL_TYPES", "geometry_from_hf_config"]

_DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
_MLA = ("deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = _DENSE + _MOE + _MLA

_GEMMA = ("gemma", "gemma2", "gemma3", "gemma3_text")
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")

# HF's Gemma3TextConfig defaults: a Gemma 3 text_config may omit these.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "head_dim": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}

_MISSING = object()


@dataclass
class _Reader:
    """Reads typed fields from a config dict, collecting the names of missing ones."""

    config: dict[str, Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.config.get(key)
        if value is None:
            value = self.defaults.get(key, default)
        if value is _MISSING:
            self.missing.append(key)
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if value is _MISSING:
            return 0
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ModelConfigError(f"field {key} must be an integer, got {value!r}")
        return int(value)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if isinstance(text, dict):
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(text)
        merged["model_type"] = text.get("model_type") or config.get("model_type")
        return merged
    return config


def _model_type(config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type
    raise ModelConfigError(
        "cannot tell the model family", missing_fields=["model_type"], model_type=None
    )


def _dtype(config: dict[str, Any], override: str | None) -> str:
    raw = override or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    try:
        dtype = normalise_dtype(str(raw))
    except InvalidInputError as err:
        raise ModelConfigError(f"unsupported model dtype {raw!r}") from err
    # vLLM serves float32 checkpoints in 16 bits under `--dtype auto`.
    return "bfloat16" if dtype == "float32" and override is None else dtype


def _weight_bytes_per_param(config: dict[str, Any], dtype: str) -> float:
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return float(dtype_bytes(dtype))
    method = str(quant.get("quant_method", "")).lower()
    bits = quant.get("bits") or quant.get("w_bit")
    if isinstance(bits, int) and bits > 0:
        return bits / 8
    if method in ("fp8", "fbgemm_fp8"):
        return 1.0
    if method == "mxfp4" or quant.get("load_in_4bit"):
        return 0.5
    if quant.get("load_in_8bit"):
        return 1.0
    return float(dtype_bytes(dtype))


def _layer_kinds(
    reader: _Reader, model_type: str, num_layers: int
) -> tuple[tuple[LayerKind, ...], int | None]:
    cfg = reader.config
    window_raw = cfg.get("sliding_window")
    if model_type in ("gemma2", "gemma3", "gemma3_text"):
        window_raw = reader.get("sliding_window", 4096)
    window = int(window_raw) if isinstance(window_raw, int | float) and window_raw else None

    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) != num_layers:
            raise ModelConfigError(
                f"layer_types has {len(layer_types)} entries for {num_layers} layers",
                model_type=model_type,
            )
        kinds: list[LayerKind] = []
        for kind in layer_types:
            if kind == "full_attention":
                kinds.append("full")
            elif kind == "sliding_attention":
                kinds.append("sliding")
            else:
                raise ModelConfigError(
                    f"unsupported layer type {kind!r} (only full_attention and "
                    "sliding_attention layers have a KV model here)",
                    model_type=model_type,
                )
        if "sliding" in kinds and window is None:
            raise ModelConfigError(
                "sliding layers without a window",
                model_type=model_type,
                missing_fields=["sliding_window"],
            )
        return tuple(kinds), window if "sliding" in kinds else None

    if model_type == "gemma2":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = reader.int("sliding_window_pattern", 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif model_type in ("mistral", "mixtral"):
        sliding = [window is not None] * num_layers
    elif model_type in _QWEN and cfg.get("use_sliding_window"):
        first = reader.int("max_window_layers", num_layers)
        sliding = [window is not None and i >= first for i in range(num_layers)]
    else:
        sliding = [False] * num_layers
    kinds_t: tuple[LayerKind, ...] = tuple("sliding" if s else "full" for s in sliding)
    return kinds_t, window if any(sliding) else None


def _moe_shape(reader: _Reader, model_type: str, num_layers: int) -> MoeShape | None:
    if model_type == "mixtral":
        experts = reader.int("num_local_experts")
        return MoeShape(
            num_experts=experts,
            experts_per_token=reader.int("num_experts_per_tok"),
            expert_intermediate_size=reader.int("intermediate_size"),
            shared_intermediate_size=0,
            sparse_layers=tuple(range(num_layers)),
        )
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = reader.int("decoder_sparse_step", 1) or 1
        dense_only = set(reader.get("mlp_only_layers", []) or [])
        shared = (
            reader.int("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        )
        return MoeShape(
            num_experts=reader.int("num_experts"),
            experts_per_token=reader.int("num_experts_per_tok"),
            expert_intermediate_size=reader.int("moe_intermediate_size"),
            shared_intermediate_size=shared,
            sparse_layers=tuple(
                i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense_only
            ),
            shared_gate=shared > 0,
        )
    if model_type in _MLA:
        routed = reader.int("n_routed_experts", 0)
        if routed == 0:
            return None  # DeepSeek-V2-style dense checkpoints
        first_dense = reader.int("first_k_dense_replace", 0)
        freq = reader.int("moe_layer_freq", 1) or 1
        expert_i = reader.int("moe_intermediate_size")
        return MoeShape(
            num_experts=routed,
            experts_per_token=reader.int("num_experts_per_tok"),
            expert_intermediate_size=expert_i,
            shared_intermediate_size=reader.int("n_shared_experts", 0) * expert_i,
            sparse_layers=tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0),
        )
    return None


def _mla_dims(reader: _Reader) -> MlaDims:
    q_lora = reader.config.get("q_lora_rank")
    return MlaDims(
        kv_lora_rank=reader.int("kv_lora_rank"),
        qk_rope_head_dim=reader.int("qk_rope_head_dim"),
        qk_nope_head_dim=reader.int("qk_nope_head_dim"),
        v_head_dim=reader.int("v_head_dim"),
        q_lora_rank=int(q_lora) if isinstance(q_lora, int) and q_lora > 0 else None,
    )


def geometry_from_hf_config(
    config: dict[str, Any], *, name: str | None = None, dtype: str | None = None
) -> ModelGeometry:
    """`ModelGeometry` of a HF config dict; `ModelConfigError` names what is missing."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"a HF config is a JSON object, got {type(config).__name__}")
    cfg = _text_config(config)
    model_type = _model_type(cfg)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"unsupported model family {model_type!r} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})",
            model_type=model_type,
        )
    reader = _Reader(cfg, dict(_GEMMA3_DEFAULTS) if model_type in ("gemma3", "gemma3_text") else {})
    num_layers = reader.int("num_hidden_layers")
    hidden = reader.int("hidden_size")
    heads = reader.int("num_attention_heads")
    vocab = reader.int("vocab_size")
    max_context = reader.int("max_position_embeddings")
    intermediate = reader.int("intermediate_size", 0 if model_type in ("qwen3_moe",) else _MISSING)
    kv_heads = reader.int("num_key_value_heads", heads)
    head_dim_default = 256 if model_type in _GEMMA else (hidden // heads if heads else 0)
    head_dim = reader.int("head_dim", head_dim_default)
    mla = _mla_dims(reader) if model_type in _MLA else None
    moe = _moe_shape(reader, model_type, num_layers)
    if reader.missing:
        raise ModelConfigError(
            f"config of {name or model_type!r} ({model_type}) is incomplete",
            model_type=model_type,
            missing_fields=sorted(set(reader.missing)),
        )
    kinds, window = _layer_kinds(reader, model_type, num_layers)
    if reader.missing:
        raise ModelConfigError(
            f"config of {name or model_type!r} ({model_type}) is incomplete",
            model_type=model_type,
            missing_fields=sorted(set(reader.missing)),
        )
    tied_default = model_type in _GEMMA
    counts: ParamCounts = count_params(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias")),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or model_type in ("gemma3", "gemma3_text"),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
        mla=mla,
        moe=moe,
    )
    model_dtype = _dtype(cfg, dtype)
    return ModelGeometry(
        name=name or str(cfg.get("_name_or_path") or model_type),
        model_type=model_type,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=heads if mla is not None else kv_heads,
        head_dim=head_dim if mla is None else mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        param_count=counts.total,
        active_param_count=counts.active,
        matmul_param_count=counts.matmul,
        dtype=model_dtype,
        weight_bytes_per_param=_weight_bytes_per_param(cfg, model_dtype),
        max_context_tokens=max_context,
        layer_kinds=kinds,
        sliding_window_tokens=window,
        mla=mla,
        num_experts=moe.num_experts if moe else 0,
        experts_per_token=moe.experts_per_token if moe else 0,
        moe_layer_count=len(moe.sparse_layers) if moe else 0,
        expert_param_count=moe.expert_params(hidden) if moe else 0,
    )
