"""The one exception hierarchy of `kvcache_model`.

    KVCacheModelError            root: catch this to catch anything the package raises
    ├── ModelConfigError         a config.json this package cannot turn into a geometry
    ├── UnknownModelError        neither a known model name nor a readable config path
    ├── UnknownGPUError          a GPU name missing from the spec table
    └── InvalidInputError        an argument out of its domain (negative tokens, tp=0, ...)

Each is also a `ValueError`, so callers that only know the builtin still catch it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "InvalidInputError",
    "KVCacheModelError",
    "ModelConfigError",
    "UnknownGPUError",
    "UnknownModelError",
]


class KVCacheModelError(ValueError):
    """Root of every error `kvcache_model` raises."""


class ModelConfigError(KVCacheModelError):
    """A HF config that is unsupported or incomplete; names the family and the missing fields."""

    def __init__(
        self,
        message: str,
        *,
        model_type: str | None = None,
        missing_fields: Sequence[str] = (),
    ) -> None:
        self.model_type = model_type
        self.missing_fields = tuple(missing_fields)
        if self.missing_fields:
            message = f"{message}: missing fields {', '.join(self.missing_fields)}"
        super().__init__(message)


class UnknownModelError(KVCacheModelError):
    """A model reference that is neither a shipped known model nor a config path."""


class UnknownGPUError(KVCacheModelError):
    """A GPU name the spec table does not know."""


class InvalidInputError(KVCacheModelError):
    """An argument outside its domain."""
