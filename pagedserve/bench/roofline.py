"""The physical limit we judge speed by (DESIGN.md section 4).

Decode is memory-bound: a step reads the weights once plus the KV cache of every running
sequence. Prefill is compute-bound: 2 x parameters FLOPs per token. A step's ideal time is
max(bytes / bandwidth, FLOPs / peak); summed over a workload it gives the ideal time, and
ideal / measured is the roofline efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import ModelConfig

H200_BANDWIDTH = 4.25e12  # bytes/s, measured copy bandwidth (read + write)
H200_BF16_FLOPS = 790e12  # FLOP/s, measured bf16 matmul


@dataclass(frozen=True)
class Roofline:
    params: int
    weight_bytes: int  # bytes a decode step must read (an untied input embedding is only gathered)
    kv_bytes_per_token: int
    bandwidth: float = H200_BANDWIDTH
    flops: float = H200_BF16_FLOPS

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype_bytes: int = 2) -> Roofline:
        params = cfg.num_parameters()
        gathered = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
        return cls(params, (params - gathered) * dtype_bytes, kv)

    def decode_step_seconds(self, context_lens: list[int] | int, batch: int | None = None) -> float:
        """Ideal time of one decode step over sequences with these context lengths."""
        if isinstance(context_lens, int):
            total_ctx, n = context_lens * (batch or 1), batch or 1
        else:
            total_ctx, n = sum(context_lens), len(context_lens)
        bytes_moved = self.weight_bytes + total_ctx * self.kv_bytes_per_token
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
