"""Build a model (named as `models/source.py` resolves it) with its weights.

Weights come from safetensors folders, GGUF files, or `load_format="dummy"`: random weights
of the right shapes made directly on the target device.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.config import ModelConfig, resolve_dtype
from pagedserve.distributed.tensor_parallel import SINGLE, TensorParallel
from pagedserve.layers.linear_method import LinearMethod
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.registry import model_class
from pagedserve.models.source import ModelSource
from pagedserve.quantization import checkpoint_quant_config, resolve_quantization
from pagedserve.quantization.methods import linear_method_for

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def build_model(
    source: ModelSource,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    """Create the decoder on `device` in `dtype` and fill its weights; `quantization` (as
    `--quantization`: None, or a method `resolve_quantization` accepts for this checkpoint)
    sets the decoder projections' weight format (`pagedserve/quantization/`), read from the
    checkpoint's quantization_config if it has one (a pre-quantized checkpoint runs its own
    method when `quantization` is None). `tp`: this process's tensor-parallel rank (it keeps
    its share of the weights). `max_model_len`: the context served (LongRoPE's factors depend on
    it; default: the model's own)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    cfg = model_config_from_hf(source.hf_config)
    quantization = resolve_quantization(quantization, source.hf_config)
    method = linear_method_for(quantization, checkpoint_quant_config(source.hf_config))
    model = _materialise(cfg, torch_dtype, device, method, tp, max_model_len)
    if load_format == "dummy":
        _fill_dummy(model, seed)
        model.process_weights_after_loading()
    elif source.gguf_file is not None:
        from pagedserve.models.gguf_loader import read_gguf

        _, tensors = read_gguf(source.gguf_file)
        model.load_weights(tensors)
    elif source.folder is not None:
        model.load_weights(iter_safetensors(source.folder))
    else:
        raise ValueError(
            f"preset {source.name!r} ships no weights: use load_format='dummy' "
            "(--load-format dummy) for random weights, or point the model at a checkpoint folder"
        )
    model.eval()
    return model


def _materialise(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 linear_method: LinearMethod | None = None, tp: TensorParallel = SINGLE,
                 max_model_len: int | None = None) -> LlamaForCausalLM:
    """Build the module on the meta device, then allocate (uninitialised) on `device`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg, linear_method, tp, max_model_len)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    return model


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights, small enough that activations stay finite in bf16. An FP8 checkpoint's
    e4m3 weights take values over e4m3's range and their scales (`*scale`, `*scale_inv`)
    0.05 / 448, so the weights they stand for are as small as the unquantized ones; a 4-bit
    checkpoint's packed integers take random bits and its group scales 0.05 / 8."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype == torch.float8_e4m3fn:
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-448.0, 448.0, generator=gen))
        elif name.endswith(("scale", "scale_inv")):
            p.fill_(0.05 / 448.0)
        elif name.endswith("g_idx"):  # GPTQ: input row k in group k // G
            k, groups = p.shape[-1], params[name.removesuffix("g_idx") + "scales"].shape[0]
            p.copy_(torch.arange(k, device=p.device).div(k // groups, rounding_mode="floor").expand_as(p))
        elif not p.is_floating_point():  # 4-bit AWQ/GPTQ qweight, qzeros: any bits
            p.random_(generator=gen)
        elif name.endswith("scales"):  # their group scales: weights within about +-0.1
            p.fill_(0.05 / 8)
        else:
            p.uniform_(-0.05, 0.05, generator=gen)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a folder's safetensors files, sharded or single."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ValueError(f"{folder} holds no .safetensors weight files")
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{path} is listed in the index but missing")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield key, f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read weights from {path}: {e}") from e
