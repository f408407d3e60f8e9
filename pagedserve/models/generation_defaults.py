"""Defaults for the sampling fields a request leaves out, from the model's
generation_config.json, as vLLM's `--generation-config` (torch-free)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from pagedserve.models import presets
from pagedserve.models.source import ModelSource

# generation_config.json key -> SamplingParams field (the keys vLLM takes from it)
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(source: ModelSource, mode: str = "auto") -> dict[str, float | int]:
    """SamplingParams field -> default. `mode`: "auto" (the model's generation_config.json, or
    the real model's for a preset), "vllm" (no defaults: pagedserve's and OpenAI's own) or a
    folder holding a generation_config.json. ValueError for a folder without one."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        return _from_dict(_model_generation_config(source))
    path = Path(mode).expanduser() / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"--generation-config {mode}: no generation_config.json there "
                         "(give auto, vllm or a folder that holds one)")
    return _from_dict(_read(path))


def _model_generation_config(source: ModelSource) -> dict:
    if source.embedded:  # (its GGUF carries none: pagedserve's measured choice, models/embedded/)
        from pagedserve.models.source import embedded_file

        return json.loads(embedded_file("generation_config.json"))
    if source.folder is not None and (source.folder / "generation_config.json").is_file():
        return _read(source.folder / "generation_config.json")
    if source.is_preset:
        name = f"presets/{presets.canonical_name(source.name)}.generation_config.json"
        file = resources.files("pagedserve.models").joinpath(name)
        if file.is_file():
            return json.loads(file.read_text())
    return {}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _from_dict(cfg: dict) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for key, field in _FIELDS.items():
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return out
