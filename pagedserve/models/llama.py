"""One decoder for the Llama family: Llama (SmolLM2, Nanbeige) and Qwen3 (q/k RMSNorm).

The model works on a flattened batch of tokens (no padding, no batch dimension) and
delegates attention, including the KV-cache write, to an attention backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagedserve.attention.backend import AttentionContext
from pagedserve.config import ModelConfig
from pagedserve.layers.activation import silu_and_mul
from pagedserve.layers.linear import Linear, SkinnyPlan, matmul
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # q, k and v projections fused into one matmul: rows [q | k | v].
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        attn: AttentionContext,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        target = None
        if qkv.is_cuda:  # one kernel: split, per-head q/k norm (Qwen3), RoPE, KV-cache write
            from pagedserve.kernels.rope import qk_norm_rope

            target = attn.backend.kv_store_target(self.layer_idx, attn.meta)
            q, k, v = qk_norm_rope(
                qkv, positions, rotary.inv_freq, self.num_heads, self.num_kv_heads, self.head_dim,
                self.q_norm.weight if self.qk_norm else None,
                self.k_norm.weight if self.qk_norm else None,
                self.q_norm.eps if self.qk_norm else 0.0,
                kv_cache=target[0] if target else None, slot_mapping=target[1] if target else None,
            )
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
            k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = rotary.cos_sin(positions, q.dtype)
            q = RotaryEmbedding.apply(q, cos, sin)
            k = RotaryEmbedding.apply(k, cos, sin)
        out = attn.backend.forward(self.layer_idx, q, k, v, attn.meta, kv_stored=target is not None)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections fused: rows [gate | up].
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the previous layer's output
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before adding h
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a flattened token batch.

    forward(input_ids [T], positions [T], attn) -> hidden states [T, hidden];
    compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab].
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_plan: SkinnyPlan | None = None  # see layers.linear.plan_model_matmuls

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.rotary, attn)
        h, _ = self.norm(h, residual)
        return h

    @contextmanager
    def first_layers_only(self, n: int = 2) -> Iterator[None]:
        """For start-up rehearsals (`kernels/compile_ahead.py`): forward runs the first n
        decoder layers only. Later layers launch the same kernel variants as the second (the
        first alone has no residual to add), so a rehearsal needs no more."""
        layers = self.layers
        self.layers = layers[:n]
        try:
            yield
        finally:
            self.layers = layers

    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the output projection (the input embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return matmul(hidden, self.logits_weight(), self.logits_plan).float()  # [N, vocab]

    # ---- weight loading -------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters.

        Raises ValueError naming any parameter that no tensor filled, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # param name -> number of shards written
        for hf_name, tensor in weights:
            target = _map_hf_name(hf_name, self.config)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                if name == "lm_head.weight":  # tied models may ship a copy of the embedding
                    continue
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param = params[name]
            dst = param.data if shard is None else param.data.narrow(0, shard[0], shard[1])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor.to(dst.dtype))
            filled[name] = filled.get(name, 0) + 1
        missing = []
        for name in params:
            need = _num_shards(name)
            if filled.get(name, 0) < need:
                missing.append(name)
        if missing:
            raise ValueError(
                f"checkpoint is missing weight tensors for: {', '.join(_hf_names(m) for m in missing[:8])}"
                + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            )


def _num_shards(param_name: str) -> int:
    if param_name.endswith("qkv_proj.weight") or param_name.endswith("qkv_proj.bias"):
        return 3
    if param_name.endswith("gate_up_proj.weight"):
        return 2
    return 1


def _hf_names(param_name: str) -> str:
    """The HF tensor name(s) a pagedserve parameter is filled from (for error messages)."""
    name = param_name
    if name.startswith("layers.") or name.startswith("embed_tokens") or name.startswith("norm"):
        name = "model." + name
    name = name.replace("qkv_proj", "{q,k,v}_proj").replace("gate_up_proj", "{gate,up}_proj")
    return name


def _map_hf_name(hf_name: str, cfg: ModelConfig) -> tuple[str, tuple[int, int] | None] | None:
    """HF tensor name -> (our parameter name, (row offset, rows) into a fused param or None)."""
    if "rotary_emb" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", (q, kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", (q + kv, kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", (inter, inter)),
    }
    for part, (new, shard) in fused.items():
        if f".{part}." in name:
            return name.replace(part, new), shard
    return name, None
