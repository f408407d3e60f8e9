"""`bench serve` and `bench throughput` take `vllm bench serve`'s and `vllm bench throughput`'s
flag names (issue 25: a vLLM user switches by changing one word), and the earlier names still
give the same settings. Parser-level, plus one tiny run of the vLLM form against a real server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagedserve.bench.datasets import file_dataset, random_dataset
from pagedserve.bench.serve_args import resolve_serve_args, result_path
from pagedserve.bench.serve_metrics import summarize
from pagedserve.cli.main import build_parser, main


def _parse(line: str):
    return build_parser().parse_args(line.split())


def _serve(line: str):
    return resolve_serve_args(_parse("bench serve " + line))


# Settings that name where the result goes or how the target was named, compared separately.
_FORM = {"backend", "host", "port", "save_result", "result_dir", "result_filename", "func"}


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in _FORM}


def test_vllm_names_give_the_settings_of_the_earlier_names(tmp_path):
    vllm = _serve("--dataset-name random --random-input-len 100 --random-output-len 10 "
                  "--random-range-ratio 0.5 --num-prompts 5 --disable-tqdm --num-warmups 3 "
                  "--backend openai-chat --endpoint /v1/chat/completions --host 127.0.0.1 "
                  f"--port 8123 --save-result --result-dir {tmp_path} --result-filename r.json")
    ours = _serve("--dataset random --input-len 100 --output-len 10 --range-ratio 0.5 "
                  "--num-prompts 5 --no-progress --warmup 3 --endpoint chat "
                  f"--base-url http://127.0.0.1:8123 --save-result {tmp_path}/r.json")
    assert _settings(vllm) == _settings(ours)
    assert (vllm.endpoint, vllm.base_url, vllm.input_len, vllm.no_progress) == (
        "chat", "http://127.0.0.1:8123", 100, True)
    assert result_path(vllm, "m") == result_path(ours, "m") == tmp_path / "r.json"
    # vLLM's --backend alone picks the endpoint; a path-form --endpoint alone too
    assert _serve("--backend openai-chat").endpoint == "chat"
    assert _serve("--backend vllm").endpoint == _serve("--endpoint /v1/completions").endpoint == "completions"
    assert _serve("").base_url == "http://127.0.0.1:8000"


def test_vllm_dataset_names_map_to_ours(tmp_path):
    rep = _serve("--dataset-name prefix_repetition --prefix-repetition-prefix-len 32 "
                 "--prefix-repetition-suffix-len 8 --prefix-repetition-num-prefixes 2 "
                 "--prefix-repetition-output-len 4")
    old = _serve("--dataset prefix --prefix-len 32 --input-len 40 --num-prefixes 2 --output-len 4")
    assert (rep.dataset, rep.prefix_len, rep.input_len, rep.num_prefixes, rep.output_len) == (
        old.dataset, old.prefix_len, old.input_len, old.num_prefixes, old.output_len) == (
        "prefix", 32, 40, 2, 4)
    # vLLM's prefix_repetition defaults: 256 + 256 tokens, 10 prefixes; our `prefix` keeps its own
    d = _serve("--dataset-name prefix_repetition")
    assert (d.prefix_len, d.input_len, d.num_prefixes) == (256, 512, 10)
    d = _serve("--dataset prefix")
    assert (d.prefix_len, d.input_len, d.num_prefixes) == (512, 1024, 1)
    data = tmp_path / "conv.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    for line in (f"--dataset-name sharegpt --dataset-path {data}", f"--dataset-path {data}",
                 f"--dataset {data}", f"--dataset-name custom --dataset-path {data}"):
        args = _serve(line)
        assert args.dataset == str(data) and args.dataset_name in ("sharegpt", "custom"), line
    assert _serve("").num_prompts == 1000  # vLLM's default


@pytest.mark.parametrize("line, message", [
    ("--dataset-name sharegpt", "needs --dataset-path"),
    ("--dataset-name sonnet", "use one of random, sharegpt"),
    ("--backend openai-chat --endpoint /v1/completions", "--backend openai-chat sends chat"),
    ("--metric-percentiles 0,50", "must be in"),
    ("--percentile-metrics ttft,speed", "--percentile-metrics"),
    ("--metadata version", "KEY=VALUE"),
])
def test_bad_combinations_are_named(line, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _serve(line)


def test_an_endpoint_outside_the_two_is_refused_at_parse_time(capsys):
    with pytest.raises(SystemExit) as info:
        _parse("bench serve --endpoint /v1/embeddings")
    assert info.value.code == 2 and "/v1/chat/completions" in capsys.readouterr().err


def test_ignore_eos_is_off_by_default_except_for_random_as_in_vllm(tmp_path):
    assert _parse("bench serve").ignore_eos is None  # settled by the dataset
    data = tmp_path / "d.json"
    data.write_text('["hi"]')
    for dataset in ("short", "prefix", "prefix_repetition", f"sharegpt --dataset-path {data}"):
        assert _serve(f"--dataset-name {dataset}").ignore_eos is False, dataset
        assert _serve(f"--dataset-name {dataset} --ignore-eos").ignore_eos is True, dataset
    # vLLM >= 0.12 always ignores EOS for its random dataset; --no-ignore-eos is ours
    assert _serve("").ignore_eos is True and _serve("--dataset-name random").ignore_eos is True
    assert _serve("--no-ignore-eos").ignore_eos is False


def test_save_result_as_a_switch_or_with_a_file(tmp_path):
    assert result_path(_serve(""), "m") is None
    switch = result_path(_serve(f"--save-result --result-dir {tmp_path}"), "HuggingFaceTB/SmolLM2")
    assert switch.parent == tmp_path
    assert re.fullmatch(r"openai-infqps-SmolLM2-\d{8}-\d{6}\.json", switch.name)  # vLLM's pattern
    named = _serve("--save-result --label ours --max-concurrency 4 --request-rate 2 --backend vllm")
    assert re.fullmatch(r"ours-2\.0qps-concurrency4-m-\d{8}-\d{6}\.json", result_path(named, "m").name)
    assert result_path(named, "m").parent == Path(".")
    assert result_path(_serve(f"--save-result {tmp_path}/a.json"), "m") == tmp_path / "a.json"
    assert result_path(_serve(f"--result-dir {tmp_path} --save-result a.json"), "m") == tmp_path / "a.json"


def test_the_vllm_form_measures_a_real_server_and_saves_where_asked(server, tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", server.url, "--backend", "openai",
                 "--endpoint", "/v1/completions", "--dataset-name", "random",
                 "--random-input-len", "16", "--random-output-len", "3", "--random-prefix-len", "8",
                 "--num-prompts", "2", "--num-warmups", "0", "--disable-tqdm", "--save-result",
                 "--result-dir", str(tmp_path), "--metric-percentiles", "50,90",
                 "--metadata", "note=vllm-form"])
    assert code == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    (saved,) = tmp_path.glob("openai-infqps-smollm2-135m-instruct-*.json")
    assert json.loads(saved.read_text()) == result and f"result saved to {saved}" in out
    assert "TTFT mean / p50 / p90 (ms)" in out
    run = result["runs"][0]
    assert run["completed"] == 2 and run["output_tokens"] == 2 * 3  # random: EOS ignored
    assert run["input_tokens"] == 2 * (8 + 16)  # the shared prefix, then the random part
    assert result["ignore_eos"] is True and result["note"] == "vllm-form"
    assert result["dataset"]["random_prefix_len"] == 8


def test_random_prefix_and_fixed_file_output_lengths(tmp_path):
    reqs = random_dataset(4, 10, 3, 0.0, seed=1, prefix_len=5)
    assert all(len(r.prompt) == r.input_len == 15 for r in reqs)
    assert len({tuple(r.prompt[:5]) for r in reqs}) == 1 and len({tuple(r.prompt) for r in reqs}) == 4
    assert random_dataset(4, 10, 3, 0.0, seed=1) == random_dataset(4, 10, 3, 0.0, seed=1, prefix_len=0)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"},
                                                   {"from": "gpt", "value": "a b c"}]}]))
    assert file_dataset(str(data), 1, 16, 0)[0].output_len == 3
    assert file_dataset(str(data), 1, 16, 0, fixed_output_len=7)[0].output_len == 7
    assert _serve(f"--dataset-path {data} --sharegpt-output-len 7").file_output_len == 7


def test_random_prompts_as_text_decode_the_same_ids(smollm2_dir):
    from pagedserve.bench.datasets import text_decoder

    decode, vocab = text_decoder(smollm2_dir)
    ids = random_dataset(3, 12, 4, 0.0, seed=2)
    texts = random_dataset(3, 12, 4, 0.0, seed=2, decode=decode)
    assert vocab == 49152 and [t.output_len for t in texts] == [4] * 3
    assert [t.prompt for t in texts] == [decode(r.prompt) for r in ids]
    assert all(isinstance(t.prompt, str) and t.input_len is None for t in texts)
    # each text encodes back to the asked length, as vllm bench serve's random prompts do
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for n in (12, 300):
        prompts = random_dataset(20, n, 4, 0.0, seed=n, decode=decode)
        assert [len(tok.encode(t.prompt, add_special_tokens=False).ids) for t in prompts] == [n] * 20
    with pytest.raises(ValueError, match="needs --tokenizer DIR"):
        _serve("--random-as-text")
    with pytest.raises(ValueError, match="for --dataset-name random, not short"):
        _serve(f"--dataset-name short --random-as-text --tokenizer {smollm2_dir}")
    assert _serve(f"--random-as-text --tokenizer {smollm2_dir}").random_as_text


def test_random_prompts_as_text_are_tokenized_by_the_server(server, smollm2_dir, tmp_path, capsys):
    """What vllm bench serve sends: the random ids' text, which the server tokenizes (so the
    input token count is the server's: the asked length)."""
    code = main(["bench", "serve", "--base-url", server.url, "--dataset-name", "random",
                 "--random-input-len", "24", "--random-output-len", "2", "--num-prompts", "2",
                 "--num-warmups", "0", "--disable-tqdm", "--random-as-text", "--tokenizer", str(smollm2_dir),
                 "--save-result", str(tmp_path / "r.json")])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = result["runs"][0]
    assert run["completed"] == 2 and run["failed"] == 0
    assert run["input_tokens"] == 2 * 24  # the text re-tokenizes to the asked length
    assert result["dataset"]["prompts_as_text"] == str(smollm2_dir)


def test_extra_percentiles_are_saved_beside_the_usual_ones():
    s = summarize([i / 1000 for i in range(1, 101)], [25, 99.9, 99])
    assert set(s) == {"mean", "median", "p25", "p90", "p95", "p99", "p99.9"}
    assert s["p25"] == pytest.approx(25.75)


def test_throughput_takes_vllm_names():
    vllm = _parse("bench throughput --dataset-name random --random-input-len 40 "
                  "--random-output-len 5 --random-range-ratio 0.2 --disable-tqdm")
    ours = _parse("bench throughput --dataset random --input-len 40 --output-len 5 "
                  "--range-ratio 0.2 --no-progress")
    assert vars(vllm) == vars(ours)
    assert _parse("bench throughput").dataset == "random"  # with range ratio 0: fixed lengths
    assert _parse("bench throughput --dataset fixed").dataset == "fixed"
