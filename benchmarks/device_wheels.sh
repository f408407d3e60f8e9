#!/usr/bin/env bash
# Fill .whl/ and .devtok/ for the GPU machine, which has no network (run here, in the repo root):
#   bash benchmarks/device_wheels.sh
# .whl/: Python 3.12 x86-64 wheels of what the server, the bench client and xgrammar need beyond
# the GPU image's own packages (torch, triton, transformers, tokenizers, safetensors, numpy,
# huggingface_hub), each at the version installed in this checkout's .venv. .devtok/: the
# stand-in tokenizer (the embedded SmolLM2's files, from the pagedserve cache: run
# `pagedserve serve` once first). The scripts under benchmarks/ install .whl/*.whl with
# `pip install --no-index --no-deps --target /tmp/pydeps`; carry both folders with each call.
set -euo pipefail
PY="${PY:-.venv/bin/python}"
PACKAGES="fastapi starlette uvicorn uvloop httptools websockets watchfiles python-dotenv
pydantic pydantic-core annotated-types typing-inspection pyzmq xgrammar apache-tvm-ffi
prometheus-client httpx httpcore h11 anyio sniffio aiohttp aiohappyeyeballs aiosignal
frozenlist multidict yarl propcache attrs psutil nvidia-ml-py rich markdown-it-py mdurl
pygments gguf openai jiter py-spy"
mkdir -p .whl .devtok
reqs=$(mktemp)
for p in $PACKAGES; do
    echo "$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")" >> "$reqs"
done
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r "$reqs"
rm -f "$reqs"
SRC="${SMOLLM2_DIR:-$HOME/.cache/pagedserve/smollm2-135m-instruct}"
for f in tokenizer.json tokenizer_config.json config.json chat_template.jinja; do
    [ -f "$SRC/$f" ] && cp "$SRC/$f" .devtok/
done
du -sh .whl .devtok
