"""Reading a Hugging Face `config.json` into a `ModelConfig`: the one place that knows each
family's spelling of the same facts (no torch: the HTTP process reads configs too)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.models.moe_config import MoeConfig
from pagedserve.models.registry import resolve_architecture
from pagedserve.models.rope_scaling import RopeScaling

if TYPE_CHECKING:
    from pagedserve.config import ModelConfig

# families whose every layer slides when the config has a `sliding_window` (and no layer_types)
_ALL_LAYERS_SLIDE = ("MistralForCausalLM", "Phi3ForCausalLM")


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a HF config dict; ValueError naming an unsupported
    architecture or setting."""
    from pagedserve.config import ModelConfig

    arch = resolve_architecture(cfg.get("architectures"))
    if arch == "Gemma3ForConditionalGeneration":  # (Gemma 3 4B and up: the text model inside)
        cfg = {**cfg["text_config"], "architectures": ["Gemma3ForCausalLM"],
               **{k: cfg[k] for k in ("eos_token_id", "bos_token_id", "_pagedserve") if k in cfg}}
        arch = "Gemma3ForCausalLM"
    gemma = arch == "Gemma3ForCausalLM"
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    extra = cfg.get("_pagedserve", {}).get("extra_eos_token_ids", [])
    eos_ids += [t for t in extra if t not in eos_ids]
    rope = _rope_dict(cfg, arch)
    sliding_rope = rope.pop("sliding_attention", None)  # Gemma 3 (Transformers 5): per layer type
    rope = rope.pop("full_attention", rope)
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 1e6 if gemma else 10000.0))
    if sliding_rope and sliding_rope.get("rope_type", "default") != "default":
        raise ValueError("RoPE scaling of the sliding-window layers is not supported yet")
    sliding_theta = (sliding_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0 if gemma else None))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"MLP activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported yet")
    partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    # Qwen2 has q/k/v biases (no flag in its config) and none on o_proj; Llama and Qwen3
    # have both or neither, as attention_bias says
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        attention_bias=qkv_bias,
        o_proj_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
        rope_scaling=RopeScaling.from_hf(rope, max_pos),
        rotary_dim=int(head_dim * partial),
        no_rope_layers=_no_rope_layers(cfg, arch, num_layers),
        sliding_windows=_sliding_windows(cfg, arch, num_layers, max_pos),
        sliding_rope_theta=None if sliding_theta is None else float(sliding_theta),
        hidden_act=act,
        embedding_multiplier=hidden**0.5 if gemma else 1.0,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        norm_round_once=gemma,
        moe=MoeConfig.from_hf(cfg, num_layers) if arch == "Qwen3MoeForCausalLM" else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(int(t) for t in eos_ids),
        hf_config=dict(cfg),
    )


def _rope_dict(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The RoPE settings: Transformers 5 nests them under rope_parameters, older configs
    under rope_scaling (with rope_theta beside). Phi-3 keeps the original context at the top
    level and calls LongRoPE "su" (or "yarn") in older configs."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type"))
    if arch == "Phi3ForCausalLM" and kind is not None:
        if kind in ("su", "yarn", "longrope"):
            rope["rope_type"] = "longrope"
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return rope


def _no_rope_layers(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Indices of the layers without RoPE: SmolLM3's `no_rope_layers` holds 1 for a layer with
    RoPE, 0 without (or, when absent there, every `no_rope_layer_interval`-th layer has none)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int, max_pos: int) -> tuple[int | None, ...]:
    """One entry per layer: the number of keys its queries see (None: all), from
    `layer_types` where the config has them, else the family's convention. A window as wide as
    the model's context is no window. Empty when no layer slides."""
    window = cfg.get("sliding_window")
    # (Gemma 3's sliding layers keep their own RoPE base, so they stay marked whatever the width)
    if not window or (int(window) >= max_pos and arch != "Gemma3ForCausalLM"):
        return ()
    window = int(window)
    layer_types = cfg.get("layer_types")
    if cfg.get("use_sliding_window") is False:  # (Qwen2, SmolLM3: the flag rules)
        return ()
    if layer_types:
        kinds = list(layer_types)
    elif arch in _ALL_LAYERS_SLIDE:
        kinds = ["sliding_attention"] * num_layers
    elif arch == "Gemma3ForCausalLM":  # (configs before layer_types: every 6th layer global)
        pattern = int(cfg.get("sliding_window_pattern", 6))
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif cfg.get("use_sliding_window"):  # Qwen2 before layer_types: layers from max_window_layers on
        first = int(cfg.get("max_window_layers", 28))
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    else:
        return ()
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    if len(windows) != num_layers:
        raise ValueError(f"layer_types has {len(windows)} entries for {num_layers} layers")
    return windows if any(windows) else ()
