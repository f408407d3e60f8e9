"""Checkpoints for the pooling tests: SmolLM2 as a sentence-transformers embedder (mean
pooling, normalised) and a tiny random Qwen3 reranker with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from conftest import TINY_QWEN3


def smollm2_embedder(smollm2_dir: Path, folder: Path) -> Path:
    """SmolLM2's folder (its files linked) plus sentence-transformers' modules.json and
    1_Pooling/config.json: mean pooling, then Normalize."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in smollm2_dir.iterdir():
        if f.is_file() and not (folder / f.name).exists():
            os.symlink(f, folder / f.name)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 576, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048, "do_lower_case": False}))
    return folder


def tiny_reranker(smollm2_dir: Path, folder: Path):
    """A tiny random Qwen3 (SmolLM2's vocabulary and tokenizer) in a folder whose name says
    reranker (detected as a scorer); returns the Transformers model."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**TINY_QWEN3, "vocab_size": 49152, "max_position_embeddings": 2048})
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return model
