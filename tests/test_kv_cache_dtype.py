"""kv_cache_dtype="fp8": K/V stored as 8-bit floats, token-exact with HF transformers whose attention reads K/V rounded
the same way (an independent oracle: HF's own model, with only the rounding added in front of its attention)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.config import EngineConfig
from nanoref.ops import attention_torch
from nanoref.ops.backends import choose_backend
from nanoref.ops.store_kvcache import store_kvcache_torch, to_cache_dtype
from nanoref.speculative.runner import draft_engine_config

from .helpers import (
    assert_no_block_leaked,
    hf_greedy,
    random_paged_decode,
    random_paged_varlen,
    random_prompts,
    serve_settings,
    shared_prefix_prompts,
)

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs Triton"))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def device_for(backend: str) -> torch.device:
    """Where a backend's test runs: the torch reference on the CPU; Triton's kernels on the GPU of a GPU machine
    (there they are compiled, and cannot read CPU tensors), under the interpreter on the CPU elsewhere."""
    if backend == "torch":
        return torch.device("cpu")
    from nanoref.ops.triton_setup import kernel_device

    return kernel_device()


def hf_fp8_greedy(folder, prompt: list[int], max_new_tokens: int, kv_cache_dtype: str) -> list[int]:
    """HF `generate`, greedy, float32, its attention reading every key and value rounded to the 8-bit format
    (saturated at its largest value), the way a cache of that dtype holds them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = FP8[kv_cache_dtype]
    name = f"test_{kv_cache_dtype}_kv"

    def rounded_kv_attention(module, query, key, value, attention_mask, **kwargs):
        largest = torch.finfo(dtype).max
        key = key.clamp(-largest, largest).to(dtype).to(query.dtype)
        value = value.clamp(-largest, largest).to(dtype).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, rounded_kv_attention)  # (the same function under that name every time)
    return hf_greedy(folder, prompt, max_new_tokens, attn_implementation=name)


def assert_matches_hf_fp8(folder, prompts, outputs, kv_cache_dtype: str) -> None:
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        expected = hf_fp8_greedy(folder, prompt, len(output["token_ids"]), kv_cache_dtype)
        assert output["token_ids"] == expected, f"prompt {i} (len {len(prompt)}) differs from HF with {kv_cache_dtype}"


# -- settings -------------------------------------------------------------------------------------


def test_an_unknown_kv_cache_dtype_is_named(tiny_model):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\]"):
        EngineConfig(tiny_model, device="cpu", kv_cache_dtype="int8")


def test_backends_that_cannot_read_an_fp8_cache_refuse_it_and_auto_avoids_them():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # (a device object: no GPU needed to choose)
    for name, device in (("cpp", cpu), ("flash_attn", cuda)):
        with pytest.raises(ValueError, match=r"model's dtype only.*'triton' or 'flash_attn\+triton' \(CUDA\)"):
            choose_backend(name, device, torch.bfloat16, None, 128, cache_dtype=torch.float8_e4m3fn)
    # auto on a CPU: torch even where the C++ kernels build
    assert choose_backend("auto", cpu, torch.float32, None, 64, cache_dtype=torch.float8_e4m3fn) == "torch"
    assert choose_backend("torch", cpu, torch.float32, None, 64, cache_dtype=torch.float8_e5m2) == "torch"


def test_auto_on_cuda_gives_an_fp8_cache_flash_attn_triton_where_flash_attn_serves_and_never_flash_attn_alone(
    monkeypatch,
):
    """On an H100, flash-attn's prefill beside Triton's decode ran the benchmark 3% faster than Triton alone with an
    fp8 cache; without Triton, flash-attn alone cannot read the cache, so auto falls back to torch (not flash_attn)."""
    from nanoref.ops import backends

    cuda, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    monkeypatch.setattr(backends, "flash_attn_serves", lambda head_dim, dtype: True)
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    assert choose_backend("auto", cuda, torch.bfloat16, None, 128, cache_dtype=fp8) == "flash_attn+triton"
    assert choose_backend("auto", cuda, torch.bfloat16, 16, 128, cache_dtype=fp8) == "triton"  # blocks too small
    monkeypatch.setattr(backends, "flash_attn_available", lambda: False)
    assert choose_backend("auto", cuda, torch.bfloat16, None, 128, cache_dtype=fp8) == "triton"
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert choose_backend("auto", cuda, torch.bfloat16, None, 128, cache_dtype=fp8) == "torch"
    assert choose_backend("auto", cuda, torch.bfloat16, None, 128) == "flash_attn"  # a bf16 cache: flash-attn alone


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_flash_attn_triton_gives_flash_attn_a_prompts_own_kv_widened_and_triton_the_history(monkeypatch):
    """flash_attn+triton over an 8-bit cache: flash-attn (a stand-in here, recording what it is given) takes an
    unpaged prefill's K/V widened back to q's dtype, exactly the rounded values; a prefill over cached history goes
    to Triton's paged varlen kernel, which reads the 8-bit cache itself. A bf16 cache passes through unchanged."""
    import sys
    import types

    from nanoref.ops import attention_triton, backends

    given = []

    def fake_varlen(q, k, v, *args, **kwargs):
        given.append((k.dtype, v.dtype, kwargs.get("block_table")))
        return attention_torch.varlen_attention(q, k, v, *args, **kwargs)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake_varlen
    fake.flash_attn_with_kvcache = None  # (decode is Triton's in this backend)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    backend = backends._flash_attn_triton_backend()
    assert backend.decode is attention_triton.paged_decode_attention

    g = torch.Generator().manual_seed(5)
    device = device_for("triton")
    fp8 = torch.float8_e4m3fn
    full = random_paged_varlen([3, 5], [3, 5], 16, 4, 2, 32, torch.float32, g).to(device)
    k8, v8 = to_cache_dtype(full.k_flat, fp8), to_cache_dtype(full.v_flat, fp8)
    lens = dict(max_seqlen_q=5, max_seqlen_k=5, causal=True)
    out = backend.varlen(full.q, k8, v8, full.cu_q, full.cu_k, **lens)  # a prompt's own K/V, as the cache holds them
    assert given == [(torch.float32, torch.float32, None)]
    expected = attention_torch.varlen_attention(full.q, k8.float(), v8.float(), full.cu_q, full.cu_k, **lens)
    torch.testing.assert_close(out, expected)

    history = random_paged_varlen([2, 3], [9, 20], 16, 4, 2, 32, torch.float32, g).to(device)
    k_cache, v_cache = history.k_cache.to(fp8), history.v_cache.to(fp8)
    args = (history.cu_q, history.cu_k, 3, 20)
    out = backend.varlen(history.q, k_cache, v_cache, *args, causal=True, block_table=history.block_table)
    assert len(given) == 1  # not flash-attn's
    expected = attention_torch.varlen_attention(
        history.q, k_cache, v_cache, *args, causal=True, block_table=history.block_table
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)

    backend.varlen(full.q, full.k_flat, full.v_flat, full.cu_q, full.cu_k, **lens)  # a cache in q's dtype
    assert given[-1] == (torch.float32, torch.float32, None) and len(given) == 2


def test_fp8_halves_or_quarters_the_cache_and_the_draft_follows(tiny_model):
    full = LLM(tiny_model, device="cpu", num_kvcache_blocks=8)  # float32 on a CPU
    fp8 = LLM(tiny_model, device="cpu", num_kvcache_blocks=8, kv_cache_dtype="fp8")
    assert fp8.config.attention_backend == "torch"
    assert fp8.model_runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.model_runner.kv_bytes_per_token * 4 == full.model_runner.kv_bytes_per_token
    assert fp8.model_runner.kv_cache.nbytes * 4 == full.model_runner.kv_cache.nbytes
    spec = EngineConfig(
        tiny_model,
        device="cpu",
        kv_cache_dtype="fp8_e5m2",
        speculative_config={"model": str(tiny_model), "num_speculative_tokens": 2},
    )
    assert draft_engine_config(spec).cache_dtype == torch.float8_e5m2


# -- the store: saturate, then round to nearest even -------------------------------------------------


def test_to_cache_dtype_rounds_to_nearest_even_and_saturates():
    # e4m3 keeps 3 mantissa bits: in [1, 2) its values are 0.125 apart, so 1.0625 is a tie between
    # 1.0 (mantissa 000, even) and 1.125 (001), and 1.1875 one between 1.125 (001) and 1.25 (010, even)
    x = torch.tensor([1.0625, 1.1875, 1.07, -1.0625, 500.0, -1e9, 448.0])
    got = to_cache_dtype(x, torch.float8_e4m3fn).float()
    assert got.tolist() == [1.0, 1.25, 1.125, -1.0, 448.0, -448.0, 448.0]
    # e5m2: 2 mantissa bits; its largest finite value is 57344, and a plain cast of 1e9 would be inf
    got = to_cache_dtype(torch.tensor([1.125, 1.375, 1e9, -1e9]), torch.float8_e5m2).float()
    assert got.tolist() == [1.0, 1.5, 57344.0, -57344.0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_store_writes_the_rounded_rows_into_their_slots(backend, kv_cache_dtype):
    g = torch.Generator().manual_seed(7)
    dtype, device = FP8[kv_cache_dtype], device_for(backend)
    key = torch.randn(5, 2, 16, generator=g) * 300  # (N, Hk, D): e4m3 saturates some of these
    value = torch.randn(5, 2, 16, generator=g)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=dtype, device=device)  # (num_blocks, block_size, Hk, D)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, -1, 12, 0, 9])
    store = store_kvcache_torch
    if backend == "triton":
        from nanoref.ops.store_kvcache_triton import store_kvcache_triton as store
    store(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    largest = torch.finfo(dtype).max
    rows_k, rows_v = k_cache.cpu().view(16, 2, 16).float(), v_cache.cpu().view(16, 2, 16).float()
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(rows_k[slot], key[token].clamp(-largest, largest).to(dtype).float())
        assert torch.equal(rows_v[slot], value[token].to(dtype).float())
    stored = {3, 12, 0, 9}
    untouched = [s for s in range(16) if s not in stored]
    assert not rows_k[untouched].any() and not rows_v[untouched].any()  # the -1 token wrote nothing


# -- attention over an fp8 cache: the oracle on the same rounded K/V -------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("len_q", [1, 3])
def test_paged_decode_over_an_fp8_cache_matches_the_oracle(backend, len_q):
    g = torch.Generator().manual_seed(11 + len_q)
    full = random_paged_decode([5, 37, 64, 1 + len_q], 16, 8, 2, 32, torch.float32, g, len_q=len_q)
    full = full.to(device_for(backend))
    fp8 = torch.float8_e4m3fn
    rounded = replace(  # the cache as 8-bit floats; the oracle's flat K/V the same values, widened to float32
        full,
        k_cache=full.k_cache.to(fp8),
        v_cache=full.v_cache.to(fp8),
        k_flat=full.k_flat.to(fp8).float(),
        v_flat=full.v_flat.to(fp8).float(),
    )
    if backend == "torch":
        decode = attention_torch.paged_decode_attention
    else:
        from nanoref.ops.attention_triton import paged_decode_attention as decode
    got = decode(rounded.q, rounded.k_cache, rounded.v_cache, rounded.seqlens, rounded.block_table, causal=True)
    got = got.flatten(0, 1)  # (B, Lq, H, D) -> (B * Lq, H, D), the oracle's layout
    torch.testing.assert_close(got, rounded.oracle(), atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got, full.oracle(), atol=1e-3)  # the rounding mattered: full precision differs


# -- the engine, end to end --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_engine_matches_hf_reading_rounded_kv(tiny_model, backend, kv_cache_dtype):
    prompts = random_prompts(seed=3, lengths=[1, 9, 17, 40])
    llm = LLM(
        tiny_model,
        device=device_for(backend),
        dtype="float32",
        attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        num_kvcache_blocks=64,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf_fp8(tiny_model, prompts, outputs, kv_cache_dtype)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_chunks_and_prefix_hits_read_the_same_rounded_history(tiny_model, backend):
    """A chunk after the first, and a prompt whose prefix is cached, attend to their history through the fp8
    cache; a fresh prompt's own K/V are rounded the same way, so every path gives HF-with-rounded-K/V's tokens."""
    prompts = shared_prefix_prompts(seed=4, prefix_len=32, suffix_lens=[5, 19])
    llm = LLM(
        tiny_model,
        device=device_for(backend),
        dtype="float32",
        attention_backend=backend,
        kv_cache_dtype="fp8",
        num_kvcache_blocks=64,
        max_num_batched_tokens=24,  # every prompt prefilled in chunks
    )
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)  # the shared prefix is a cache hit now
    assert llm.scheduler.block_manager.num_hit_blocks > 0
    assert_matches_hf_fp8(tiny_model, prompts, first + rest, "fp8")


def test_fp8_speculative_verify_reads_the_fp8_cache(tiny_model):
    """n-gram speculation: a verify step's k + 1 queries per sequence attend to the fp8 cache (decode with Lq > 1)."""
    prompts = [[5, 6, 7, 8] * 6, random_prompts(seed=5, lengths=[21])[0]]
    llm = LLM(
        tiny_model,
        device="cpu",
        attention_backend="torch",
        kv_cache_dtype="fp8",
        num_kvcache_blocks=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "min_tokens_per_step": 0},
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf_fp8(tiny_model, prompts, outputs, "fp8")


# -- on a GPU: the store kernel rounds in the kernel; the engine with decode CUDA graphs ---------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_gpu_store_kernel_rounds_as_the_torch_reference(kv_cache_dtype):
    """On a GPU the Triton store clamps and rounds inside the kernel: bit for bit what to_cache_dtype gives."""
    from nanoref.ops.store_kvcache_triton import store_kvcache_triton

    g = torch.Generator(device="cuda").manual_seed(3)
    dtype = FP8[kv_cache_dtype]
    key = torch.randn(300, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) * 200  # past e4m3's 448
    value = torch.randn(300, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    key[0, 0, :4] = torch.tensor([1e30, -1e30, 1.0625, 1.1875], dtype=torch.bfloat16)  # e5m2 would give +-inf
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:300]
    caches = [torch.zeros(64, 16, 8, 128, device="cuda", dtype=dtype) for _ in range(4)]
    store_kvcache_triton(key, value, caches[0], caches[1], slots)
    store_kvcache_torch(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert torch.isfinite(caches[0].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_decode_over_an_fp8_cache_under_a_bf16_query_matches_the_oracle(kv_cache_dtype, block_size):
    """Under a bf16 q the Triton decode widens 8-bit K/V to float16 and runs its dots there, with q pre-scaled: a
    q past float16's largest value (65,504) must still give the oracle's answer, not inf or NaN."""
    from nanoref.ops.attention_triton import paged_decode_attention

    g = torch.Generator().manual_seed(21 + block_size)
    lens = [1, 100, 129, 700, 2048]  # one tile, part tiles, many 128-key tiles
    for len_q in (1, 2):
        full = random_paged_decode(lens, block_size, 16, 8, 128, torch.bfloat16, g, len_q=len_q).to("cuda")
        q = full.q.clone()
        q[1, :, 3] *= 3e4  # one head of one sequence past float16's range (|q| to ~1e5): a near one-hot softmax
        dtype = FP8[kv_cache_dtype]
        rounded = replace(  # the oracle reads the same 8-bit values, widened to float32, and a float32 q
            full,
            q=q.float(),
            k_cache=full.k_cache.to(dtype),
            v_cache=full.v_cache.to(dtype),
            k_flat=full.k_flat.to(dtype).float(),
            v_flat=full.v_flat.to(dtype).float(),
        )
        got = paged_decode_attention(q, rounded.k_cache, rounded.v_cache, full.seqlens, full.block_table)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.flatten(0, 1).float(), rounded.oracle(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_flash_attn_triton_prefill_over_an_fp8_cache_matches_triton():
    """With flash-attn installed: flash_attn+triton's prefill over an 8-bit cache (flash-attn on a prompt's own K/V
    widened to bf16, Triton on cached history) against Triton's kernel reading the same 8-bit values."""
    pytest.importorskip("flash_attn")
    from nanoref.ops import attention_triton
    from nanoref.ops.backends import resolve_backend

    backend = resolve_backend("flash_attn+triton", torch.device("cuda"))
    g = torch.Generator().manual_seed(8)
    fp8 = torch.float8_e4m3fn
    fresh = random_paged_varlen([7, 300, 64], [7, 300, 64], 256, 16, 8, 128, torch.bfloat16, g).to("cuda")
    k8, v8 = to_cache_dtype(fresh.k_flat, fp8), to_cache_dtype(fresh.v_flat, fp8)
    lens = dict(max_seqlen_q=300, max_seqlen_k=300, causal=True)
    got = backend.varlen(fresh.q, k8, v8, fresh.cu_q, fresh.cu_k, **lens)
    want = attention_triton.varlen_attention(fresh.q, k8, v8, fresh.cu_q, fresh.cu_k, **lens)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    history = random_paged_varlen([5, 40], [300, 600], 256, 16, 8, 128, torch.bfloat16, g).to("cuda")
    k_cache, v_cache = history.k_cache.to(fp8), history.v_cache.to(fp8)
    args = (history.cu_q, history.cu_k, 40, 600)
    got = backend.varlen(history.q, k_cache, v_cache, *args, causal=True, block_table=history.block_table)
    cpu = history.to("cpu")  # the torch reference in float32 on the CPU, where its float8 gathers are known to work
    k_cpu, v_cpu, args_cpu = k_cache.cpu(), v_cache.cpu(), (cpu.cu_q, cpu.cu_k, 40, 600)
    expected = attention_torch.varlen_attention(
        cpu.q.float(), k_cpu, v_cpu, *args_cpu, causal=True, block_table=cpu.block_table
    )
    torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_fp8_engine_with_graphs_matches_eager_and_hf(tiny_model):
    prompts = random_prompts(seed=14, lengths=[3, 9, 17, 25, 33, 1, 40, 12, 5, 30])
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=128, max_num_seqs=16, kv_cache_dtype="fp8")
    eager = LLM(tiny_model, enforce_eager=True, **kwargs)
    graphed = LLM(tiny_model, **kwargs)
    assert graphed.config.attention_backend == "triton" and graphed.model_runner.decode_graphs is not None
    out_graph = graphed.generate(prompts, GREEDY, use_tqdm=False)
    assert out_graph == eager.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf_fp8(tiny_model, prompts, out_graph, "fp8")


def test_the_serve_command_passes_kv_cache_dtype_and_names_a_bad_one(capsys, monkeypatch):
    pytest.importorskip("fastapi", reason="the server needs fastapi")
    from nanoref.serve import main

    assert serve_settings(monkeypatch, ["--kv-cache-dtype", "fp8_e5m2"])["kv_cache_dtype"] == "fp8_e5m2"
    assert main(["--device", "cpu", "--port", "0", "--kv-cache-dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype must be one of ['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'], got 'int8'" in err


def test_fp8_moe_model_matches_hf_reading_rounded_kv(tmp_path):
    from nanoref.testing import make_tiny_qwen3_moe

    folder = make_tiny_qwen3_moe(tmp_path / "moe", seed=3)
    prompts = random_prompts(seed=6, lengths=[4, 23])
    llm = LLM(folder, device="cpu", attention_backend="torch", kv_cache_dtype="fp8", num_kvcache_blocks=32)
    assert_matches_hf_fp8(folder, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), "fp8")


@pytest.mark.slow  # two spawned gloo ranks
def test_fp8_with_two_ranks_matches_hf_reading_rounded_kv(tiny_model):
    """Each rank keeps its own heads' K/V in its own fp8 cache."""
    prompts = random_prompts(seed=7, lengths=[5, 30])
    with LLM(tiny_model, device="cpu", tensor_parallel_size=2, kv_cache_dtype="fp8", num_kvcache_blocks=32) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf_fp8(tiny_model, prompts, outputs, "fp8")
