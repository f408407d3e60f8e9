"""Small helpers for running pagedserve's model without the engine."""

from __future__ import annotations

import inspect

import torch

from pagedserve.attention import AttentionContext, CommonAttentionMetadata, TorchReferenceBackend


def run_prefill(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len(seq), vocab] for each whole sequence, all in one flattened batch (a
    tensor-parallel rank's model: over its own heads, the logits whole)."""
    cfg = model.config
    device = model.embed_tokens.weight.device
    attn = model.layers[0].self_attn
    backend = TorchReferenceBackend(attn.num_heads, attn.num_kv_heads, cfg.head_dim, cfg.attention_scale,
                                    sliding_windows=cfg.sliding_windows or None)
    meta = backend.metadata(CommonAttentionMetadata.for_prefill([len(s) for s in seqs], device))
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, AttentionContext(backend, meta)))
    return list(logits.split([len(s) for s in seqs]))


def greedy_nocache(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by recomputing the whole sequence each step (slow, simple)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(run_prefill(model, [seq])[0][-1].argmax()))
    return seq[len(prompt):]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation with a Transformers model, n tokens, EOS neither stopping nor banned."""
    # Transformers 5.x calls the KV cache `cache` (`past_key_values` is deprecated); 4.x
    # calls it `past_key_values`.
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = hf(torch.tensor([[tok]]), use_cache=True, **{name: getattr(out, name)})
    return tokens
