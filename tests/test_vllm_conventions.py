"""vLLM's habits that pagedserve keeps: the model's generation_config.json gives the defaults of
omitted sampling fields (shown in /v1/models), --chat-template, --max-logprobs,
--disable-log-requests/--disable-log-stats, --seed, and models named by a Hugging Face Hub id
(found in the local Hub cache; a clear error when neither cache nor network has them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from server_helpers import EMBEDDED_DEFAULTS, ServerProcess, wait_idle

from pagedserve.models.generation_defaults import sampling_defaults
from pagedserve.models.source import resolve_model
from pagedserve.server.protocol import ChatCompletionRequest

MODEL = "smollm2-135m-instruct"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


def test_generation_config_modes(tmp_path):
    qwen = resolve_model("qwen3-4b-instruct-2507")
    assert sampling_defaults(qwen, "auto") == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert sampling_defaults(qwen, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_k": 5, "max_new_tokens": 9, "do_sample": True, "min_p": 0.05,
         "repetition_penalty": 1.1, "top_p": "bad"}))
    assert sampling_defaults(qwen, str(tmp_path)) == {
        "temperature": 0.3, "top_k": 5, "max_tokens": 9, "min_p": 0.05, "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(qwen, str(tmp_path / "missing"))
    # The embedded model's GGUF carries none: pagedserve's measured choice is served as its
    # generation_config.json (benchmarks/default_sampling.py), by either of its names.
    for embedded in (resolve_model(None), resolve_model(MODEL)):
        assert sampling_defaults(embedded, "auto") == EMBEDDED_DEFAULTS
        assert sampling_defaults(embedded, "vllm") == {}
    assert sampling_defaults(resolve_model(MODEL, load_format="dummy"), "auto") == {}  # the preset


def test_defaults_fill_only_omitted_fields():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5,
                                 repetition_penalty=1.0)
    p = body.with_defaults(defaults).sampling_params(10, None)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.7, 0.5, 20, 1.0)
    nulls = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=None)
    assert nulls.with_defaults(defaults).sampling_params(10, None).temperature == 0.7
    bare = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(10, None)
    assert (bare.temperature, bare.top_p, bare.top_k) == (1.0, 1.0, 0)


@pytest.fixture(scope="module")
def vserver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("genconfig")
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 4, "top_k": 3}))
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess("--generation-config", str(folder), "--chat-template", str(template),
                         "--max-logprobs", "2", "--disable-log-requests", "--disable-log-stats",
                         "--log-stats-interval", "0.5", "--log-level", "INFO").wait_ready()
    yield proc
    proc.stop()


def test_models_show_the_defaults_and_omitted_fields_take_them(vserver):
    client = openai.OpenAI(base_url=vserver.url + "/v1", api_key="x")
    card = httpx.get(vserver.url + "/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {"temperature": 0.0, "max_tokens": 4, "top_k": 3}
    msgs = [{"role": "user", "content": "Name three colours."}]
    eos = {"ignore_eos": True}  # (the test's chat template can make EOS the likeliest token)
    omitted = client.chat.completions.create(model=MODEL, messages=msgs, extra_body=eos)
    assert omitted.usage.completion_tokens == 4 and omitted.choices[0].finish_reason == "length"
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4,
                                            extra_body=eos)
    assert omitted.choices[0].message.content == greedy.choices[0].message.content
    longer = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7, extra_body=eos)
    assert longer.usage.completion_tokens == 7
    comp = client.completions.create(model=MODEL, prompt="The sky is", extra_body=eos)
    assert comp.usage.completion_tokens == 4  # the model's default, not OpenAI's 16
    comp16 = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=16,
                                       extra_body=eos)
    assert comp16.usage.completion_tokens == 16
    wait_idle(vserver.url)


def test_chat_template_flag_replaces_the_models(vserver):
    from pagedserve.models.default_model import default_model_dir
    from pagedserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    r = httpx.post(vserver.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1})
    expected = len(tok.encode("[user] hello there\n[assistant]", add_special_tokens=False))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == expected


def test_max_logprobs(vserver):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True}
    ok = httpx.post(vserver.url + "/v1/chat/completions", json={**body, "top_logprobs": 2})
    assert ok.status_code == 200
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    bad = httpx.post(vserver.url + "/v1/chat/completions", json={**body, "top_logprobs": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    assert "--max-logprobs" in bad.json()["error"]["message"]
    bad = httpx.post(vserver.url + "/v1/completions",
                     json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


def test_no_request_or_stats_lines(vserver):
    httpx.post(vserver.url + "/v1/completions",
               json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "someone"})
    import time

    time.sleep(1.5)  # three stats intervals
    log = vserver.log_path.read_text()
    assert "engine core ready" in log  # INFO lines are on
    assert "POST /v1/completions" not in log and "is from user" not in log
    assert "running:" not in log and "tokens/s" not in log


def _fake_hub(tmp_path, smollm2_dir, repo="TestOrg/tiny-chat", commit="a" * 40):
    """A Hugging Face Hub cache under tmp_path/hub holding the embedded model as `repo`."""
    base = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for f in smollm2_dir.iterdir():
        if f.suffix in (".json", ".safetensors", ".jinja") and f.name != "pagedserve_cache.json":
            (snap / f.name).symlink_to(f)
    return tmp_path


def _env(home) -> dict:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    return env


def test_a_hub_id_is_found_in_the_local_cache(tmp_path, smollm2_dir):
    home = _fake_hub(tmp_path, smollm2_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "generate", "TestOrg/tiny-chat", "--device", "cpu",
         "--kv-cache-memory", str(64 << 20), "-p", "The capital of France is", "--max-tokens", "3",
         "--temperature", "0"], capture_output=True, text=True, timeout=180, env=_env(home))
    assert proc.returncode == 0, proc.stderr
    assert "3 generated" in proc.stdout


def test_a_hub_id_nowhere_to_be_found_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "TestOrg/not-here", "--device", "cpu"],
        capture_output=True, text=True, timeout=60, env=_env(tmp_path))
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert "TestOrg/not-here is not in the Hugging Face cache" in err
    assert "hf download TestOrg/not-here" in err and "Traceback" not in proc.stderr


def test_a_preset_hub_id_with_dummy_weights_needs_no_download(tmp_path):
    src = resolve_model("Qwen/Qwen3-4B-Instruct-2507", load_format="dummy")
    assert src.is_preset and not src.from_hub


def test_seed_makes_unseeded_sampling_reproducible():
    from pagedserve import LLM, SamplingParams

    def sample(seed: int) -> str:
        llm = LLM(device="cpu", kv_cache_memory=32 << 20, seed=seed, enforce_eager=True)
        params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
        return llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].text

    first = sample(0)
    assert sample(0) == first
    assert sample(1) != first
