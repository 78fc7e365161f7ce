"""Triton kernels against their torch references and the naive padded oracle (interpreter on CPU).

Every workload is tiny: under the interpreter each program's loop iteration costs ~10 ms.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")
pytestmark = pytest.mark.slow  # the Triton interpreter runs every program in Python on a CPU

from nanoref import LLM, SamplingParams  # noqa: E402
from nanoref.ops import attention_torch, naive_padded_attention, store_kvcache_torch  # noqa: E402
from nanoref.ops.attention_triton import (  # noqa: E402
    choose_num_splits,
    decode_schedule,
    paged_decode_attention,
    varlen_attention,
)
from nanoref.ops.store_kvcache_triton import store_kvcache_triton  # noqa: E402

from .helpers import (  # noqa: E402
    CPU_DEFAULT_BACKEND,
    TOL,
    cu,
    hf_greedy,
    random_paged_decode,
    random_paged_varlen,
    random_prompts,
    random_qkv,
    shared_prefix_prompts,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(2, 2), (4, 2), (8, 2)]  # (query heads, KV heads): ratios 1, 2 and 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (2, 32), (3, 24)])  # rows of 16, 64 and 72 values
def test_store_kvcache_triton_equals_torch(dtype, kv_heads, head_dim):
    g = torch.Generator().manual_seed(kv_heads * 100 + head_dim)
    num_blocks, block_size, n = 5, 16, 23
    key = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:6]] = -1  # six tokens that must not be stored
    key, value, cache, slots = on_device(key, value, cache, slots)
    k_ref, v_ref = cache[0].clone(), cache[1].clone()
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    k_tri, v_tri = cache[0].clone(), cache[1].clone()
    store_kvcache_triton(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    assert not torch.equal(k_tri, cache[0])  # something was written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_triton_matches_reference_and_oracle(dtype, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(block_size * 10 + heads)
    lens = [1, 15, 16, 17, 40, 77]  # not multiples of the block size, and exact multiples
    x = random_paged_decode(lens, block_size, heads, kv_heads, 32, dtype, g).to(DEVICE)  # q: (B, 1, H, D)
    decode_args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    reference = attention_torch.paged_decode_attention(*decode_args)
    oracle = x.oracle()  # (B, H, D)
    for num_splits in (1, 3):  # one pass, and split-KV with its merge kernel
        out = paged_decode_attention(*decode_args, num_splits=num_splits)
        assert out.shape == x.q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), reference.float(), atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(out.squeeze(1).float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits,len_q", [(1, 1), (3, 1), (2, 2)])
def test_paged_decode_triton_with_tiles_inside_one_block(num_splits, len_q):
    """Blocks of 128 tokens: every tile (64 or 128 keys) lies in one block, so the kernel reads one block-table entry
    a tile and consecutive slots (TILE_IN_PAGE); contexts that end inside a tile, at a block's end, and a split's."""
    g = torch.Generator().manual_seed(10 + num_splits)
    lens = [2, 127, 128, 129, 300, 513]
    x = random_paged_decode(lens, 128, 4, 2, 16, torch.float32, g, len_q=len_q).to(DEVICE)
    args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    out = paged_decode_attention(*args, num_splits=num_splits, scheduler_metadata=decode_schedule(x.seqlens))
    torch.testing.assert_close(out.flatten(0, 1), x.oracle(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits,len_q", [(1, 1), (3, 1), (2, 3)])  # len_q 3: a verify step's queries
def test_paged_decode_triton_in_any_program_order_gives_the_same_answer(num_splits, len_q):
    """scheduler_metadata reorders the programs (longest context first); each must still write its own sequence."""
    g = torch.Generator().manual_seed(num_splits)
    lens = [3, 70, 17, 4, 40, 33]
    x = random_paged_decode(lens, 16, 4, 2, 32, torch.float32, g, len_q=len_q).to(DEVICE)
    args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    reference = attention_torch.paged_decode_attention(*args)
    longest_first = decode_schedule(x.seqlens)
    assert longest_first.tolist() == [1, 4, 5, 2, 3, 0]
    for order in (longest_first, torch.randperm(len(lens), generator=g).to(DEVICE)):
        out = paged_decode_attention(*args, num_splits=num_splits, scheduler_metadata=order)
        torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)
    for wrong in (longest_first[:5], longest_first.float()):  # one entry short; not integers
        with pytest.raises(ValueError, match="scheduler_metadata must be \\(6,\\) int32 or int64"):
            paged_decode_attention(*args, scheduler_metadata=wrong)


@pytest.mark.parametrize("len_q", [2, 5])
def test_paged_decode_triton_several_queries_is_causal(len_q):
    g = torch.Generator().manual_seed(len_q)
    lens = [len_q, 20, 33]
    x = random_paged_decode(lens, 16, 4, 2, 16, torch.float32, g, len_q=len_q).to(DEVICE)  # q: (B, Lq, H, D)
    out = paged_decode_attention(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, num_splits=2)
    oracle = x.oracle()
    torch.testing.assert_close(out.flatten(0, 1), oracle, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_varlen_triton_matches_oracle(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lens = [1, 5, 17, 70]
    n, d = sum(lens), 32
    q, k, v, cu_lens = on_device(*random_qkv(lens, heads, kv_heads, d, dtype, g), cu(lens))
    out = varlen_attention(q, k, v, cu_lens, cu_lens, max(lens), max(lens), causal=True)
    oracle = naive_padded_attention(q, k, v, cu_lens, cu_lens, causal=True)
    assert out.shape == (n, heads, d) and out.dtype == dtype
    torch.testing.assert_close(out.float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_varlen_triton_reads_history_through_block_tables(dtype, block_size):
    """Prefix-cache hits and chunked prefill: queries are the last tokens of longer cached sequences. Blocks of 64
    tokens hold whole tiles: one block-table entry a tile (TILE_IN_PAGE)."""
    g = torch.Generator().manual_seed(block_size + 1)
    k_lens, q_lens = [20, 47, 16, 70], [3, 47, 1, 30]
    x = random_paged_varlen(q_lens, k_lens, block_size, 4, 2, 16, dtype, g).to(DEVICE)  # 4 query heads, 2 KV heads
    args = (x.q, x.k_cache, x.v_cache, x.cu_q, x.cu_k, max(q_lens), max(k_lens))
    out = varlen_attention(*args, causal=True, block_table=x.block_table)
    reference = attention_torch.varlen_attention(*args, causal=True, block_table=x.block_table)
    oracle = x.oracle(causal=True)
    torch.testing.assert_close(out.float(), reference.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_decode_tiles_chosen_by_dtype_and_batch_all_match_the_oracle(cache_dtype, block_size):
    """decode_launch picks the tiles by the cache's dtype and the batch (128 or 64 keys a tile, 4 or 2 warps): each
    choice, below and at DECODE_8BIT_WIDE_BATCH sequences, over blocks that hold whole tiles and blocks that do not."""
    from dataclasses import replace

    from nanoref.ops import attention_triton

    g = torch.Generator().manual_seed(block_size)
    q_dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    for batch in (5, attention_triton.DECODE_8BIT_WIDE_BATCH):
        lens = torch.randint(1, 400, (batch,), generator=g).tolist()
        x = random_paged_decode(lens, block_size, 4, 2, 128, q_dtype, g).to("cuda")
        rounded = replace(  # the oracle reads the cache's values (8-bit ones widened) in float32
            x,
            q=x.q.float(),
            k_cache=x.k_cache.to(cache_dtype),
            v_cache=x.v_cache.to(cache_dtype),
            k_flat=x.k_flat.to(cache_dtype).float(),
            v_flat=x.v_flat.to(cache_dtype).float(),
        )
        order = decode_schedule(x.seqlens)
        got = paged_decode_attention(
            x.q, rounded.k_cache, rounded.v_cache, x.seqlens, x.block_table, scheduler_metadata=order
        )
        tol = TOL[torch.float32] if cache_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.flatten(0, 1).float(), rounded.oracle(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_sms", [8, 132])
def test_split_count_fills_the_gpu_in_one_wave(num_sms):
    """What choose_num_splits promises, over a grid of shapes: at most 64 splits, each of >= 64 tokens; no
    split when the batch alone fills the GPU; otherwise as many splits as fit in one wave of programs
    (DECODE_PROGRAMS_PER_SM per SM, or DECODE_PROGRAMS_PER_SM_SMALL for a batch of at most
    SMALL_BATCH_PROGRAMS_PER_SM programs an SM), and never more."""
    from nanoref.ops import attention_triton as tri

    for batch in (1, 2, 4, 8, 16, 32, 33, 34, 48, 64, 256):
        for kv_heads in (1, 2, 8):
            for max_context in (64, 128, 256, 1000, 4096, 32768):
                splits = choose_num_splits(batch, kv_heads, max_context, num_sms=num_sms, block_n=64)
                shape = f"batch {batch}, kv_heads {kv_heads}, context {max_context}: {splits} splits"
                assert 1 <= splits <= 64, shape
                assert splits == 1 or max_context // splits >= 64, shape + " shorter than 64 tokens each"
                programs = batch * kv_heads
                small = programs <= tri.SMALL_BATCH_PROGRAMS_PER_SM * num_sms
                per_sm = tri.DECODE_PROGRAMS_PER_SM_SMALL if small else tri.DECODE_PROGRAMS_PER_SM
                slots = per_sm * num_sms
                if 2 * programs > slots:  # two splits would not fit in one wave
                    assert splits == 1, shape + " although the batch fills the GPU"
                assert splits == 1 or programs * splits <= slots, shape + " start a second wave"
                if splits < min(64, max_context // 64):
                    assert programs * (splits + 1) > slots, shape + " leave SMs idle"


def test_small_batches_split_more_on_an_h100_shape():
    """The measured rule on Qwen3-0.6B's decode shape (8 KV heads, 132 SMs, 128-key tiles, a 4,096-token table):
    32 sequences split 4 ways (8 programs counted an SM), 48 sequences not at all (4 an SM: 384 programs already
    fill 528 slots more than half), 16 sequences 8 ways."""
    splits = {b: choose_num_splits(b, 8, 4096, num_sms=132, block_n=128) for b in (8, 16, 32, 33, 34, 48, 64)}
    assert splits == {8: 16, 16: 8, 32: 4, 33: 4, 34: 1, 48: 1, 64: 1}, splits


def test_greedy_generation_with_triton_matches_hf(tiny_model):
    """End to end through the engine: prefill, a prefix-cache hit, chunked prefill and decode on Triton."""
    shared = shared_prefix_prompts(3, 20, [4, 6])
    batches = [random_prompts(seed=5, lengths=[1, 9, 23]) + shared[:1], shared[1:]]  # the 2nd hits the 1st's cache
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_model, device=DEVICE, dtype="float32", attention_backend="triton", max_num_batched_tokens=16)
    assert llm.model_runner.backend.name == "triton"
    for prompts in batches:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens), f"prompt {i} differs"
    assert llm.scheduler.block_manager.num_hit_blocks > 0  # the shared prefix really came from the cache


def test_backend_choice(monkeypatch):
    from nanoref.ops import backends

    cpu = torch.device("cpu")
    # the interpreter is for reading: a CPU's default is the cpp backend where it builds, else torch
    assert backends.choose_backend("auto", cpu, torch.float32, None, 32) == CPU_DEFAULT_BACKEND
    if torch.cuda.is_available():  # Triton compiles for the GPU there: CPU tensors are refused, with the way out
        with pytest.raises(ValueError, match="device='cpu' on a machine with a GPU.*TRITON_INTERPRET=1"):
            backends.choose_backend("triton", cpu, torch.bfloat16, 16, 32)
    else:
        assert backends.choose_backend("triton", cpu, torch.bfloat16, 16, 32) == "triton"
        assert os.environ["TRITON_INTERPRET"] == "1"  # switched on by nanoref, before the kernels were defined
    assert backends.resolve_backend("triton", cpu).decode is paged_decode_attention
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="Triton is not installed"):
        backends.choose_backend("triton", cpu, torch.float32, None, 32)


def test_flash_attn_triton_choice_on_a_cpu_and_without_triton(monkeypatch):
    """The mixed backend has flash-attn's requirements plus Triton's: each missing one is named."""
    from nanoref.ops import backends

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"'flash_attn\+triton' needs a CUDA device"):
        backends.choose_backend("flash_attn+triton", cpu, torch.bfloat16, 256, 128)
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="Triton is not installed; use 'flash_attn'"):
        backends.choose_backend("flash_attn+triton", cpu, torch.bfloat16, 256, 128)


def test_auto_picks_flash_attn_triton_where_flash_attn_serves(monkeypatch):
    """auto on CUDA: flash-attn's prefill with nanoref's decode when both can serve; flash-attn alone without
    Triton; Triton alone when flash-attn cannot serve the setup (probed without running a kernel here)."""
    from nanoref.ops import backends

    cuda = torch.device("cuda")
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    monkeypatch.setattr(backends, "flash_attn_serves", lambda head_dim, dtype: True)
    assert backends.choose_backend("auto", cuda, torch.bfloat16, None, 128) == "flash_attn+triton"
    assert backends.choose_backend("auto", cuda, torch.bfloat16, 16, 128) == "triton"  # blocks too small
    assert backends.choose_backend("auto", cuda, torch.float32, None, 128) == "triton"  # flash-attn: half only
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert backends.choose_backend("auto", cuda, torch.bfloat16, None, 128) == "flash_attn"


def test_decode_attention_makes_one_schedule_a_step_for_every_layer_and_none_for_a_learners_function():
    """The backend's decode_schedule runs once per decode step (the first layer's), every layer's decode gets
    that tensor, and a learner's function in the paged_decode_attention seam gets flash-attn's arguments only."""
    import dataclasses

    from nanoref.layers.attention import Attention
    from nanoref.ops.backends import resolve_backend
    from nanoref.utils.context import Context, reset_context, set_context
    from nanoref.utils.seams import use

    g = torch.Generator().manual_seed(7)
    lens = [5, 40, 17]
    x = random_paged_decode(lens, 16, 4, 2, 16, torch.float32, g)
    made, handed = [], []

    def schedule(cache_seqlens):
        made.append(cache_seqlens)
        return decode_schedule(cache_seqlens)

    def decode(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True, **schedule):
        handed.append(schedule.get("scheduler_metadata"))
        return attention_torch.paged_decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale)

    backend = dataclasses.replace(
        resolve_backend("torch", torch.device("cpu")), decode=decode, decode_schedule=schedule
    )
    layers = [Attention(4, 16, 0.25, 2) for _ in range(3)]
    for layer in layers:
        layer.backend, layer.k_cache, layer.v_cache = backend, x.k_cache, x.v_cache
    q = x.q.squeeze(1)  # (B, H, D): one query token per sequence
    dummy_kv = torch.zeros(len(lens), 2, 16)
    try:
        set_context(Context(context_lens=x.seqlens, block_tables=x.block_table))
        outs = [layer(q, dummy_kv, dummy_kv) for layer in layers]
        assert len(made) == 1, f"the schedule was made {len(made)} times in one step"
        assert len(handed) == 3 and all(h is handed[0] for h in handed) and handed[0].tolist() == [1, 2, 0]
        reference = attention_torch.paged_decode_attention(x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, 0.25)
        torch.testing.assert_close(outs[0], reference.squeeze(1))

        learner_calls = []

        def learners(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
            learner_calls.append(q.shape)
            return attention_torch.paged_decode_attention(
                q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale
            )

        set_context(Context(context_lens=x.seqlens, block_tables=x.block_table))
        with use(paged_decode_attention=learners):
            layers[0](q, dummy_kv, dummy_kv)
        assert learner_calls == [(3, 1, 4, 16)] and len(made) == 1
    finally:
        reset_context()
