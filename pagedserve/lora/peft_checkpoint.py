"""A PEFT LoRA adapter folder read and checked against the base model, without torch.

The HTTP server checks an adapter here before it names it to the engine (its process stays
free of torch), and the engine core checks it again before a request runs under it: a bad
adapter is refused with a message naming the problem (a missing file, a rank over the limit,
a module the model does not have or that is not supported, shapes of another base model),
never found out mid-step. The worker loads the tensors the manifest lists (`weights.py`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target: PEFT's module name -> (our layer's path, shard id)
TARGETS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>A|B|embedding_A|embedding_B)"
                     r"(?:\.[A-Za-z0-9_-]+)?\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>[a-z_]+)$")


class AdapterError(ValueError):
    """An adapter that cannot be served, with the reason."""


@dataclass(frozen=True)
class AdapterTarget:
    """One adapted projection: PEFT's tensors for it and where their product goes."""

    layer: int
    module: str  # our layer's path inside the decoder layer, e.g. "self_attn.qkv_proj"
    shard: str | None  # the shard of a fused projection ("q", "gate", ...), None for a plain one
    a_name: str  # [r, in_features] in the safetensors file
    b_name: str  # [out_features, r]


@dataclass(frozen=True)
class AdapterManifest:
    """What `read_adapter` found: rank, scale (lora_alpha / r, or / sqrt(r) with rsLoRA) and
    the adapted projections."""

    path: str
    rank: int
    scale: float
    targets: tuple[AdapterTarget, ...]


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module -> (out_features, in_features) of the base model's projection."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def safetensors_header(path: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} of a .safetensors file (its JSON header)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise AdapterError(f"{path} is not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise AdapterError(f"{path} is not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


def _read_config(folder: Path) -> dict:
    cfg_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter folder {str(folder)!r} does not exist")
    if not cfg_path.is_file():
        raise AdapterError(f"LoRA adapter {str(folder)!r} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise AdapterError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config; AdapterError for what is not supported."""
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not supported (only LORA)")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained modules)"),
                     ("rank_pattern", "rank_pattern (per-module ranks)"),
                     ("alpha_pattern", "alpha_pattern (per-module alphas)")):
        if cfg.get(key):
            raise AdapterError(f"{where}: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: r must be a whole number >= 1, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} exceeds max_lora_rank={max_rank} (raise --max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def read_adapter(path: str, model: ModelConfig, max_rank: int) -> AdapterManifest:
    """Read and check the adapter folder `path` for `model`; AdapterError names the problem."""
    folder = Path(path).expanduser()
    cfg = _read_config(folder)
    where = f"LoRA adapter {path!r}"
    rank, scale = _check_config(cfg, where, max_rank)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = " (adapter_model.bin is not supported: save with safe_serialization)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"{where} has no {WEIGHTS_FILE}{other}")
    header = safetensors_header(weights)
    pairs: dict[str, dict[str, str]] = {}
    for name in header:
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(f"{where}: tensor {name!r} is not a LoRA A/B weight")
        if m["ab"].startswith("embedding") or m["module"].endswith(("embed_tokens", "lm_head")):
            raise AdapterError(f"{where}: adapters on {m['module']!r} (embeddings / lm_head) are not supported")
        pairs.setdefault(m["module"], {})[m["ab"]] = name
    if not pairs:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    shapes = _shapes(model)
    targets = []
    for module, ab in sorted(pairs.items()):
        lm = _LAYER.match(module)
        proj = lm["proj"] if lm else None
        if lm is None or proj not in TARGETS or not TARGETS[proj][0].startswith(lm["block"]):
            raise AdapterError(f"{where}: module {module!r} is not one the model has or LoRA supports "
                               f"(supported: {', '.join(TARGETS)} of model.layers.N)")
        layer = int(lm["layer"])
        if layer >= model.num_layers:
            raise AdapterError(f"{where}: module {module!r}: the model has {model.num_layers} layers")
        if lm["block"] == "mlp" and model.moe is not None:
            raise AdapterError(f"{where}: module {module!r}: adapters on a mixture-of-experts MLP are not supported")
        if proj in ("q_proj", "k_proj") and model.partial_rotation:
            raise AdapterError(f"{where}: module {module!r}: q/k adapters on a partial-rotation model are not supported")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: module {module!r} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        out_f, in_f = shapes[proj]
        a_shape, b_shape = header[ab["A"]]["shape"], header[ab["B"]]["shape"]
        if a_shape != [rank, in_f] or b_shape != [out_f, rank]:
            raise AdapterError(
                f"{where}: module {module!r} has lora_A {a_shape} and lora_B {b_shape}; this model "
                f"needs [{rank}, {in_f}] and [{out_f}, {rank}] (an adapter of another base model?)")
        module_path, shard = TARGETS[proj]
        targets.append(AdapterTarget(layer, module_path, shard, ab["A"], ab["B"]))
    return AdapterManifest(str(folder), rank, float(scale), tuple(targets))
