# Sourced by the scripts that run vLLM 0.26 on the GPU machine: unpacks it once (pieces a and b
# copied to /root/keep by an earlier call, piece c and the wheels carried in $VLLM_DIR; see
# ../shared/tools/vllm-carry.sh) and sets $VLLM, the command that runs its CLI. vLLM's and
# pagedserve's Python paths stay apart (their pydantic versions differ).
VLLM_DIR="${VLLM_DIR:-.carry/vllm}"
if [ ! -d /tmp/vllm/vllm ]; then
    mkdir -p /tmp/vllm
    cat /root/keep/piece.a /root/keep/piece.b "$VLLM_DIR/piece.c" | xz -d | tar -x -C /tmp/vllm || return 1
    python3 -m pip install -q --no-index --no-deps --target /tmp/vsite "$VLLM_DIR"/wheels/*.whl || return 1
fi
VLLM="env VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/vllm:/tmp/vsite python3 -m vllm.entrypoints.cli.main"
