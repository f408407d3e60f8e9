"""One decoder for the Llama family: Llama (SmolLM2, Nanbeige) and Qwen3 (q/k RMSNorm).

The model works on a flattened batch of tokens (no padding, no batch dimension) and
delegates attention, including the KV-cache write, to an attention backend.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagedserve.attention.backend import AttentionContext
from pagedserve.config import ModelConfig
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.activation import ACTIVATIONS
from pagedserve.layers.embedding import VocabEmbedding
from pagedserve.layers.linear import Linear, MergedLinear
from pagedserve.layers.linear_method import LinearMethod
from pagedserve.layers.lm_head import LMHead
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, partial_rotary_order
from pagedserve.layers.skinny import SkinnyPlan
from pagedserve.layers.weight_utils import ShapeMismatchError, default_weight_loader, param_shards

# Checkpoint (HF) name part -> (our fused parameter's name part, shard id): the separate q/k/v
# and gate/up projections of a checkpoint fill rows of our fused qkv_proj and gate_up_proj.
STACKED_PARAMS: dict[str, tuple[str, str]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
# A checkpoint that ships them fused (Phi-3/Phi-4): its tensor's rows split into these shards.
FUSED_CHECKPOINT_PARAMS = ("self_attn.qkv_proj", "mlp.gate_up_proj")


class Attention(nn.Module):
    """This rank's attention heads (all of them at one rank): q/k/v column-parallel by head,
    o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = tp.split(cfg.num_heads, "the attention heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "the KV heads")
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn"
        # q, k and v projections fused into one matmul: rows [q | k | v].
        self.qkv_proj = MergedLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size],
                                     ("q", "k", "v"), bias=cfg.attention_bias,
                                     linear_method=_method_for(linear_method, prefix, "q_proj", "k_proj", "v_proj"),
                                     tp=tp, parallel="column")
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias,
                             linear_method=_method_for(linear_method, prefix, "o_proj"), tp=tp, parallel="row")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, round_once=cfg.norm_round_once)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, round_once=cfg.norm_round_once)

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
                kv_scale=target[2] if target else None, norm_round_once=self.qk_norm and self.q_norm.round_once,
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
    def __init__(self, cfg: ModelConfig, linear_method: LinearMethod | None = None, layer_idx: int = 0,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.mlp"
        # gate and up projections fused: rows [gate | up] (this rank's share of each).
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, ("gate", "up"), bias=False,
                                         linear_method=_method_for(linear_method, prefix, "gate_proj", "up_proj"),
                                         tp=tp, parallel="column")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False,
                                linear_method=_method_for(linear_method, prefix, "down_proj"), tp=tp, parallel="row")
        self.act_and_mul = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, round_once=cfg.norm_round_once)
        self.self_attn = Attention(cfg, layer_idx, linear_method, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, round_once=cfg.norm_round_once)
        self.mlp = MLP(cfg, linear_method, layer_idx, tp)

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
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] in the model's dtype (float32 with
    a logit softcap).
    `linear_method` sets the weight format of every decoder projection (default: unquantized).
    `tp`: this process's place among tensor-parallel ranks (`distributed/tensor_parallel.py`;
    each holds its share of the heads, features and vocabulary, the logits come out whole).
    """

    layer_class: type[nn.Module] = DecoderLayer  # (a family with another layer structure overrides it)

    def __init__(self, cfg: ModelConfig, linear_method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, linear_method, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, round_once=cfg.norm_round_once)
        # max_model_len: the served context (LongRoPE's choice of factors); the model's own by default
        served = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, rotary_dim=cfg.rotary_dim,
                                      max_model_len=served)
        # layers without RoPE (SmolLM3) rotate by zero frequencies, on every path alike
        self.no_rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, enabled=False) if cfg.no_rope_layers else None
        # sliding-window layers with a RoPE base of their own (Gemma 3)
        local = cfg.sliding_rope_theta is not None and any(cfg.sliding_windows)
        self.sliding_rotary = RotaryEmbedding(cfg.head_dim, cfg.sliding_rope_theta, rotary_dim=cfg.rotary_dim) if local else None
        self.layer_rotary = [self.no_rope if i in cfg.no_rope_layers
                             else self.sliding_rotary if local and cfg.sliding_windows[i] else self.rotary
                             for i in range(cfg.num_layers)]
        # Gemma scales its embeddings by sqrt(hidden), rounded to the model's dtype (as Transformers)
        self.embedding_multiplier = float(torch.tensor(cfg.embedding_multiplier, dtype=torch.get_default_dtype(), device="cpu"))
        # tied: no parameter of its own (no `lm_head.weight`); it multiplies by embed_tokens'
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tie_to=self.embed_tokens if cfg.tie_word_embeddings else None, tp=tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        residual = None
        for layer, rotary in zip(self.layers, self.layer_rotary, strict=False):  # (fewer: first_layers_only)
            h, residual = layer(h, residual, positions, rotary, attn)
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

    @property
    def logits_plan(self) -> SkinnyPlan | None:
        """The logits matmul's small-batch plan (held by `lm_head`; see
        `layers.linear.plan_model_matmuls`)."""
        return self.lm_head.skinny_plan

    @logits_plan.setter
    def logits_plan(self, plan: SkinnyPlan | None) -> None:
        self.lm_head.skinny_plan = plan

    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the output projection (the input embedding when tied)."""
        return self.lm_head.logits_weight()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)  # [N, hidden] -> [N, vocab], the model's dtype
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits.float() / cap) * cap  # (float32)

    # ---- weight loading -------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters, each through its `weight_loader`
        (q/k/v and gate/up as shards of the fused projections, see STACKED_PARAMS), then let
        each layer's linear method process its weights.

        Raises ValueError naming a checkpoint tensor with no place in the model or of the
        wrong shape, or the HF tensors of any parameter (or shard) that none filled.
        """
        own = self.self_loading_modules()  # (HF name prefix -> module that places its tensors)
        params = {n: p for n, p in self.named_parameters() if not any(("model." + n).startswith(o) for o in own)}
        filled: dict[str, set[Hashable | None]] = {}  # param name -> shard ids written
        for hf_name, tensor in self._checkpoint_layout(weights):
            if "rotary_emb" in hf_name:
                continue
            prefix = next((o for o in own if hf_name.startswith(o)), None)
            if prefix is not None:
                try:
                    own[prefix].load_checkpoint_tensor(hf_name.removeprefix(prefix), tensor)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {hf_name!r}: {e}") from e
                continue
            name, shard_id = _param_name(hf_name)
            param = params.get(name)
            if param is None:
                if name == "lm_head.weight":  # tied models may ship a copy of the embedding
                    continue
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ShapeMismatchError as e:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {e.got}, expected {e.expected}"
                ) from e
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {hf_name!r}: {e}") from e
            shards = filled.setdefault(name, set())
            shards.update(param_shards(param) if shard_id is None else (shard_id,))
        missing = []
        for name, param in params.items():
            want = param_shards(param)
            got = filled.get(name, set())
            if not got.issuperset(want):
                lacking = [s for s in want if s not in got]
                partly = f" (no {', '.join(map(str, lacking))})" if got else ""
                missing.append(_hf_names(name) + partly)
        missing += [prefix + m for prefix, module in own.items() for m in module.missing_weights()]
        if missing:
            raise ValueError(
                f"checkpoint is missing weight tensors for: {', '.join(missing[:8])}"
                + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            )
        self.process_weights_after_loading()

    def self_loading_modules(self) -> dict[str, nn.Module]:
        """Modules that place their own checkpoint tensors, by HF name prefix (ending in "."):
        each has load_checkpoint_tensor(name after the prefix, tensor) and missing_weights()
        (names after the prefix none filled). None here; a family with such parts overrides it."""
        return {}

    def _checkpoint_layout(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as `load_weights` places them: a fused qkv_proj or
        gate_up_proj (Phi-3/Phi-4) split into its q/k/v or gate/up parts; with a partial
        rotation, q's and k's rows reordered within each head (`partial_rotary_order`)."""
        cfg = self.config
        order = rows_scale = None
        if cfg.partial_rotation:
            order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
            factor = cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0
            rows_scale = torch.ones(cfg.head_dim)  # [D]: the rotated dimensions (reordered: each half's first) get it
            rows_scale.view(2, -1)[:, : cfg.rotary_dim // 2] = factor
        for hf_name, tensor in weights:
            fused = next((f for f in FUSED_CHECKPOINT_PARAMS if f".{f}." in hf_name), None)
            if fused is None:
                parts = [(hf_name, tensor)]
            else:
                _plain_tensor(hf_name, tensor, "a fused projection")
                names = [p for p, (f, _) in STACKED_PARAMS.items() if f == fused]
                sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size] if "qkv" in fused else [cfg.intermediate_size] * 2
                if tensor.shape[0] != sum(sizes):
                    raise ValueError(f"checkpoint tensor {hf_name!r} has {tensor.shape[0]} rows, expected {sum(sizes)}")
                parts = [(hf_name.replace(fused, p), t) for p, t in zip(names, tensor.split(sizes), strict=True)]
            for name, t in parts:
                if order is not None and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                    _plain_tensor(name, t, "a partial rotation")
                    heads = t.reshape(-1, cfg.head_dim, *t.shape[1:])[:, order]  # [heads, D, ...]
                    t = (heads.float() * rows_scale.view(1, -1, *[1] * (t.dim() - 1))).to(t.dtype).reshape(t.shape)
                yield name, t

    def process_weights_after_loading(self) -> None:
        """Once the weights are in (from a checkpoint or dummy): each linear method's pass."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.linear_method.process_weights_after_loading(mod)


def _plain_tensor(hf_name: str, tensor: torch.Tensor, what: str) -> None:
    """Only an unquantized weight or bias can be cut into rows or reordered here."""
    if not hf_name.endswith((".weight", ".bias")) or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"checkpoint tensor {hf_name!r}: {what} is only supported for unquantized weights")


def _method_for(linear_method: LinearMethod | None, prefix: str, *parts: str) -> LinearMethod | None:
    """The method of the projection filled from checkpoint modules `prefix.part` for each part
    (a quantized checkpoint may leave some unquantized: `LinearMethod.for_layer`)."""
    if linear_method is None:
        return None
    return linear_method.for_layer([f"{prefix}.{part}" for part in parts])


def _param_name(hf_name: str) -> tuple[str, str | None]:
    """HF tensor name -> (our parameter name, shard id into a fused parameter or None)."""
    name = hf_name.removeprefix("model.")
    for part, (fused, shard_id) in STACKED_PARAMS.items():
        if f".{part}." in name:
            return name.replace(part, fused), shard_id
    return name, None


def _hf_names(param_name: str) -> str:
    """The HF tensor name(s) a parameter is filled from, for error messages:
    `layers.0.self_attn.qkv_proj.weight` -> `model.layers.0.self_attn.{q,k,v}_proj.weight`."""
    name = param_name
    if name.startswith(("layers.", "embed_tokens", "norm")):
        name = "model." + name
    fused_parts: dict[str, list[str]] = {}
    for part, (fused, _) in STACKED_PARAMS.items():
        fused_parts.setdefault(fused, []).append(part)
    for fused, parts in fused_parts.items():
        if f".{fused}." in name:
            return name.replace(fused, _brace(parts))
    return name


def _brace(parts: list[str]) -> str:
    """["mlp.gate_proj", "mlp.up_proj"] -> "mlp.{gate,up}_proj"."""
    prefix = os.path.commonprefix(parts)
    suffix = os.path.commonprefix([p[len(prefix):][::-1] for p in parts])[::-1]
    middles = [p[len(prefix):len(p) - len(suffix)] for p in parts]
    return f"{prefix}{{{','.join(middles)}}}{suffix}"
