"""Read a llama.cpp GGUF checkpoint as a Hugging Face config dict plus HF-named fp32 tensors.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with `gguf.quants.dequantize`, so the
result is an ordinary float model. llama.cpp's converter reorders the rows of the Q and K
projections of `llama` checkpoints for its RoPE kernel; `read_gguf` undoes that, so the
tensors match what `transformers` would load from the original HF checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF `general.architecture` -> (HF `architectures` entry, HF `model_type`).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# llama.cpp per-layer tensor name -> HF name (inside `model.layers.N.`).
_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file that cannot be read: corrupt, truncated, or of an unsupported kind."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """Map a llama.cpp tensor name (`blk.3.attn_q.weight`) to its HF name, or None if unknown."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None or kind not in ("weight", "bias") else f"{hf}.{kind}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for the `llama` architecture.

    HF orders each head's rows as [first half | second half] of the rotary pairs
    (rotate_half); llama.cpp interleaves them as (x0, y0, x1, y1, ...). So a head's rows
    are stored as [head_dim/2, 2] and we transpose them back to [2, head_dim/2].
    w: [n_heads * head_dim, ...] (weight [rows, in] or bias [rows]) -> same shape.
    """
    rows, rest = w.shape[0], w.shape[1:]
    if rows % (2 * n_heads):
        raise GGUFError(f"Q/K projection with {rows} rows cannot be split into {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _read_metadata(reader: Any) -> dict[str, Any]:
    """Scalar, string and short-array fields of a GGUFReader as plain Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(field.data) > 16:
            continue  # vocab, merges, scores: large and not needed for the config
        try:
            out[key] = field.contents()
        except Exception:  # unusual field types are not needed for the config
            continue
    return out


def _f32(value: float) -> float:
    """GGUF stores floats as float32; give back the shortest decimal (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _hf_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r}; pagedserve can read GGUF files of "
            f"architectures: {supported}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks the required key {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(embd.shape[-1]),  # GGUF dims are [hidden, vocab]
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        if (tid := meta.get(f"tokenizer.ggml.{gguf_key}")) is not None:
            cfg[hf_key] = int(tid)
    return cfg


def read_gguf(path: str | Path) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """Open a GGUF checkpoint: (HF config dict, iterator of (HF name, fp32 tensor, HF layout)).

    The header is parsed and every tensor name checked eagerly; tensors are dequantized
    lazily as the iterator advances. Raises GGUFError (a ValueError) for a corrupt or
    truncated file, an unsupported architecture, or a tensor with no HF equivalent.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise GGUFError(
            f"{path} is not a readable GGUF file ({path.stat().st_size} bytes); it is corrupt "
            f"or truncated: {type(e).__name__}: {e}"
        ) from e
    tensors = {t.name: t for t in reader.tensors}
    cfg = _hf_config(_read_metadata(reader), tensors)
    names: list[tuple[str, str]] = []  # (gguf name, hf name)
    for name in tensors:
        hf = hf_tensor_name(name)
        if hf is None:
            raise GGUFError(f"GGUF tensor {name!r} has no Hugging Face equivalent in pagedserve")
        names.append((name, hf))
    permute = cfg["model_type"] == "llama"
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}

    def tensors_iter() -> Iterator[tuple[str, torch.Tensor]]:
        for name, hf in names:
            t = tensors[name]
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise GGUFError(f"tensor {name}: {e}") from e
            # numpy order is the GGUF dims reversed, which is HF's [out, in] layout.
            arr = np.asarray(arr, dtype=np.float32)
            proj = hf.split(".")[-2]
            if permute and proj in heads:
                arr = unpermute_rope_rows(arr, heads[proj])
            # Own, writable, contiguous memory (F32 tensors are views into the mmap).
            yield hf, torch.from_numpy(np.require(arr, np.float32, ["C", "W", "O"]))

    return cfg, tensors_iter()
