"""kernels/compile_ahead.py: a start-up phase's Triton launches become parallel compiles.

Checked on the CPU by watching `JITFunction.run` (the real compiles need a GPU driver; the
GPU check script measures what the rehearsal saves)."""

import pytest

pytest.importorskip("triton")


def _noop(x):  # wrapped as a Triton kernel below; never compiled here, only its launches watched
    pass


def test_launches_become_compile_requests_inside_the_rehearsal_only(monkeypatch):
    from triton.runtime._async_compile import active_mode
    from triton.runtime.jit import JITFunction

    from pagedserve.kernels.compile_ahead import compile_ahead

    calls = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        calls.append((args, grid, warmup, kwargs))

    monkeypatch.setattr(JITFunction, "run", fake_run)
    kernel = JITFunction(_noop)
    seen_modes = []

    def phase():
        seen_modes.append(active_mode.get())
        kernel[(4,)](7, num_warps=2)
        kernel[(2,)](8)

    seconds = compile_ahead(phase, "test phase", workers=2)
    assert seconds >= 0 and len(seen_modes) == 1 and seen_modes[0] is not None  # Triton's async compiles
    assert calls == [((7,), (4,), True, {"num_warps": 2}), ((8,), (2,), True, {})]
    assert active_mode.get() is None
    kernel[(1,)](9)  # afterwards a launch is a launch again
    assert calls[-1] == ((9,), (1,), False, {})

    def failing():
        kernel[(1,)](10)
        raise RuntimeError("phase failed")

    with pytest.raises(RuntimeError, match="phase failed"):
        compile_ahead(failing, "failing phase", workers=1)
    assert JITFunction.run is fake_run and calls[-1][2] is True
    kernel[(1,)](11)
    assert calls[-1][2] is False


def test_each_compile_job_also_builds_the_launcher(monkeypatch):
    """Triton builds a kernel's launcher at its first launch; the pool builds it right after
    compiling, and a failure there is left for that first launch to report."""
    from types import SimpleNamespace

    from triton.runtime.driver import driver

    from pagedserve.kernels.compile_ahead import _CompileAndBuildLauncher

    built = []

    def launcher_cls(src, metadata):
        if src == "bad":
            raise RuntimeError("no C compiler")
        built.append((src, metadata))

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=launcher_cls))
    with _CompileAndBuildLauncher(2) as pool:
        good = pool.submit(lambda name: SimpleNamespace(src=name, metadata={"num_warps": 4}), "k1")
        bad = pool.submit(lambda: SimpleNamespace(src="bad", metadata={}))
        assert good.result().src == "k1" and bad.result().src == "bad"
    assert built == [("k1", {"num_warps": 4})]


def test_rehearsals_run_the_first_two_decoder_layers_only():
    """A rehearsal's forward stops after two layers (later ones repeat the second's kernel
    variants): same result as a model cut to two layers; all layers are back afterwards,
    also when the rehearsal fails."""
    import torch

    from pagedserve.attention.backend import AttentionContext, CommonAttentionMetadata
    from pagedserve.attention.torch_ref import TorchReferenceBackend
    from pagedserve.config import ModelConfig
    from pagedserve.models.llama import LlamaForCausalLM

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=32, intermediate_size=32,
                      num_layers=5, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                      qk_norm=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layers = model.layers
    backend = TorchReferenceBackend(2, 1, 16, 0.25)
    backend.bind_kv_caches([torch.zeros(2, 4, 4, 1, 16) for _ in range(5)])
    ids, pos = torch.tensor([3, 7, 1]), torch.arange(3)

    def forward():
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
            slot_mapping=torch.arange(3), block_tables=torch.tensor([[0]], dtype=torch.int32),
            max_query_len=3, max_seq_len=3, query_start_loc_cpu=[0, 3], seq_lens_cpu=[3])
        return model(ids, pos, AttentionContext(backend, backend.metadata(common)))

    with torch.no_grad():
        full = forward()
        with model.first_layers_only(2):
            assert len(model.layers) == 2
            short = forward()
        assert model.layers is layers
        assert torch.equal(forward(), full) and not torch.allclose(short, full)
        model.layers = layers[:2]
        assert torch.equal(forward(), short)
        model.layers = layers
        with pytest.raises(RuntimeError), model.first_layers_only(2):
            raise RuntimeError("rehearsal failed")
        assert model.layers is layers


def test_first_launches_after_start_up_are_logged(caplog):
    """Once the engine is ready every new kernel variant is logged (it stalls a step); turning
    the report off leaves a hook someone else installed alone."""
    import logging

    import triton

    from pagedserve.kernels.compile_ahead import report_late_compiles

    runtime = triton.knobs.runtime
    before = runtime.jit_cache_hook
    try:
        report_late_compiles(True)
        hook = runtime.jit_cache_hook
        with caplog.at_level(logging.INFO, logger="pagedserve.kernels.compile_ahead"):
            go_on = hook(key="k", repr="_decode_kernel[num_warps=4](Q: *bf16)", fn=None,
                         compile={"constants": {"BLOCK_N": 64}}, is_manual_warmup=False, already_compiled=False)
        assert go_on is False  # Triton compiles as usual
        assert "_decode_kernel[num_warps=4]" in caplog.text and "BLOCK_N" in caplog.text
        report_late_compiles(False)
        assert runtime.jit_cache_hook is None

        def theirs(**kwargs):
            return False

        runtime.jit_cache_hook = theirs
        report_late_compiles(False)
        assert runtime.jit_cache_hook is theirs
    finally:
        runtime.jit_cache_hook = before
