"""LoRA adapters served over HTTP (issue 59): `serve --enable-lora --lora-modules`, the request's
`model` chooses the adapter (the real openai client; tokens as Transformers + PEFT give them),
`/v1/models` lists adapters with their parent, adapters loaded and unloaded while serving behind
the API key, bad adapters refused with 400s that name the problem, unknown names 404."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from lora_helpers import ADAPTERS, make_adapters, peft_greedy
from server_helpers import ServerProcess

KEY = "lora-test-key"
PROMPT = [504, 3210, 28, 1326, 314, 260, 3575, 282, 4649, 47, 1, 2]
NUM_NEW = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_with_tokenizer):
    import transformers

    root = tmp_path_factory.mktemp("lora_server")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer).float().eval()
    peft_model = make_adapters(model, root, ADAPTERS[:3])
    want = {name: peft_greedy(peft_model, name, PROMPT, NUM_NEW) for name in (None, "all8", "qv4", "mlp16")}
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_with_tokenizer)
    text = {k: tokenizer.decode(v) for k, v in want.items()}
    module_json = json.dumps({"name": "qv4", "path": str(root / "qv4"), "base_model_name": "tiny"})
    proc = ServerProcess(str(tiny_with_tokenizer), "--served-model-name", "tiny", "--enable-lora",
                         "--max-loras", "2", "--max-lora-rank", "16",
                         "--lora-modules", f"all8={root / 'all8'}", module_json, api_key=KEY).wait_ready()
    yield proc, root, text
    leftovers = proc.stop()
    assert not leftovers, proc.log_tail()


def _client(proc):
    return openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_NEW, temperature=0)
    return out.model, out.choices[0].text


def test_models_lists_adapters_with_their_parent(setup):
    proc, root, _ = setup
    models = {m.id: m for m in _client(proc).models.list().data}
    assert set(models) == {"tiny", "all8", "qv4"}
    assert models["all8"].parent == "tiny" and models["qv4"].parent == "tiny"
    assert models["all8"].root == str(root / "all8")
    assert getattr(models["tiny"], "parent", None) is None
    assert _client(proc).models.retrieve("qv4").id == "qv4"


def test_model_field_chooses_the_adapter_in_mixed_concurrent_requests(setup):
    proc, _, text = setup
    client = _client(proc)
    names = ["tiny", "all8", "qv4"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda m: _complete(client, m), names))
    assert got == [(m, text[None if m == "tiny" else m]) for m in names]
    assert len({text[None], text["all8"], text["qv4"]}) == 3  # (each adapter takes effect)
    stream = client.completions.create(model="qv4", prompt=PROMPT, max_tokens=NUM_NEW, temperature=0, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"qv4"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text["qv4"]


def test_load_and_unload_while_serving(setup):
    proc, root, text = setup
    client = _client(proc)
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        _complete(client, "mlp16")
    r = httpx.post(proc.url + "/v1/load_lora_adapter", json={"lora_name": "mlp16", "lora_path": str(root / "mlp16")},
                   headers=proc.headers)
    assert r.status_code == 200, r.text
    assert _complete(client, "mlp16") == ("mlp16", text["mlp16"])
    assert "mlp16" in {m.id for m in client.models.list().data}
    r = httpx.post(proc.url + "/v1/unload_lora_adapter", json={"lora_name": "mlp16"}, headers=proc.headers)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "mlp16")
    r = httpx.post(proc.url + "/v1/unload_lora_adapter", json={"lora_name": "mlp16"}, headers=proc.headers)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    # behind the API key
    r = httpx.post(proc.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "mlp16")})
    assert r.status_code == 401


def test_bad_adapters_are_refused_with_the_reason(setup):
    proc, root, _ = setup
    big = root / "big"
    shutil.copytree(root / "mlp16", big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
    cases = [({"lora_name": "a", "lora_path": str(root / "nowhere")}, "lora_path", "does not exist"),
             ({"lora_name": "b", "lora_path": str(big)}, "lora_path", "rank 64 exceeds max_lora_rank=16"),
             ({"lora_name": "all8", "lora_path": str(root / "qv4")}, "lora_name", "already served"),
             ({"lora_name": "tiny", "lora_path": str(root / "qv4")}, "lora_name", "already served"),
             ({"lora_name": "c"}, "lora_path", "")]
    for body, param, reason in cases:
        r = httpx.post(proc.url + "/v1/load_lora_adapter", json=body, headers=proc.headers)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert param in (err.get("param") or "") + err["message"] and reason in err["message"], err


def test_adapter_composes_with_structured_output(setup):
    """An adapter's request under a regex constraint: the output follows it (the grammar's mask
    applies to the adapter's logits as to the base model's)."""
    import re

    proc, _, _ = setup
    out = _client(proc).completions.create(model="all8", prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert out.model == "all8" and re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text), out.choices[0].text
