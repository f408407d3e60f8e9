"""Engine flags, shared by `serve`, `generate`, `up` and the offline benchmarks: a flag per
field of `EngineArgs` (`engine_args.py`, of the same name), vLLM's names and meanings where
vLLM has the flag; `EngineArgs.from_cli` reads them back."""

from __future__ import annotations

import argparse

from pagedserve import envs
from pagedserve.cli import types
from pagedserve.config import DTYPE_NAMES, KV_CACHE_DTYPES
from pagedserve.quantization import QUANTIZATION_CHOICES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a preset name, a Hugging Face Hub id (org/name: from the local Hub cache, "
                        "downloaded when the network allows), a model folder or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct, also named "
                        "smollm2-135m-instruct)")
    p.add_argument("--model", dest="model_opt", default=None, metavar="MODEL",
                   help="the model, as the positional argument (vLLM's spelling); wins over it")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="weight and activation dtype; auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="auto", type=types.device,
                   help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="how weights are read; dummy: random weights of the right shapes")
    p.add_argument("--max-model-len", type=types.positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's limit)")
    p.add_argument("--max-num-seqs", type=types.positive_int, default=256,
                   help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=types.positive_int, default=None,
                   help="most tokens in one engine step (prefill chunks are cut to fit; default: "
                        "8192 on a GPU, 512 on the CPU, where a larger step takes seconds)")
    p.add_argument("--block-size", type=types.power_of_two, default=16,
                   help="tokens per KV-cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompts' shared prefixes")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted for vLLM compatibility; pagedserve always chunks long prefills, "
                        "so --no-enable-chunked-prefill is refused")
    p.add_argument("--kv-cache-memory", type=types.positive_int, default=None,
                   help="bytes for the KV cache (default: sized from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=types.fraction, default=None,
                   help="fraction of GPU memory the engine may use, KV cache included; the "
                        "CPU ignores it, with a warning (default: 0.9)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help="fp8 on an unquantized checkpoint: the decoder's weights quantized to "
                        "FP8 e4m3 at load (per output channel), activations per token (GPUs of "
                        "compute capability 8.9+); int8: int8 weights per output channel and "
                        "int8 activations per token, W8A8 (GPUs of compute capability 8.0+, "
                        "e.g. the A100). A pre-quantized checkpoint (fp8, compressed-tensors, "
                        "awq, gptq) runs its own method (the flag may name it); the CPU runs "
                        "FP8 on a dequantizing reference path, int8 on torch._int_mm")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how the KV cache is stored; auto: the model's dtype; fp8 (= fp8_e4m3): "
                        "float8 e4m3 with one scale per layer for K and one for V (1.0), half "
                        "the bytes of bfloat16, so twice the tokens fit (GPUs of compute "
                        "capability 8.9+; the CPU runs it on the torch reference path)")
    p.add_argument("--speculative-config", type=types.speculative_config, default=None,
                   help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                        "\"prompt_lookup_min\": 1}' guesses the next tokens from earlier text "
                        "and verifies them in one pass (exact: the same tokens or the same "
                        "distribution as without); '{\"method\": \"draft_model\", \"model\": "
                        "\"qwen3-0.6b\", \"num_speculative_tokens\": 4}' drafts with a smaller "
                        "model of the same vocabulary; \"disable_by_batch_size\": N turns it off "
                        "while more than N requests run (default 32)")
    p.add_argument("--tensor-parallel-size", "-tp", type=types.int_at_least(1), default=1,
                   help="split the model across this many worker processes (one GPU each; gloo "
                        "on the CPU): its heads, KV heads, MLP features and vocabulary must "
                        "divide by it; unquantized weights or --quantization fp8 on them "
                        "(FP8 weights and an FP8 KV cache); no pre-quantized checkpoints yet")
    p.add_argument("--data-parallel-size", "-dp", type=types.int_at_least(1), default=1,
                   help="engine cores behind this one server (`serve` and `up`), each with its "
                        "own KV cache and model copy: one per GPU (core i on GPUs i x "
                        "--tensor-parallel-size and up), on the CPU one process each; a "
                        "conversation (or a prompt_cache_key) stays on its core. For replicas "
                        "on several hosts: `pagedserve serve-ray --num-replicas N`")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "uni", "ray"],
                   help="mp: a worker process per tensor-parallel rank (the default above 1 "
                        "rank); uni: the model in the engine's own process (the default at 1); "
                        "ray is refused (replicas on Ray: `pagedserve serve-ray`)")
    p.add_argument("--kv-offload-size", type=types.non_negative_float, default=0, metavar="GIB",
                   help="GiB of host memory (pinned on CUDA) that keeps prefix-cached KV blocks "
                        "evicted from the KV cache; a returning prompt copies them back instead "
                        "of recomputing them (0: off)")
    p.add_argument("--kv-cache-dir", default=None, metavar="PATH",
                   help="a directory for evicted prefix blocks as files (one per block, "
                        "checksummed, named by the model's identity), which a restarted engine "
                        "reuses; an unwritable directory turns it off with a warning")
    p.add_argument("--kv-cache-dir-size", type=types.positive_float, default=8, metavar="GIB",
                   help="the most GiB of block files --kv-cache-dir keeps (oldest go first)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="pooling: an embedding or scoring model (prefill-only requests: "
                        "/v1/embeddings, /score, /rerank; no chat or completions); auto: the "
                        "checkpoint decides (a sentence-transformers folder embeds, a "
                        "Qwen3-Reranker scores, else generate)")
    p.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "score"],
                   help="with --runner pooling: embed (vectors) or score (a cross-encoder's "
                        "p(yes) from the 'yes'/'no' logits at the last token, Qwen3-Reranker's "
                        "rule); auto: as detected, else embed")
    p.add_argument("--pooler-config", type=types.pooler_config, default=None,
                   help="pooling overrides, vLLM's JSON: '{\"pooling_type\": \"MEAN\", "
                        "\"normalize\": true}' (LAST, MEAN or CLS; default: the checkpoint's, "
                        "else LAST, normalized)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--batch-invariant", action="store_true",
                   help="deterministic serving: a request gets the same tokens (and seeded samples) "
                        "alone or in any batch, whatever the step's mix of prefills and decodes, "
                        "its chunk boundaries or prefix-cache hits; costs throughput (README)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next step while the GPU runs this one")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="auto: triton on CUDA, torch on the CPU")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    p.add_argument("--revision", default=None, help="Hub id models: the branch, tag or commit")
    p.add_argument("--download-dir", default=None,
                   help="Hub id models: where to find and download them (default: the Hugging "
                        "Face cache, $HF_HOME/hub)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; pagedserve runs its own model code and "
                        "never a repository's, so it changes nothing")
    p.add_argument("--generation-config", default="auto",
                   help="defaults for sampling fields a request leaves out: auto (the model's "
                        "generation_config.json), vllm (none: temperature 1.0, top_p 1.0, ...) "
                        "or a folder holding a generation_config.json")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the engine's random state (sampling of requests without a seed, "
                        "dummy weights, benchmark datasets), as vLLM's --seed")
    p.add_argument("--log-level", default=envs.log_level(), type=types.log_level,
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    # LoRA adapters (vLLM's flags; `serve --lora-modules` names them)
    p.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters beside the base model (q/k/v/o/gate/up/down)")
    p.add_argument("--max-loras", type=types.int_at_least(1), default=1,
                   help="adapters resident on the device at once, and distinct adapters in one batch")
    p.add_argument("--max-lora-rank", type=types.int_at_least(1), default=16,
                   help="the largest adapter rank (1, 8, 16, 32, 64, 128, 256, 320 or 512)")
    p.add_argument("--max-cpu-loras", type=types.int_at_least(1), default=None,
                   help="adapters kept in host memory (default: --max-loras)")
