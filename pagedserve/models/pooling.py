"""Which runner a model gets: generation, or pooling (embeddings, cross-encoder scores).

`--runner`/`--convert`/`--pooler-config` (vLLM's names) decide; with `--runner auto` the
checkpoint does: a sentence-transformers folder (`modules.json`, `1_Pooling/config.json`:
the pooling mode, and a Normalize module) is an embedder, a Qwen3-Reranker (its name) a
scorer, a preset says so in its `_pagedserve.pooler`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.models.source import ModelSource
from pagedserve.pooling_params import POOLING_TYPES, PoolerConfig

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "score")
# sentence-transformers' 1_Pooling/config.json keys -> our pooling types
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def detect_pooler(source: ModelSource) -> PoolerConfig | None:
    """The pooling the checkpoint describes, or None (a generation model)."""
    preset = source.hf_config.get("_pagedserve", {}).get("pooler")
    if preset is not None:
        return PoolerConfig(**preset)
    folder = source.folder
    if folder is not None and (folder / "modules.json").is_file():
        return _sentence_transformers(folder)
    names = [source.name, *(source.hf_config.get("architectures") or [])]
    if any("reranker" in n.lower() for n in names if n):
        return PoolerConfig("score", "last", False)
    return None


def _sentence_transformers(folder: Path) -> PoolerConfig:
    modules = json.loads((folder / "modules.json").read_text())
    pooling_type, normalize = "last", False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            cfg = json.loads((folder / m.get("path", "1_Pooling") / "config.json").read_text())
            modes = [ours for key, ours in _ST_MODES.items() if cfg.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{folder}: sentence-transformers pooling {cfg} is not one of "
                                 f"{sorted(_ST_MODES)}; give --pooler-config '{{\"pooling_type\": ...}}'")
            pooling_type = modes[0]
        elif kind.endswith("Normalize"):
            normalize = True
        elif not kind.endswith("Transformer"):
            raise ValueError(f"{folder}: sentence-transformers module {kind!r} is not supported "
                             "(only Transformer, Pooling and Normalize)")
    return PoolerConfig("embed", pooling_type, normalize)


def resolve_pooler(runner: str, convert: str, pooler_config: dict | str | None,
                   detected: PoolerConfig | None) -> PoolerConfig | None:
    """The pooler the settings and the checkpoint give (None: generate); ValueError names a bad
    setting."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    overrides = parse_pooler_overrides(pooler_config)
    pooling = runner == "pooling" or convert in ("embed", "score") or (runner == "auto" and detected is not None)
    if runner == "generate" and (convert in ("embed", "score") or overrides):
        raise ValueError("--runner generate takes no --convert embed/score or --pooler-config; "
                         "use --runner pooling")
    if not pooling:
        if overrides:
            raise ValueError("--pooler-config applies to a pooling model: add --runner pooling")
        return None
    base = detected or PoolerConfig("embed", "last", True)
    task = convert if convert in ("embed", "score") else base.task
    if task != base.task:  # (a scorer scores the last token, unnormalised; an embedder: as detected)
        base = PoolerConfig(task, "last", task == "embed")
    return PoolerConfig(task, overrides.get("pooling_type", base.pooling_type),
                        overrides.get("normalize", base.normalize))


def parse_pooler_overrides(value: dict | str | None) -> dict[str, Any]:
    """vLLM's --pooler-config JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool}."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--pooler-config is not valid JSON ({e}); e.g. "
                             "'{\"pooling_type\": \"MEAN\", \"normalize\": true}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"--pooler-config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"--pooler-config: unknown key(s) {unknown}; it takes pooling_type and normalize")
    out: dict[str, Any] = {}
    if "pooling_type" in value:
        kind = str(value["pooling_type"]).lower()
        if kind not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of "
                             f"{[t.upper() for t in POOLING_TYPES]}, got {value['pooling_type']!r}")
        out["pooling_type"] = kind
    if "normalize" in value:
        if not isinstance(value["normalize"], bool):
            raise ValueError(f"--pooler-config: normalize must be true or false, got {value['normalize']!r}")
        out["normalize"] = value["normalize"]
    return out
