"""Byte widths of the dtypes a model's weights and KV cache are stored in.

`dtype_bytes("bfloat16") == 2`; KV cache dtype `"auto"` means "the model's dtype", and every
`fp8*` spelling vLLM accepts is one byte.
"""

from __future__ import annotations

from kvcache_model.errors import InvalidInputError

__all__ = ["dtype_bytes", "kv_cache_dtype_bytes", "normalise_dtype"]

_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "fp8_inc": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


def normalise_dtype(name: str) -> str:
    """Canonical dtype name (`bfloat16`, `float16`, `float32`, `fp8`) for a spelling of one."""
    key = name.strip().lower().removeprefix("torch.")
    try:
        return _ALIASES[key]
    except KeyError:
        raise InvalidInputError(
            f"unknown dtype {name!r}; expected one of {', '.join(sorted(_ALIASES))}"
        ) from None


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype `name`."""
    return _BYTES[normalise_dtype(name)]


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV element for vLLM's `--kv-cache-dtype` (`auto` = the model's dtype)."""
    if kv_cache_dtype.strip().lower() == "auto":
        return dtype_bytes(model_dtype)
    return dtype_bytes(kv_cache_dtype)
