"""Tiny random PEFT LoRA adapters for a Transformers model, and PEFT's greedy tokens as the
reference (fp32, CPU)."""

from __future__ import annotations

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, alpha, rsLoRA, target modules): every projection, attention only, MLP only...
ADAPTERS = [
    ("all8", 8, 16, False, ALL),
    ("qv4", 4, 8, False, ["q_proj", "v_proj"]),
    ("mlp16", 16, 8, True, ["gate_proj", "up_proj", "down_proj"]),
    ("ko2", 2, 4, False, ["k_proj", "o_proj", "up_proj"]),
]


def make_adapters(model, folder, adapters=ADAPTERS, std: float = 1.0):
    """Save one random adapter per entry of `adapters` under folder/name; return the PeftModel
    holding them all (names as given) over `model`. A: N(0, 1/in), B: N(0, std^2/r)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    peft_model: PeftModel | None = None
    gen = torch.Generator().manual_seed(0)
    for name, r, alpha, rs, targets in adapters:
        cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=targets, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if f".{name}." in pname and "lora_" in pname:
                    scale = std if "lora_B" in pname else 1.0
                    p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
        peft_model.save_pretrained(str(folder), selected_adapters=[name])
    peft_model.eval()
    return peft_model


def peft_greedy(peft_model, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """PEFT's greedy continuation of `prompt` under `adapter` (None: the base model)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                out = peft_model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        else:
            peft_model.set_adapter(adapter)
            out = peft_model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def peft_greedy_batch(peft_model, adapters: list[str | None], prompt: list[int], n: int) -> list[list[int]]:
    """PEFT's greedy continuations of one prompt under each adapter (None: the base model), in
    one mixed batch (PEFT's adapter_names)."""
    ids = torch.tensor([prompt] * len(adapters))
    names = ["__base__" if a is None else a for a in adapters]
    with torch.no_grad():
        out = peft_model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, adapter_names=names)
    return out[:, len(prompt):].tolist()
