"""The physical limit we judge speed by (DESIGN.md section 4).

Decode is memory-bound: a step reads the weights once plus the KV cache of every running
sequence. Prefill is compute-bound: 2 x parameters FLOPs per token. A step's ideal time is
max(bytes / bandwidth, FLOPs / peak); summed over a workload it gives the ideal time, and
ideal / measured is the roofline efficiency. A quantized model is judged on the bytes it
really reads: its decoder projections at their stored size (FP8: 1 byte a weight; 4-bit: half
a byte plus a 16-bit scale and zero per group of 128), an FP8 KV cache at 1 byte an element;
W8A8 FP8 products have twice the bf16 FLOP/s (Hopper's FP8 tensor cores). A mixture of
experts computes with its active parameters and reads, in a step of n tokens, the experts that
n tokens routed uniformly at random would reach (`MoeConfig.expected_experts_read`); with
`--quantization fp8` its experts are e4m3 too (1 byte a weight; their float32 scale per row,
4 / hidden bytes a weight, is left out as the dense layers' is).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import ModelConfig
from pagedserve.models.moe_config import MoeConfig

H200_BANDWIDTH = 4.25e12  # bytes/s, measured copy bandwidth (read + write)
H200_BF16_FLOPS = 790e12  # FLOP/s, measured bf16 matmul
# the GPUs we judge on: (copy bandwidth, bf16 matmul FLOP/s), each measured on the lent machines
# (an H100 SXM's copy moves about 3.0 TB/s, its bf16 matmul about 790 TFLOP/s)
GPU_LIMITS = {"H200": (H200_BANDWIDTH, H200_BF16_FLOPS), "H100": (3.0e12, 790e12)}
# bytes per decoder-projection weight as each quantization stores it, and its peak FLOP/s factor
WEIGHT_BYTES = {"fp8": 1.0, "compressed-tensors": 1.0, "awq": 0.5 + 4 / 128,
                "gptq": 0.5 + 4 / 128}
FLOPS_FACTOR = {"fp8": 2.0, "compressed-tensors": 2.0}
# bytes per expert weight of a mixture of experts as each quantization stores it (others: the
# model's dtype; pre-quantized MoE checkpoints are refused)
EXPERT_BYTES = {"fp8": 1.0}


def roofline_gpu(name: str) -> str | None:
    """The GPU_LIMITS key for a device name ("NVIDIA H200" -> "H200"), None for any other."""
    return next((key for key in GPU_LIMITS if key in name.upper()), None)


@dataclass(frozen=True)
class Roofline:
    params: int  # parameters a token runs through (a mixture of experts: its active ones)
    weight_bytes: int  # bytes a decode step must read (an untied input embedding is only gathered; no experts)
    kv_bytes_per_token: int
    bandwidth: float = H200_BANDWIDTH
    flops: float = H200_BF16_FLOPS
    expert_bytes: int = 0  # a mixture of experts: one expert's bytes over all its sparse layers
    moe: MoeConfig | None = None  # ... and its routing: a step of n tokens reads expected_experts_read(n)

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype_bytes: int = 2, quantization: str | None = None,
                  kv_cache_dtype: str = "auto", gpu: str = "H200") -> Roofline:
        """The limit for `cfg` in a `dtype_bytes` dtype, its projections stored as
        `quantization` keeps them and its KV cache in `kv_cache_dtype` ("auto": the dtype), on
        `gpu` (a key of GPU_LIMITS)."""
        bandwidth, bf16_flops = GPU_LIMITS[gpu]
        params = cfg.num_parameters()
        gathered = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        experts = cfg.expert_parameters() * (cfg.moe.num_experts if cfg.moe else 0)
        weight_bytes = (params - gathered - experts) * dtype_bytes
        per_weight = WEIGHT_BYTES.get(quantization)
        if per_weight is not None:
            h, i = cfg.hidden_size, cfg.intermediate_size
            dense_mlps = cfg.num_layers - (len(cfg.moe.layers) if cfg.moe else 0)  # (sparse: experts)
            projections = cfg.num_layers * (2 * h * cfg.q_size + 2 * h * cfg.kv_size) + dense_mlps * 3 * h * i
            weight_bytes -= round(projections * (dtype_bytes - per_weight))
        kv_bytes = 1 if kv_cache_dtype.startswith("fp8") else dtype_bytes
        kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes
        flops = bf16_flops * FLOPS_FACTOR.get(quantization, 1.0)
        return cls(cfg.active_parameters(), weight_bytes, kv, bandwidth=bandwidth, flops=flops,
                   expert_bytes=round(cfg.expert_parameters() * EXPERT_BYTES.get(quantization, dtype_bytes)),
                   moe=cfg.moe)

    def decode_step_seconds(self, context_lens: list[int] | int, batch: int | None = None) -> float:
        """Ideal time of one decode step over sequences with these context lengths."""
        if isinstance(context_lens, int):
            total_ctx, n = context_lens * (batch or 1), batch or 1
        else:
            total_ctx, n = sum(context_lens), len(context_lens)
        bytes_moved = self.weight_bytes + total_ctx * self.kv_bytes_per_token
        if self.moe is not None:
            bytes_moved += self.moe.expected_experts_read(n) * self.expert_bytes
        return max(bytes_moved / self.bandwidth, 2 * self.params * n / self.flops)

    def prefill_seconds(self, num_tokens: int) -> float:
        return 2 * self.params * num_tokens / self.flops

    def workload_seconds(self, input_lens: list[int], output_lens: list[int], max_num_seqs: int) -> float:
        """Ideal time of an offline workload: every prompt prefilled at peak FLOPs, then
        decode in waves of max_num_seqs sequences, one step per generated token."""
        total = self.prefill_seconds(sum(input_lens))
        pairs = list(zip(input_lens, output_lens))
        for w in range(0, len(pairs), max_num_seqs):
            wave = pairs[w : w + max_num_seqs]
            for step in range(1, max(o for _, o in wave)):  # the first token comes from prefill
                ctx = [i + step for i, o in wave if o > step]
                total += self.decode_step_seconds(ctx)
        return total
