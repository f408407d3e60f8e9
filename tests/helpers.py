"""Small helpers for running pagedserve's model without the engine."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
from pathlib import Path

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
def hf_greedy(hf, prompt: list[int], n: int, prefix=None) -> list[int]:
    """Greedy continuation with a Transformers model, n tokens, EOS neither stopping nor banned.
    Only the last position's logits are computed (`logits_to_keep=1`, as Transformers'
    generate does). `prefix` (from `hf_prefix`): leading tokens of `prompt` already run; the
    rest of the prompt continues a copy of their cache (Transformers' own prefix reuse)."""
    name = _cache_name(hf)
    kwargs = {"use_cache": True}
    if prefix is not None:
        ids, cache = prefix
        assert prompt[:len(ids)] == ids and len(prompt) > len(ids), "the prompt does not extend the prefix"
        kwargs[name] = copy.deepcopy(cache)
        prompt = prompt[len(ids):]
    out = hf(torch.tensor([prompt]), **kwargs, **_last_logits(hf))
    tokens = []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = hf(torch.tensor([[tok]]), use_cache=True, **{name: getattr(out, name)})
    return tokens


@torch.no_grad()
def hf_prefix(hf, ids: list[int]):
    """Run `ids` once with a Transformers model: the `prefix` argument of `hf_greedy`."""
    out = hf(torch.tensor([ids]), use_cache=True, **_last_logits(hf))
    return list(ids), getattr(out, _cache_name(hf))


def _cache_name(hf) -> str:
    # Transformers 5.x calls the KV cache `cache` (`past_key_values` is deprecated); 4.x
    # calls it `past_key_values`.
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _last_logits(hf) -> dict:
    params = inspect.signature(hf.forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def run_ok_script(script: str) -> None:
    """Run `script` in a fresh Python from the repository root (a kernel check under Triton's
    interpreter, set up by the script); it must print exactly "ok"."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
