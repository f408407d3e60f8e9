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
# What to take: the dependency closure of what the server, the bench client and the GPU
# scripts import, less the GPU image's own packages and the closure of torch, triton and
# numpy (a wheel here would shadow theirs; this .venv's transformers is newer than the
# image's, so its dependencies say nothing about the image). It is computed from this .venv's
# metadata, so a new dependency of fastapi or openai comes along without editing this list.
WANT="fastapi uvicorn uvloop httptools websockets watchfiles python-dotenv pydantic pyzmq xgrammar
prometheus-client httpx aiohttp psutil nvidia-ml-py rich gguf openai py-spy"
IMAGE="torch triton numpy"
IMAGE_ONLY="transformers tokenizers safetensors huggingface-hub"
rm -rf .whl
mkdir -p .whl .devtok
reqs=$(mktemp)
"$PY" - "$WANT" "$IMAGE" "$IMAGE_ONLY" > "$reqs" <<'PYEOF'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

TARGET = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}


def closure(names, stop=frozenset()):
    """name -> version of `names` and their dependencies, not descending into `stop`."""
    seen = {}
    todo = [re.sub(r"[-_.]+", "-", n).lower() for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in stop:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency not installed here (other platforms, Python versions)
        seen[name] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(TARGET):
                todo.append(re.sub(r"[-_.]+", "-", req.name).lower())
    return seen

image = set(closure(sys.argv[2].split())) | set(sys.argv[3].split())
want = closure(sys.argv[1].split(), stop=image)
for name, version in sorted(want.items()):
    print(f"{name}=={version}")
PYEOF
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
