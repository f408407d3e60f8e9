"""Replica routing, without Ray (issue 28): the conversation key stays the same across a
conversation's turns and differs between conversations; the affinity policy keeps a
conversation on its replica unless that replica is too busy or gone, and sends new ones to
the least loaded; `serve-ray`'s flags become the Ray Serve options they name, and flags of a
listener it does not have are refused."""

from __future__ import annotations

import pytest

from pagedserve.server.affinity import AffinityPolicy, conversation_key

SYSTEM = {"role": "system", "content": "You are terse."}


def _chat(*turns: str) -> dict:
    messages = [SYSTEM]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"answer {i}"})
    return {"model": "m", "messages": messages}


def test_a_conversation_keeps_its_key_across_turns():
    a1, a3 = conversation_key(_chat("plan a trip")), conversation_key(_chat("plan a trip", "more", "less"))
    assert a1 == a3 and a1 != conversation_key(_chat("write a poem"))
    # the shared system prompt alone does not make two conversations one
    assert conversation_key({"messages": [SYSTEM]}) != a1
    # the Responses API: input items as chat messages, instructions count
    items = {"input": _chat("plan a trip", "more")["messages"]}
    assert conversation_key(items) == conversation_key({"input": _chat("plan a trip")["messages"]})
    assert conversation_key({**items, "instructions": "x"}) != conversation_key(items)
    # prompts: text by its beginning, token ids too, a batch by its first prompt
    long = "x" * 5000
    assert conversation_key({"prompt": long + "a"}) == conversation_key({"prompt": long + "b"})
    assert conversation_key({"prompt": [1, 2, 3]}) != conversation_key({"prompt": [1, 2, 4]})
    assert conversation_key({"prompt": ["p", "q"]}) == conversation_key({"prompt": "p"})
    assert conversation_key({"prompt": ""}) is None and conversation_key({}) is None


def test_prompt_cache_key_names_the_conversation():
    """OpenAI's prompt_cache_key wins over the messages: the same key, different first
    messages, one conversation; different keys on the same messages, two."""
    k = conversation_key({**_chat("plan a trip"), "prompt_cache_key": "user-7"})
    assert k == conversation_key({**_chat("write a poem"), "prompt_cache_key": "user-7"})
    assert k == conversation_key({"prompt": "anything", "prompt_cache_key": "user-7"})
    assert k != conversation_key({**_chat("plan a trip"), "prompt_cache_key": "user-8"})
    assert k != conversation_key(_chat("plan a trip"))
    # an empty or non-string key is no key: the messages decide
    assert conversation_key({**_chat("x"), "prompt_cache_key": ""}) == conversation_key(_chat("x"))


def test_the_policy_keeps_conversations_home_until_their_replica_is_too_busy():
    policy = AffinityPolicy(max_imbalance=2)
    assert policy.choose("k", {"a": 3, "b": 1, "c": 1})[0] in {"b", "c"}  # new: least loaded
    assert policy.choose("k", {"a": 3, "b": 1, "c": None})[-1] == "a"
    policy.routed("k", "a")  # (Ray may have taken another than the first: what counts is where it went)
    assert policy.choose("k", {"a": 3, "b": 1, "c": 2})[0] == "a"  # 2 busier: still home
    assert policy.choose("k", {"a": None, "b": 0})[0] == "a"  # load not known: home
    assert policy.choose("k", {"a": 4, "b": 1})[0] == "b"  # 3 busier: moves
    policy.routed("k", "a")
    policy.routed("k", "b")
    assert (policy.new, policy.kept, policy.moved) == (1, 1, 1)
    assert policy.choose("k", {"a": 0, "b": 0})[0] == "b"  # its new home
    policy.forget_replica("b")
    assert policy.choose("k", {"a": 5, "c": 0})[0] == "c"
    assert policy.choose(None, {}) == []


def test_new_conversations_share_equal_replicas_and_memory_is_bounded():
    policy = AffinityPolicy(capacity=100)
    firsts = [policy.choose(f"conv{i}", {"a": 0, "b": 0, "c": 0, "d": 0})[0] for i in range(400)]
    counts = {r: firsts.count(r) for r in "abcd"}
    assert min(counts.values()) > 60, counts  # (hash tie-break: about 100 each)
    for i in range(400):
        policy.routed(f"conv{i}", firsts[i])
    assert len(policy._where) == 100 and "conv399" in policy._where and "conv0" not in policy._where


def _serve_ray_args(*flags: str):
    from pagedserve.cli.main import build_parser

    return build_parser().parse_args(["serve-ray", "--device", "cpu", *flags])


def test_serve_ray_flags_become_ray_serve_options(smollm2_dir):
    from pagedserve.replicas.args import parse_replica_args

    _, engine, replicas = parse_replica_args(_serve_ray_args("--num-replicas", "3", "--max-ongoing-requests", "64",
                                                         "--replica-cpus", "2", "--max-imbalance", "7",
                                                         "--max-num-seqs", "32"), gpus_available=8)
    options = replicas.deployment_options()
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["max_ongoing_requests"] == 64
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}  # (--device cpu)
    assert options["request_router_config"].request_router_kwargs == {"max_imbalance": 7}
    assert engine.max_num_seqs == 32
    _, _, replicas = parse_replica_args(_serve_ray_args("--num-replicas", "2", "--min-replicas", "1",
                                                        "--max-replicas", "6", "--target-ongoing-requests", "24"),
                                        gpus_available=0)
    auto = replicas.deployment_options()["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 6, "initial_replicas": 2, "target_ongoing_requests": 24.0}
    args = _serve_ray_args("--tensor-parallel-size", "1")
    args.device = "auto"
    assert parse_replica_args(args, gpus_available=4)[2].gpus == 1.0  # a GPU per rank


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-keyfile", "k", "--ssl-certfile", "c"], "--ssl-keyfile configures"),
    (["--timeout-keep-alive", "9"], "--timeout-keep-alive configures"),
    (["--min-replicas", "2"], "--min-replicas needs --max-replicas"),
    (["--num-replicas", "5", "--max-replicas", "4"], r"--num-replicas \(5\) <= --max-replicas \(4\)"),
    (["--device", "cuda"], "the Ray cluster has no GPU"),
])
def test_serve_ray_refuses_what_it_cannot_do(flags, message, smollm2_dir):
    """Each refusal names the flag (the listener's flags parse, but serve-ray's --help leaves
    them out: Ray Serve's proxy listens)."""
    from pagedserve.replicas.args import parse_replica_args

    with pytest.raises(ValueError, match=message):
        parse_replica_args(_serve_ray_args(*flags), gpus_available=0)


def test_ray_serve_can_import_the_application(smollm2_dir):
    """`serve run pagedserve.replicas.app:app_builder model=... num-replicas=2` builds the
    application from serve-ray's flags (Ray's own CLI passes them as key=value)."""
    from ray.serve import Application

    from pagedserve.replicas.app import app_builder

    app = app_builder({"model": str(smollm2_dir), "device": "cpu", "num-replicas": "2",
                       "enforce-eager": "true", "max-imbalance": "3"})
    assert isinstance(app, Application)
    with pytest.raises(SystemExit):  # (argparse's one-line error for an unknown flag)
        app_builder({"model": str(smollm2_dir), "no-such-flag": "1"})


def test_serve_ray_help_lists_no_flag_it_refuses():
    from pagedserve.replicas.args import _LISTENER_FLAGS, replica_parser

    text = replica_parser().format_help()
    assert "--num-replicas" in text and "--max-num-seqs" in text and "--api-key" in text
    for name in _LISTENER_FLAGS:
        assert f"--{name.replace('_', '-')} " not in text, name
