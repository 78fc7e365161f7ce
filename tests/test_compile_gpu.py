"""CUDA: the compiled element-wise layers and sampler against their eager reference. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.layers.activation import silu_and_mul, silu_and_mul_cuda
from nanoref.layers.layernorm import add_rms_norm, add_rms_norm_cuda, rms_norm, rms_norm_cuda
from nanoref.layers.rotary import RotaryEmbedding, norm_rotary_qk, norm_rotary_qk_cuda, rotary_qk, rotary_qk_cuda
from nanoref.layers.sampler import sample_with_temperature, sample_with_temperature_cuda
from nanoref.utils import seams
from nanoref.utils.compile import eager_only

from .helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.gpu

# bf16 rounding of one ulp either way is allowed: inductor may order the float32 arithmetic differently
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 300])  # several sizes: one dynamic-shape compile must serve them all
def test_compiled_norms_and_activation_equal_eager(dtype, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, 256, device="cuda", generator=g).to(dtype) * 4
    residual = torch.randn(n, 256, device="cuda", generator=g).to(dtype)
    weight = torch.randn(256, device="cuda", generator=g).to(dtype)
    torch.testing.assert_close(rms_norm_cuda(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **TOL[dtype])
    heads = x.view(n, 2, 128)  # (N, H, D): the per-head q/k norm's shape
    torch.testing.assert_close(
        rms_norm_cuda(heads, weight[:128], 1e-6), rms_norm(heads, weight[:128], 1e-6), **TOL[dtype]
    )
    out_c, res_c = add_rms_norm_cuda(x, residual, weight, 1e-6)
    out_e, res_e = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(res_c, res_e, **TOL[dtype])
    torch.testing.assert_close(out_c, out_e, **TOL[dtype])
    torch.testing.assert_close(silu_and_mul_cuda(x), silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rotary_equals_eager(dtype):
    rope = RotaryEmbedding(64, 4096, 1e6).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    positions = torch.randint(0, 4096, (37,), device="cuda", generator=g)
    q = torch.randn(37, 8, 64, device="cuda", generator=g).to(dtype)
    k = torch.randn(37, 2, 64, device="cuda", generator=g).to(dtype)
    args = (positions, q, k, rope.cos_cache, rope.sin_cache)
    for compiled, eager in zip(rotary_qk_cuda(*args), rotary_qk(*args)):
        torch.testing.assert_close(compiled, eager, **TOL[dtype])


def test_compiled_sampler_draws_from_the_distribution():
    logits = torch.tensor([[0.0, 1.0986123, -30.0]], device="cuda").repeat(20000, 1)  # p = 1/4, 3/4, ~0
    noise = torch.empty(20000, 3, device="cuda").exponential_(generator=torch.Generator("cuda").manual_seed(0))
    ids = sample_with_temperature_cuda(logits, torch.ones(20000, device="cuda"), noise)
    counts = torch.bincount(ids, minlength=3).tolist()
    assert counts[2] == 0 and abs(counts[1] / 20000 - 0.75) < 0.02, counts
    eager = sample_with_temperature(logits, torch.ones(20000, device="cuda"), noise)
    assert (ids != eager).float().mean().item() < 1e-3  # the same draws, up to float rounding of near-ties


def test_engine_compiled_equals_eager_and_hf(tiny_model):
    prompts = random_prompts(seed=21, lengths=[3, 17, 40, 9, 26])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=128, max_num_seqs=8)
    with eager_only():
        eager = LLM(tiny_model, **kwargs).generate(prompts, params, use_tqdm=False)
    compiled = LLM(tiny_model, **kwargs).generate(prompts, params, use_tqdm=False)
    assert compiled == eager
    for prompt, output in zip(prompts, compiled):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)


def test_seam_replaces_the_compiled_layer(tiny_model):
    calls = []

    def my_rms_norm(x, weight, eps):
        calls.append(x.shape)
        return rms_norm(x, weight, eps)

    llm = LLM(tiny_model, device="cuda", dtype="float32", num_kvcache_blocks=64, enforce_eager=True)
    with seams.use(rms_norm=my_rms_norm):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert calls, "on CUDA the learner's rms_norm must replace the compiled default"


def test_many_engines_of_several_models_in_one_process(tiny_models):
    """A notebook or a test session builds engine after engine: the compiled layers must not recompile per engine
    until dynamo's limit (8 per code object) fails the ninth. Twelve engines over three models, bf16, graphs on."""
    prompts = random_prompts(seed=5, lengths=[4, 11])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = {}
    for round_ in range(4):
        for name, folder in tiny_models.items():
            llm = LLM(folder, device="cuda", num_kvcache_blocks=64, max_num_seqs=4, max_model_len=128 + 32 * round_)
            tokens = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
            assert tokens == first.setdefault(name, tokens), f"engine {round_} of {name} decoded other tokens"
            llm.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_qk_norm_rotary_joins_the_weights_inside_its_own_kernels(dtype):
    """Qwen3's q/k norm + RoPE takes q_norm's and k_norm's weights apart and joins them inside the compiled function:
    joined by the caller, they were an eager copy kernel (CatArrayBatchedCopy) in every layer of every decode step.
    Every kernel it runs is Inductor's own (on an H100, 2026-12-06: a reduction and two or three pointwise kernels,
    181.7 us a Qwen3-0.6B step at batch 256 against 156 + ~50 for one kernel and the copy). Same numbers as eager."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim, n = 16, 8, 128, 37
    rope = RotaryEmbedding(dim, 4096, 1e6).cuda()
    qk = torch.randn(n, heads + kv_heads, dim, device="cuda", generator=g).to(dtype)
    q_weight, k_weight = (torch.rand(dim, device="cuda", generator=g).to(dtype) + 0.5 for _ in range(2))
    positions = torch.randint(0, 4096, (n,), device="cuda", generator=g)
    args = (qk, q_weight.expand(heads, dim), k_weight.expand(kv_heads, dim), 1e-6, positions)
    args += (rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(norm_rotary_qk_cuda(*args), norm_rotary_qk(*args), **TOL[dtype])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        norm_rotary_qk_cuda(*args)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    eager = [name for name in kernels if not name.startswith("triton_")]
    assert kernels and not eager, f"the compiled q/k norm + RoPE ran kernels outside Inductor's: {eager}"
