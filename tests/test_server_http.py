"""What a vLLM user's clients and proxies expect of the HTTP layer, against real servers:
GET /v1/models/{id}, /version, HEAD /health, CORS (browser preflights, with and without an
API key, restricted origins), --root-path behind a proxy, TLS (and client certificates) with
the real openai client, and the Responses API's reasoning split and mid-stream failure.

Servers: conftest.py's shared `server` (defaults); `guarded` (API key, one allowed origin,
--root-path, a reasoning parser, a served name with a slash, a fault injected into requests
whose prompt holds a chosen token); `tls` (a certificate made here with the openssl command
line, client certificates required)."""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import tokenizers
from server_helpers import EMBEDDED_DEFAULTS, MODEL, ServerProcess

import pagedserve

KEY = "cors-key-1"
ORIGIN = "http://a.example"
PREFIX = "/proxy"
NAMES = ["test-org/smol", "smol"]
# A template that opens <think> at the end of the prompt, and a few-shot pattern SmolLM2 follows
# (as in test_server_errors.py): reasoning, the closing tag, then content.
THINK_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}<think>{% endif %}")
THINK_SHOTS = ("<think>2+2=4</think>\nFour.\n<think>3+3=6</think>\nSix.\n<think>1+1=2</think>\n"
               "Two.\n<think>5+5=10</think>\nTen.\n")


def preflight(url: str, origin: str, method: str = "POST", headers: str = "authorization, content-type"):
    return httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                       "Access-Control-Request-Headers": headers}, timeout=10)


# ---- the shared server (no key, CORS defaults) -------------------------------------------


def test_retrieve_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve(MODEL)
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert model.id == MODEL and model.model_dump(exclude_unset=True) == listed
    assert listed["max_model_len"] == 2048
    # the embedded model's measured defaults (models/embedded/generation_config.json)
    assert listed["sampling_defaults"] == EMBEDDED_DEFAULTS
    assert (listed["quantization"], listed["kv_cache_dtype"]) == (None, "auto")  # its number formats
    for missing in ("gpt-4", "Qwen/Qwen3-4B-Instruct-2507"):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(missing)
        assert e.value.body["code"] == "model_not_found"
        assert e.value.body["message"].startswith(f"The model `{missing}` does not exist.")


def test_version_and_head_health(server):
    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": pagedserve.__version__}
    for path in ("/health", "/ping"):
        r = httpx.head(server.url + path, timeout=10)
        assert r.status_code == 200 and r.content == b""
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert {"get", "head"} <= set(schema["paths"]["/health"])


def test_cors_allows_any_origin_by_default(server):
    r = preflight(server.url + "/v1/chat/completions", "http://anywhere.example")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://anywhere.example"}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# ---- API key, one allowed origin, --root-path, a reasoning parser ---------------------------


FAULTY = "Zanzibar"  # a prompt whose last token triggers a fault in the HTTP process


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, smollm2_dir):
    template = tmp_path_factory.mktemp("tpl") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    tokenizer = tokenizers.Tokenizer.from_file(str(Path(smollm2_dir) / "tokenizer.json"))
    trigger = tokenizer.encode(FAULTY).ids[-1]
    assert trigger not in tokenizer.encode(THINK_SHOTS + "<think>").ids
    proc = ServerProcess("--allowed-origins", json.dumps([ORIGIN]), "--root-path", PREFIX,
                         "--reasoning-parser", "think", "--chat-template", str(template),
                         "--served-model-name", *NAMES, "--inject-faults", f"output={trigger}",
                         api_key=KEY).wait_ready()
    yield proc
    assert not proc.stop(), proc.log_tail()


def test_preflight_needs_no_api_key(guarded):
    """A browser's preflight carries no Authorization header: CORS answers it for the allowed
    origin; the real request then needs the key, and its 401 still carries the CORS header
    so the page can read it. Another origin is refused."""
    for path in ("/v1/responses", "/v1/chat/completions", f"{PREFIX}/v1/models"):
        r = preflight(guarded.url + path, ORIGIN)
        assert r.status_code == 200, (path, r.status_code, r.text)
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = preflight(guarded.url + "/v1/responses", "http://b.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(guarded.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(guarded.url + "/v1/models", headers={"Origin": "http://b.example", **guarded.headers},
                  timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_root_path(guarded):
    """Behind a proxy at /proxy: requests with the prefix (proxy keeps it) and without (proxy
    strips it) reach the same routes; open paths stay open either way; the OpenAPI schema
    names the prefix; the openai client works through the prefixed URL."""
    for path in ("/v1/models", f"{PREFIX}/v1/models"):
        r = httpx.get(guarded.url + path, headers=guarded.headers, timeout=10)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == NAMES
    for path in ("/health", f"{PREFIX}/health", f"{PREFIX}/version"):
        assert httpx.get(guarded.url + path, timeout=10).status_code == 200, path
    assert httpx.get(guarded.url + f"{PREFIX}/v1/models", timeout=10).status_code == 401
    schema = httpx.get(guarded.url + f"{PREFIX}/openapi.json", timeout=10).json()
    assert {"url": PREFIX} in schema.get("servers", [])
    client = openai.OpenAI(base_url=guarded.url + PREFIX + "/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve(NAMES[0]).id == NAMES[0]  # a served name with a slash
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]


def test_responses_reasoning_split(guarded):
    """With a reasoning parser, a response has a reasoning item before its message; the
    reasoning tokens are counted; streamed, the reasoning deltas come in their own item."""
    client = openai.OpenAI(base_url=guarded.url + PREFIX + "/v1", api_key=KEY, max_retries=0,
                           timeout=120)
    kw = {"model": NAMES[1], "input": THINK_SHOTS, "max_output_tokens": 24, "temperature": 0}
    chat = client.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": THINK_SHOTS}],
                                          max_tokens=24, temperature=0).choices[0].message
    reasoning_want = getattr(chat, "reasoning_content", None) or chat.model_extra.get("reasoning_content")
    if not reasoning_want or not chat.content:
        pytest.skip(f"SmolLM2 did not close the think block: {chat}")
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning_want and r.output[0].id.startswith("rs_")
    assert r.output_text == chat.content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.create(**kw, stream=True) as stream:
        events = list(stream)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == reasoning_want and text == chat.content
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens


# ---- TLS, with client certificates ---------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pagedserve-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}",
                 cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{who}.pem", "-days", "2", "-extfile", f"{who}.ext",
                 cwd=d)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is not installed")
    d = tmp_path_factory.mktemp("tls")
    make_certificates(d)
    proc = ServerProcess("--ssl-keyfile", str(d / "server.key"), "--ssl-certfile", str(d / "server.pem"),
                         "--ssl-ca-certs", str(d / "ca.pem"), "--ssl-cert-reqs", "2",
                         "--log-level", "INFO")
    proc.url = proc.url.replace("http://", "https://")
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    ctx.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
    deadline = time.monotonic() + 180
    with httpx.Client(verify=ctx, timeout=2) as http:
        while True:
            assert proc.proc.poll() is None, proc.log_tail()
            with contextlib.suppress(httpx.HTTPError):
                if http.get(proc.url + "/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.25)
    yield proc, ctx, d
    assert not proc.stop(), proc.log_tail()


def test_tls_with_the_openai_client(tls):
    proc, ctx, d = tls
    assert f"on https://127.0.0.1:{proc.port}" in proc.log_tail(20000)
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                           http_client=httpx.Client(verify=ctx))
    assert client.models.retrieve(MODEL).id == MODEL
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    assert r.usage.output_tokens == 3 and r.output_text
    # without a client certificate, with an unknown CA, or in plain HTTP: no answer
    no_cert = ssl.create_default_context(cafile=str(d / "ca.pem"))
    for kw in ({"verify": no_cert}, {"verify": True}):
        with pytest.raises(httpx.HTTPError):
            httpx.get(proc.url + "/health", timeout=10, **kw)
    with pytest.raises(httpx.HTTPError):
        httpx.get(proc.url.replace("https://", "http://") + "/health", timeout=10)


def test_responses_failure_mid_stream(guarded):
    """A request that fails while its output is handled: a 500 with an OpenAI-style body when
    not streamed; streamed, the events end with `error` and `response.failed`. The server
    serves on."""
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    kw = {"model": NAMES[1], "input": FAULTY, "max_output_tokens": 8, "temperature": 0}
    with pytest.raises(openai.InternalServerError) as e:
        client.responses.create(**kw)
    assert e.value.body["code"] == "internal_error"
    with client.responses.create(**kw, stream=True) as stream:
        events = list(stream)
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "internal_error" and events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == events[-2].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert client.responses.create(**{**kw, "input": "Hi"}).usage.output_tokens > 0
