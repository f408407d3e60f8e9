"""Find a model by name or path (torch-free: the HTTP process uses it too).

A model is named by: nothing or `smollm2-135m-instruct` (the embedded default model; with
load_format dummy that name is the preset of its shapes), a preset name
(`qwen3-4b-instruct-2507`, ...), a Hugging Face Hub id (`org/name`, from the local Hub cache
or downloaded: `models/hub.py`), a Hugging Face folder with `config.json` and `.safetensors`
files, or a `.gguf` file. `resolve_model` reads only its config;
`models/loader.py` builds it with its weights; `load_tokenizer` finds its tokenizer (or a
stand-in for presets that ship none).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import ModelConfig
from pagedserve.models import presets

logger = logging.getLogger("pagedserve")

EMBEDDED_NAME = "smollm2-135m-instruct"  # the embedded default model's name (as served)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config and weights come from."""

    name: str  # what the user called it (the served model name by default)
    hf_config: dict
    folder: Path | None = None  # HF folder (config, safetensors, tokenizer files)
    gguf_file: Path | None = None
    is_preset: bool = False
    from_hub: bool = False  # named by a Hub id; `folder` is its snapshot in the local cache
    # the embedded default model: `folder` is its converted cache; what its GGUF lacks (a
    # chat template with tools, sampling defaults) comes from models/embedded/
    embedded: bool = False


def resolve_model(model: str | None, *, load_format: str = "auto", revision: str | None = None,
                  download_dir: str | None = None) -> ModelSource:
    """Turn a user's model argument into a ModelSource (no weights are read). A Hub id is
    fetched into the local cache (the weights too, unless `load_format` is dummy and the id
    is a preset's); a preset's short name needs no files."""
    from pagedserve.models import hub

    if model is None or (model.lower() == EMBEDDED_NAME and load_format != "dummy"):
        # (the name the server reports for the embedded model starts it again; with dummy
        # weights the name is the preset of the same shapes)
        from pagedserve.models.default_model import default_model_dir

        folder = default_model_dir()
        return ModelSource(EMBEDDED_NAME, _read_config(folder), folder=folder, embedded=True)
    if hub.looks_like_hub_id(model) and not (load_format == "dummy" and presets.is_preset(model)):
        folder = hub.fetch(model, revision, download_dir)
        return ModelSource(model, _read_config(folder), folder=folder, from_hub=True)
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


def embedded_file(name: str) -> str:
    """The text of models/embedded/`name`: what the embedded model's GGUF does not carry."""
    from importlib import resources

    return resources.files("pagedserve.models").joinpath(f"embedded/{name}").read_text()


def _read_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(
            f"{folder} has no config.json; point the model at a Hugging Face checkpoint folder "
            "(config.json + *.safetensors + tokenizer files), a .gguf file, or a preset name"
        )
    cfg = _read_json(cfg_path)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():  # (its EOS ids end generation too: Phi-4-mini's <|end|>, Qwen2.5's <|endoftext|>)
        eos = _read_json(gen_path).get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        extra = cfg.setdefault("_pagedserve", {}).setdefault("extra_eos_token_ids", [])
        extra += [t for t in eos if t not in extra]
    return cfg


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


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
    if source.embedded:
        tok = Tokenizer.from_pretrained(source.folder)
        tok.hf.chat_template = embedded_file("chat_template.jinja")  # (its GGUF's, plus tools)
        return tok
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
