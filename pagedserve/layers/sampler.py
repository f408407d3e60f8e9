"""Batched token sampling with per-request parameters, on the logits' device.

One step: penalties -> logit_bias -> min_tokens bans -> allowed_token_ids -> grammar mask ->
greedy argmax, or temperature ->
top-k -> top-p -> min-p -> softmax -> exponential race. Random rows sample
`argmax(probs / q)` with `q ~ Exp(1)` i.i.d. per token, which draws exactly from `probs`; a
seeded row fills its own `q` (always `vocab_size` draws per step) from its own generator, so
its tokens do not depend on the rest of the batch. On the GPU a batch that only uses
temperatures runs the same race in one fused kernel instead (`kernels/sampling.py`).
Logprobs come from the raw logits, before penalties, biases and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.layers.sampling_batch import SamplingBatch
from pagedserve.layers.sampling_noise import fill_exponential_
from pagedserve.layers.top_k_top_p import apply_top_k_top_p


@dataclass
class SamplerOutput:
    """The sampled tokens of one step, plus logprobs when some row asked for them."""

    token_ids: Tensor  # [N] int64 (always valid ids: the next step may read them)
    checked_token_ids: Tensor  # [N] int64: the same, -1 in rows whose logits hold a NaN or Inf
    logprobs: Tensor | None  # [N, 1 + k] float32: sampled token's logprob, then the top-k
    logprob_token_ids: Tensor | None  # [N, 1 + k] int64: sampled token id, then the top-k ids
    logprob_ranks: Tensor | None = None  # [N] int64: the sampled token's rank (1: likeliest)


def _token_counts(token_ids: Tensor, vocab_size: int, dtype: torch.dtype) -> Tensor:
    """[N, L] ids padded with vocab_size -> [N, vocab_size] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=dtype,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens).

    logits: [N, V] float32; returns a new tensor, the input is left untouched.
    """
    assert batch.output_token_ids is not None
    assert batch.repetition_penalty is not None and batch.presence_penalty is not None
    assert batch.frequency_penalty is not None
    vocab = logits.shape[-1]
    out_counts = _token_counts(batch.output_token_ids, vocab, logits.dtype)  # [N, V]
    if batch.prompt_token_ids is not None:
        seen = out_counts + _token_counts(batch.prompt_token_ids, vocab, logits.dtype) > 0
        rp = batch.repetition_penalty.unsqueeze(1)  # [N, 1]
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * out_counts
    return logits - batch.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)


def _exponential_noise(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """[N, V] Exp(1) noise: default generator for unseeded rows (one call), own ones else."""
    noise = torch.empty_like(probs)  # rows left unfilled are greedy; their result is dropped
    if batch.any_unseeded_random:
        fill_exponential_(noise)
    for row, gen in batch.seeded:
        fill_exponential_(noise[row], gen)  # always V draws per step from this generator
    # Exp(1) can return exactly 0; keep the ratio finite so a 0-prob token never wins.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def temperature_only(batch: SamplingBatch) -> bool:
    """Whether every random row of `batch` samples with a temperature alone, from the default
    generator: no penalties, biases, bans, top-k, top-p, min-p or seed (the fused kernel's
    case)."""
    return not (batch.all_greedy or constrained(batch) or batch.need_top_k_top_p
                or batch.need_min_p or batch.seeded)


def fused_top_k_top_p(batch: SamplingBatch) -> bool:
    """Whether the top-k / top-p kernel can sample this batch: every random row has a top_k of
    at most the kernel's CAP, and no row has constraints, min-p or a seed of its own."""
    from pagedserve.kernels.top_k_top_p_sampling import CAP

    return (batch.need_top_k and not batch.all_greedy and batch.top_k_on_random_rows
            and batch.max_top_k <= CAP and not constrained(batch) and not batch.need_min_p
            and not batch.seeded)


def constrained(batch: SamplingBatch) -> bool:
    """Whether `Sampler.constrain` changes any logit (penalties, biases, bans, allowed ids or
    an allowed-token mask)."""
    return (batch.need_penalties or batch.bias is not None or batch.ban_rows is not None
            or batch.allowed is not None or batch.allowed_token_mask is not None)


def apply_token_bitmask(logits: Tensor, mask: Tensor) -> Tensor:
    """-inf where a token is not allowed: logits [N, V] float32, mask [N, ceil(V / 32)] int32
    (bit t % 32 of word t // 32 set = token t allowed). Returns a new tensor."""
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)  # [32]
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [N, 32 * words]
    return logits.masked_fill(~allowed[:, : logits.shape[-1]], float("-inf"))


def check_finite(logits: Tensor, token_ids: Tensor) -> Tensor:
    """[N] token ids with -1 in rows of `logits` [N, V] that hold a NaN or an Inf (any of them
    makes the row's float32 sum non-finite; finite logits cannot overflow it). Three small
    torch ops: on the H200 they cost about 0.02 ms per greedy decode step."""
    finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))  # [N] bool
    return torch.where(finite, token_ids, -1)


class Sampler:
    """Samples one token per row from [N, V] logits with each row's own parameters.

    Never modifies the logits in place (they may be a CUDA-graph output buffer). On the GPU,
    batches that only use temperatures run on one fused kernel (`kernels/sampling.py`), and
    with `fused_top_k_top_p`, bf16 batches whose random rows all have a top-k (and no
    constraints, min-p or seeds) on a radix select (`kernels/top_k_top_p_sampling.py`); both
    are keyed by a seed drawn from torch's default generator at construction plus a step count.
    """

    def __init__(self, fused: bool = True, fused_top_k_top_p: bool = True) -> None:
        self.fused = fused  # KernelConfig.fused_sampling
        self.fused_top_k_top_p = fused and fused_top_k_top_p  # KernelConfig.top_k_top_p_kernel
        self._seed = int(torch.randint(2**31 - 1, (1,)).item())
        self._fused_calls = 0

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.shape == (batch.num_rows, batch.vocab_size), (logits.shape, batch.num_rows)
        source = logits  # [N, V] in the model's dtype (the fused kernels read it as it is)
        if (logits.is_cuda and logits.dtype == torch.bfloat16 and self.fused_top_k_top_p
                and fused_top_k_top_p(batch)):
            # a radix select instead of a sort: top-k, top-p, temperature and the race
            from pagedserve.kernels.top_k_top_p_sampling import sample_top_k_top_p

            assert batch.temperature is not None and batch.top_p is not None and batch.top_k is not None
            self._fused_calls += 1
            checked = torch.empty(batch.num_rows, dtype=torch.int64, device=logits.device)
            token_ids = sample_top_k_top_p(source, batch.temperature, batch.top_k, batch.top_p,
                                           self._seed + self._fused_calls, checked=checked)
        elif logits.is_cuda and temperature_only(batch) and self.fused:
            # one kernel: the Gumbel race (argmax for greedy rows) and the NaN/Inf check
            from pagedserve.kernels.sampling import sample_with_temperature

            assert batch.temperature is not None
            self._fused_calls += 1
            checked = torch.empty(batch.num_rows, dtype=torch.int64, device=logits.device)
            token_ids = sample_with_temperature(source, batch.temperature,
                                                self._seed + self._fused_calls, checked=checked)
        else:
            # bf16 / fp16 logits order the vocabulary as the scaled float32 ones do when nothing
            # constrains them: top-k / top-p select or sort those (half the bytes)
            keys = source if source.dtype in (torch.bfloat16, torch.float16) and not constrained(batch) else None
            raw_logits = logits = source.float()  # [N, V]
            logits = self.constrain(logits, batch)
            # [N] int64
            token_ids = logits.argmax(dim=-1) if batch.all_greedy else self._sample(logits, batch, keys)
            checked = check_finite(raw_logits, token_ids)
        logprobs = ids = ranks = None
        if batch.max_num_logprobs is not None:
            logprobs, ids, ranks = self.token_logprobs(source.float(), token_ids, batch.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, checked_token_ids=checked, logprobs=logprobs,
                             logprob_token_ids=ids, logprob_ranks=ranks)

    def target_probs(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """[N, V] float32: the distribution each row's token would be drawn from (penalties,
        logit_bias, bans, the allowed-token mask, temperature, top-k, top-p and min-p
        applied; normalised), one-hot at the argmax in greedy rows. Speculative decoding's
        verify pass draws from it (`spec_decode/verify.py`)."""
        assert logits.shape == (batch.num_rows, batch.vocab_size), (logits.shape, batch.num_rows)
        logits = self.constrain(logits.float(), batch)
        one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if batch.all_greedy:
            return one_hot
        probs = self._probs(logits, batch)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        assert batch.temperature is not None
        return torch.where((batch.temperature == 0).unsqueeze(1), one_hot, probs)

    @staticmethod
    def constrain(logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Penalties, logit_bias, min_tokens bans, allowed_token_ids and the allowed-token mask
        on float32 logits [N, V] (a new tensor where any applies)."""
        if batch.need_penalties:
            logits = apply_penalties(logits, batch)
        if batch.bias is not None:
            rows, ids, values = batch.bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if batch.ban_rows is not None:
            neg_inf = logits.new_full((), float("-inf"))
            logits = logits.index_put((batch.ban_rows, batch.ban_token_ids), neg_inf)
        if batch.allowed is not None:  # allowed_token_ids: the rest of those rows -inf
            with_set, rows, ids = batch.allowed
            kept = logits[rows, ids]  # [A]
            logits = logits.index_fill(0, with_set, float("-inf")).index_put((rows, ids), kept)
        if batch.allowed_token_mask is not None:
            logits = apply_token_bitmask(logits, batch.allowed_token_mask)
        return logits

    @staticmethod
    def _probs(logits: Tensor, batch: SamplingBatch, keys: Tensor | None = None) -> Tensor:
        """[N, V] unnormalised probabilities of the random rows (temperature, top-k, top-p,
        min-p); greedy rows get temperature 1 (their value is not used). `keys`: see
        `apply_top_k_top_p`."""
        assert batch.temperature is not None and batch.min_p is not None
        temperature = batch.temperature.masked_fill(batch.temperature == 0, 1.0).unsqueeze(1)  # [N, 1]
        scaled = logits / temperature  # [N, V]
        if batch.need_top_k_top_p:
            scaled = apply_top_k_top_p(scaled, batch, keys)
        probs = scaled.softmax(dim=-1)  # [N, V]
        if batch.need_min_p:
            floor = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [N, 1]
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    @classmethod
    def _sample(cls, logits: Tensor, batch: SamplingBatch, keys: Tensor | None = None) -> Tensor:
        probs = cls._probs(logits, batch, keys)
        sampled = (probs / _exponential_noise(probs, batch)).argmax(dim=-1)  # [N]
        if batch.all_random:
            return sampled
        assert batch.temperature is not None
        return torch.where(batch.temperature == 0, logits.argmax(dim=-1), sampled)

    @staticmethod
    def token_logprobs(raw_logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """([N, 1 + k] float32, [N, 1 + k] int64, [N] int64): each row's log-probability of
        token_ids [N] under raw_logits [N, V], then its top k (ids and values); and the token's
        rank, 1 + the number of tokens strictly likelier (vLLM's Logprob.rank)."""
        logprobs = raw_logits.log_softmax(dim=-1)  # [N, V]
        sampled_ids = token_ids.unsqueeze(1)  # [N, 1]
        sampled = logprobs.gather(1, sampled_ids)  # [N, 1]
        ranks = (logprobs > sampled).sum(dim=1) + 1  # [N]
        k = min(k, logprobs.shape[-1])
        if k == 0:
            return sampled, sampled_ids, ranks
        top = torch.topk(logprobs, k, dim=-1)  # values, indices: [N, k]
        return (torch.cat([sampled, top.values], dim=1),
                torch.cat([sampled_ids, top.indices], dim=1), ranks)
