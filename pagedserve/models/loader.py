"""Find a model by name or path and build it with its weights.

A model is named by: nothing (the embedded default model), a preset name
(`qwen3-4b-instruct-2507`, ...), a Hugging Face folder with `config.json` and
`.safetensors` files, or a `.gguf` file. `load_format="dummy"` makes random weights of
the right shapes directly on the target device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.config import ModelConfig, resolve_dtype
from pagedserve.models import presets
from pagedserve.models.llama import LlamaForCausalLM

logger = logging.getLogger("pagedserve")

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config and weights come from."""

    name: str  # what the user called it (the served model name by default)
    hf_config: dict
    folder: Path | None = None  # HF folder (config, safetensors, tokenizer files)
    gguf_file: Path | None = None
    is_preset: bool = False


def resolve_model(model: str | None) -> ModelSource:
    """Turn a user's model argument into a ModelSource (no weights are read)."""
    if model is None:
        from pagedserve.models.default_model import default_model_dir

        folder = default_model_dir()
        return ModelSource("smollm2-135m-instruct", _read_config(folder), folder=folder)
    if presets.is_preset(model):
        return ModelSource(presets.canonical_name(model), presets.load_preset(model), is_preset=True)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from pagedserve.models.gguf_loader import read_gguf

        cfg, _ = read_gguf(path)
        return ModelSource(path.stem, cfg, gguf_file=path)
    if path.is_dir():
        return ModelSource(path.name, _read_config(path), folder=path)
    raise ValueError(
        f"model {model!r} is neither a folder, a .gguf file nor a preset; "
        f"presets: {', '.join(presets.PRESET_NAMES)}"
    )


def _read_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(
            f"{folder} has no config.json; point the model at a Hugging Face checkpoint folder "
            "(config.json + *.safetensors + tokenizer files), a .gguf file, or a preset name"
        )
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None


def build_model(
    source: ModelSource,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
) -> LlamaForCausalLM:
    """Create the decoder on `device` in `dtype` and fill its weights."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    cfg = ModelConfig.from_hf_config(source.hf_config)
    model = _materialise(cfg, torch_dtype, device)
    if load_format == "dummy":
        _fill_dummy(model, seed)
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


def _materialise(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the module on the meta device, then allocate (uninitialised) on `device`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    model.rotary.reset_parameters()
    return model


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights, small enough that activations stay finite in bf16."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
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


def load_tokenizer(source: ModelSource, cfg: ModelConfig, path: str | None = None):
    """The model's own tokenizer, or a stand-in built on the embedded model's tokenizer.

    Presets with dummy weights (and folders without tokenizer files) get the stand-in:
    SmolLM2's tokenizer and chat template, with ids beyond its vocabulary rendered as
    placeholders, and the model's own EOS/BOS ids.
    """
    from pagedserve.tokenizer import Tokenizer

    if path is not None:
        base = Tokenizer.from_pretrained(path)
        if cfg.vocab_size <= base.known_vocab_size:
            return base
        return _stand_in(base, cfg)
    if source.gguf_file is not None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(source.gguf_file.parent), gguf_file=source.gguf_file.name)
        return Tokenizer(hf)
    if source.folder is not None and any(
        (source.folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return Tokenizer.from_pretrained(source.folder)
    from pagedserve.models.default_model import default_model_dir

    base = Tokenizer.from_pretrained(default_model_dir())
    logger.info("%s ships no tokenizer: using the embedded model's tokenizer as a stand-in", source.name)
    return _stand_in(base, cfg)


def _stand_in(base, cfg: ModelConfig):
    from pagedserve.tokenizer import Tokenizer

    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return Tokenizer.stand_in(base, max(cfg.vocab_size, base.known_vocab_size),
                              eos_token_id=eos, bos_token_id=cfg.bos_token_id)
