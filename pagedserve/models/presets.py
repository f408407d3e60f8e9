"""Preset models shipped as config facts (HF `config.json` dicts in presets/*.json)."""

from __future__ import annotations

import json
from importlib import resources

PRESET_NAMES = ("qwen3-4b-instruct-2507", "nanbeige4.1-3b", "smollm2-135m-instruct", "qwen3-0.6b", "qwen3-30b-a3b",
                "llama-3.2-3b-instruct", "qwen3-embedding-0.6b", "qwen3-embedding-4b", "qwen3-reranker-0.6b",
                "qwen3-reranker-4b")

_ALIASES = {
    "qwen/qwen3-4b-instruct-2507": "qwen3-4b-instruct-2507",
    "nanbeige/nanbeige4.1-3b": "nanbeige4.1-3b",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
    "qwen/qwen3-30b-a3b-instruct-2507": "qwen3-30b-a3b",
    "meta-llama/llama-3.2-3b-instruct": "llama-3.2-3b-instruct",
    "qwen/qwen3-embedding-0.6b": "qwen3-embedding-0.6b",
    "qwen/qwen3-embedding-4b": "qwen3-embedding-4b",
    "qwen/qwen3-reranker-0.6b": "qwen3-reranker-0.6b",
    "qwen/qwen3-reranker-4b": "qwen3-reranker-4b",
}


def canonical_name(name: str) -> str:
    key = name.lower()
    return _ALIASES.get(key, key)


def is_preset(name: str) -> bool:
    return canonical_name(name) in PRESET_NAMES


def load_preset(name: str) -> dict:
    """The preset's HF-style config dict; ValueError for an unknown name."""
    key = canonical_name(name)
    if key not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    text = resources.files("pagedserve.models").joinpath(f"presets/{key}.json").read_text()
    return json.loads(text)
