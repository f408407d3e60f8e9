"""(CPU) Start-up costs that were found on the GPU host's slow CPU and must not come back:
`serve` starts the engine-core process before it imports the web framework (so the two
overlap), and building a model on the meta device does not import torch._dynamo (seconds
there). Each runs in a fresh interpreter, whose imports are its own."""

from __future__ import annotations

import subprocess
import sys

from conftest import make_hf_checkpoint

_SPAWN_PROBE = """
import sys
from pagedserve.cli.main import build_parser
from pagedserve.engine_args import EngineArgs
from pagedserve.server import engine_client, launch

seen = {}

def spawn(config, log_level):
    seen.update(fastapi="fastapi" in sys.modules, torch="torch" in sys.modules)
    raise SystemExit(0)

engine_client.spawn_engine_core = spawn
args = build_parser().parse_args(["serve", sys.argv[1]])
try:
    launch.server_settings(args, EngineArgs.from_cli(args))
except SystemExit:
    pass
print(seen)
"""


def test_engine_core_is_spawned_before_the_web_framework_is_imported(tmp_path):
    make_hf_checkpoint("qwen3", tmp_path)
    out = subprocess.run([sys.executable, "-c", _SPAWN_PROBE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # spawned, before fastapi (and with no torch in the HTTP process)
    assert out.stdout.strip().splitlines()[-1] == "{'fastapi': False, 'torch': False}", out.stdout


def test_building_a_model_does_not_import_dynamo(tmp_path):
    make_hf_checkpoint("qwen3", tmp_path)
    code = ("import sys; from pagedserve import LLM; LLM(sys.argv[1], max_model_len=128, max_num_seqs=2, "
            "kv_cache_memory=1 << 20); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
