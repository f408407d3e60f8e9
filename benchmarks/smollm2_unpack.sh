#!/usr/bin/env bash
# On the GPU machine: put the embedded SmolLM2 back together from the two pieces of
# benchmarks/smollm2_pieces.sh, each taken from /root/keep (stashed by an earlier call) or
# else from .carry/smollm2 (carried with this one), and unpack it into $1 (/tmp/smol).
set -euo pipefail
dest="${1:-/tmp/smol}"
pieces=()
for p in smol.a smol.b; do
    if [ -f "/root/keep/$p" ]; then pieces+=("/root/keep/$p")
    elif [ -f ".carry/smollm2/$p" ]; then pieces+=(".carry/smollm2/$p")
    else echo "SmolLM2 piece $p is neither in /root/keep nor in .carry/smollm2 (benchmarks/smollm2_pieces.sh)" >&2; exit 1
    fi
done
mkdir -p "$dest"
cat "${pieces[@]}" | tar -x -C "$dest"
