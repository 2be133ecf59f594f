"""Model references: a shipped known model by name, or a `config.json` path.

The only I/O in `kvcache_model`: reading one JSON config (a package data file or the path the
caller named). `load_geometry("llama-3.1-8b")`, `load_geometry("./.gpupool/models/tiny")`.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from kvcache_model.errors import ModelConfigError, UnknownModelError
from kvcache_model.geometry import ModelGeometry

__all__ = ["known_model_names", "load_geometry", "load_known_config", "read_config_file"]

_PACKAGE = "kvcache_model.known_models"


def known_model_names() -> tuple[str, ...]:
    """Names of the models whose config ships with the package, sorted."""
    files = resources.files(_PACKAGE).iterdir()
    return tuple(sorted(f.name[: -len(".json")] for f in files if f.name.endswith(".json")))


def load_known_config(name: str) -> dict[str, Any]:
    """The shipped HF config of known model `name` (case-insensitive)."""
    key = name.strip().lower()
    if key not in known_model_names():
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(known_model_names())}"
        )
    text = resources.files(_PACKAGE).joinpath(f"{key}.json").read_text(encoding="utf-8")
    config: dict[str, Any] = json.loads(text)
    return config


def read_config_file(path: str | Path) -> tuple[dict[str, Any], str]:
    """(config dict, model name) from a model folder with `config.json`, or the file itself."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise UnknownModelError(f"no model config at {file}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelConfigError(f"cannot read {file}: {err}") from err
    if not isinstance(config, dict):
        raise ModelConfigError(f"{file} is not a JSON object")
    name = file.parent.name if file.name == "config.json" else file.stem
    return config, name


def load_geometry(name_or_path: str | Path, *, dtype: str | None = None) -> ModelGeometry:
    """Geometry of a known model name, else of the config at that path."""
    if isinstance(name_or_path, str) and name_or_path.strip().lower() in known_model_names():
        key = name_or_path.strip().lower()
        return ModelGeometry.from_hf_config(load_known_config(key), name=key, dtype=dtype)
    p = Path(name_or_path).expanduser()
    if not p.exists():
        raise UnknownModelError(
            f"{str(name_or_path)!r} is neither a known model ({', '.join(known_model_names())}) "
            "nor an existing path"
        )
    return ModelGeometry.from_path(p, dtype=dtype)
