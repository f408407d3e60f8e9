"""Models named by a Hugging Face Hub id (`org/name`): found in the local Hub cache, else
downloaded when the network allows (torch-free: the HTTP process resolves models too)."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("pagedserve")

# What serving needs: configs, weights, tokenizer files and chat templates (no .bin, no ONNX).
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]


def looks_like_hub_id(name: str) -> bool:
    """`org/name` with no path of that name on disk."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "~"))
            and not Path(name).expanduser().exists())


def fetch(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The local folder of `repo_id` at `revision`: from the cache when it is there, else
    downloaded. ValueError saying what to do when neither works."""
    from huggingface_hub import constants, snapshot_download

    kw = dict(revision=revision, cache_dir=cache_dir, allow_patterns=_PATTERNS)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kw))
    except Exception:  # not in the cache (or not at this revision): try the network
        pass
    try:
        logger.info("%s is not in the Hugging Face cache: downloading it", repo_id)
        return Path(snapshot_download(repo_id, **kw))
    except Exception as e:
        where = cache_dir or constants.HF_HUB_CACHE
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        at = f" at revision {revision}" if revision else ""
        raise ValueError(
            f"{repo_id}{at} is not in the Hugging Face cache ({where}) and could not be "
            f"downloaded ({type(e).__name__}: {reason[:200]}). Download it where the network "
            f"allows (`hf download {repo_id}`) into that cache (or set HF_HOME / "
            "--download-dir), pass a local model folder, or run a weight-less preset with "
            "--load-format dummy"
        ) from None
