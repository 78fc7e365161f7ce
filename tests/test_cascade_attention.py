"""Cascade attention: decode over a prefix that many sequences share, read once for many of them
(`paged_decode_attention(..., shared_prefix_lens=...)`), gives what plain decode gives, and the engine uses it where
enough sequences share a long enough prefix (the Triton kernels under the interpreter on a CPU)."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (Linux wheels only)")

from nanoref import LLM, SamplingParams, cascade  # noqa: E402
from nanoref.cascade import CASCADE_MIN_PREFIX, CASCADE_MIN_SEQS, shared_prefix_lens  # noqa: E402
from nanoref.ops import attention_torch, attention_triton, gather_paged  # noqa: E402
from nanoref.ops.attention_triton import decode_schedule, paged_decode_attention  # noqa: E402
from nanoref.ops.store_kvcache import to_cache_dtype  # noqa: E402

from .helpers import TOL, PagedInputs, random_paged_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sharing_prefix(x: PagedInputs, prefix_blocks: int, rows: list[int] | None = None) -> PagedInputs:
    """x with the first prefix_blocks blocks of the given sequences (default: all) made the same ones: the same
    cached tokens (a shared prompt)."""
    rows = list(range(len(x.k_lens))) if rows is None else rows
    table = x.block_table.clone()
    table[rows, :prefix_blocks] = table[rows[0], :prefix_blocks]
    k_flat = torch.cat([gather_paged(x.k_cache, table[b], n) for b, n in enumerate(x.k_lens)])
    v_flat = torch.cat([gather_paged(x.v_cache, table[b], n) for b, n in enumerate(x.k_lens)])
    return replace(x, block_table=table, k_flat=k_flat, v_flat=v_flat)


def prefix_lens(tokens: int, batch: int, rows: list[int] | None = None) -> torch.Tensor:
    """(B,) int32: tokens for the given sequences (default: all), 0 for the others."""
    lens = torch.zeros(batch, dtype=torch.int32)
    lens[list(range(batch)) if rows is None else rows] = tokens
    return lens.to(DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,len_q", [(2, 2, 1), (4, 2, 1), (8, 2, 1), (4, 2, 3)])
def test_decode_over_a_shared_prefix_matches_the_oracle_at_every_prefix_length(dtype, heads, kv_heads, len_q):
    """P from 0 to the shortest sequence's first query: not a multiple of the block size, a whole block, all of
    one sequence's history; split and unsplit; in batch order and longest first."""
    g = torch.Generator().manual_seed(heads * 10 + len_q)
    lens = [50, 83, 49, 120, 64]  # every sequence at least 49 tokens; the queries are each one's last len_q
    x = sharing_prefix(random_paged_decode(lens, 16, heads, kv_heads, 32, dtype, g, len_q=len_q), 4).to(DEVICE)
    args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    oracle = x.oracle().reshape(x.q.shape)  # (B, Lq, H, D)
    for tokens in (0, 1, 16, 37, min(lens) - len_q):
        for num_splits, order in ((1, None), (3, decode_schedule(x.seqlens))):
            out = paged_decode_attention(
                *args, num_splits=num_splits, scheduler_metadata=order, shared_prefix_lens=prefix_lens(tokens, 5)
            )
            assert out.shape == x.q.shape and out.dtype == dtype
            torch.testing.assert_close(out.float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_shared_prefix_in_blocks_that_hold_whole_tiles_matches_the_oracle(num_splits):
    """Blocks of 64 tokens: the prefix pass's tiles each lie in one block (one table entry a tile, TILE_IN_PAGE);
    prefixes that end at a block's end and inside a tile."""
    g = torch.Generator().manual_seed(num_splits)
    lens = [150, 200, 140, 260, 180]
    x = sharing_prefix(random_paged_decode(lens, 64, 4, 2, 16, torch.float32, g), 2).to(DEVICE)
    args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    oracle = x.oracle().reshape(x.q.shape)  # (B, Lq, H, D)
    for tokens in (64, 100, 128):
        out = paged_decode_attention(*args, num_splits=num_splits, shared_prefix_lens=prefix_lens(tokens, len(lens)))
        torch.testing.assert_close(out, oracle, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [[1, 3, 4], [0, 2]])
def test_sequences_without_the_shared_prefix_decode_as_usual_beside_those_with_it(rows):
    """Only some sequences share the prefix (the first not among them, or it is): each gets plain decode's answer."""
    g = torch.Generator().manual_seed(len(rows))
    x = sharing_prefix(random_paged_decode([40, 70, 35, 50, 66], 16, 4, 2, 32, torch.float32, g), 2, rows)
    x = x.to(DEVICE)
    out = paged_decode_attention(
        x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table, shared_prefix_lens=prefix_lens(30, 5, rows)
    )
    torch.testing.assert_close(out, x.oracle().reshape(x.q.shape), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_the_prefix_is_read_from_the_blocks_of_the_first_sequence_that_has_it():
    """The contract the engine keeps: a sequence given P > 0 starts with the same blocks as the others given P. Break
    it (sequence 2's first blocks its own) and sequence 2's answer changes while sequence 1's does not: so the
    tests above would catch a kernel that read each sequence's own blocks or skipped the prefix pass."""
    g = torch.Generator().manual_seed(5)
    x = random_paged_decode([40, 40, 40], 16, 4, 2, 32, torch.float32, g).to(DEVICE)  # no blocks in common
    args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    plain = paged_decode_attention(*args)
    cascade = paged_decode_attention(*args, shared_prefix_lens=prefix_lens(32, 3, [1, 2]))
    torch.testing.assert_close(cascade[:2], plain[:2], atol=2e-5, rtol=2e-5)  # 0: none; 1: the owner, its own
    assert not torch.allclose(cascade[2], plain[2], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_over_a_shared_prefix_in_an_8bit_cache_matches_plain_decode(cache_dtype):
    g = torch.Generator().manual_seed(8)
    x = sharing_prefix(random_paged_decode([70, 45, 90], 16, 4, 2, 32, torch.bfloat16, g), 3).to(DEVICE)
    k_cache, v_cache = to_cache_dtype(x.k_cache, cache_dtype), to_cache_dtype(x.v_cache, cache_dtype)
    args = (x.q, k_cache, v_cache, x.seqlens, x.block_table)
    reference = attention_torch.paged_decode_attention(*args)
    out = paged_decode_attention(*args, shared_prefix_lens=prefix_lens(40, 3))
    torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_shared_prefix_lens_must_be_one_int32_per_sequence_on_qs_device():
    g = torch.Generator().manual_seed(1)
    x = random_paged_decode([20, 30], 16, 4, 2, 16, torch.float32, g).to(DEVICE)
    args = (x.q, x.k_cache, x.v_cache, x.seqlens, x.block_table)
    for wrong in (torch.tensor([4, 4], dtype=torch.int64), torch.tensor([4], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"shared_prefix_lens must be \(2,\) int32"):
            paged_decode_attention(*args, shared_prefix_lens=wrong.to(DEVICE))


# -- the host's rule: how many tokens every sequence of a decode step shares ----------------------------------------


def test_shared_prefix_lens_follow_the_most_common_first_block_and_stop_at_the_first_query():
    page, rule = 16, dict(min_tokens=1, min_seqs=2)
    tables = np.array([[7, 3, 9, 4], [7, 3, 9, 5], [7, 3, 8, -1], [6, 3, 9, 4]])
    # rows 0-2 start with block 7 (row 3's 6 is another prompt): blocks 7 and 3 are all of theirs, 32 tokens
    lens = shared_prefix_lens(tables, np.array([40, 50, 60, 70]), page, **rule)
    assert lens.tolist() == [32, 32, 32, 0]
    # a sharing sequence whose first query is at position 20 sees only 20 keys before it: the prefix stops there
    assert shared_prefix_lens(tables, np.array([40, 20, 60, 70]), page, **rule).tolist() == [20, 20, 20, 0]
    # (row 3's early query does not matter: it does not share)
    assert shared_prefix_lens(tables, np.array([40, 50, 60, 5]), page, **rule).tolist() == [32, 32, 32, 0]
    # no first block in common; padding (-1) is never a shared block
    assert shared_prefix_lens(np.array([[1, 2], [3, 2]]), np.array([40, 40]), page, **rule) is None
    assert shared_prefix_lens(np.array([[1, -1], [1, -1]]), np.array([40, 40]), page, **rule).tolist() == [16, 16]
    # below the thresholds: None (too short a prefix, too few sequences sharing it)
    assert shared_prefix_lens(tables, np.array([40, 50, 60, 70]), page, min_tokens=33, min_seqs=2) is None
    assert shared_prefix_lens(tables, np.array([40, 50, 60, 70]), page, min_tokens=1, min_seqs=4) is None
    assert (CASCADE_MIN_PREFIX, CASCADE_MIN_SEQS) == (256, 48)  # vLLM's prefix threshold; measured: 48 sequences


def test_shared_prefix_lens_agree_with_a_block_by_block_count_on_random_tables():
    """Random batches: a few prompts' block chains shared by random groups, each sequence's own blocks after them,
    -1 padding; against a loop that walks the most common chain block by block."""
    rng = np.random.default_rng(0)
    page = 16
    for _ in range(300):
        batch, width = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        chains = rng.permutation(1000)[: 3 * width].reshape(3, width)  # three prompts' blocks
        tables = rng.permutation(1000)[1000 - batch * width :].reshape(batch, width) + 1000  # own blocks
        for b in range(batch):  # a random number of the sequence's leading blocks from a random chain
            shared = int(rng.integers(0, width + 1))
            tables[b, :shared] = chains[rng.integers(0, 3), :shared]
        lens = rng.integers(1, width * page + 1, batch)
        for b in range(batch):
            tables[b, -(-int(lens[b]) // page) :] = -1  # padding past each sequence's blocks
        first = lens - 1
        got = shared_prefix_lens(tables, first, page, min_tokens=1, min_seqs=2)
        # the reference: the most common first block (ties: the smallest id), then block by block
        firsts = [int(t) for t in tables[:, 0] if t >= 0]
        if not firsts or max(firsts.count(f) for f in firsts) < 2:
            assert got is None
            continue
        top = min((-firsts.count(f), f) for f in firsts)[1]
        rows = [b for b in range(batch) if tables[b, 0] == top]
        blocks = 0
        while blocks < width and all(tables[b, blocks] == tables[rows[0], blocks] >= 0 for b in rows):
            blocks += 1
        tokens = min(blocks * page, min(int(first[b]) for b in rows))
        expected = None if tokens < 1 else [tokens if b in rows else 0 for b in range(batch)]
        assert (None if got is None else got.tolist()) == expected, (tables, first)


# -- the engine -----------------------------------------------------------------------------------------------------


class CountingLaunches:
    """Stands in for a Triton kernel, counting its launches and noting each one's queries per sequence (LEN_Q)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches, self.query_lens = kernel, 0, set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            self.query_lens.add(kwargs["LEN_Q"])
            return self.kernel[grid](*args, **kwargs)

        return launch


def spy_on_the_prefix_pass(monkeypatch) -> CountingLaunches:
    """The engine's cascade rule lowered from 48 sharing sequences to 8 (so that the interpreter runs a few), and a
    spy on its prefix pass."""
    spy = CountingLaunches(attention_triton.shared_prefix_kernel)
    monkeypatch.setattr(attention_triton, "shared_prefix_kernel", spy)
    monkeypatch.setattr(cascade, "shared_prefix_lens", functools.partial(shared_prefix_lens, min_seqs=8))
    return spy


def triton_engine(folder, **settings) -> LLM:
    return LLM(
        folder,
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        enforce_eager=True,  # (on a GPU: every step launches its kernels, so the spy sees them)
        num_kvcache_blocks=256,  # (two engines in one process: on a GPU the first would hold 90% of its memory)
        **settings,
    )


def after_a_system_prompt(llm: LLM, system: list[int], prompts: list[list[int]], params) -> list[list[int]]:
    """The system prompt served first (its blocks then in the prefix cache), then the prompts -> their tokens."""
    llm.generate([system], params, use_tqdm=False)
    return [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("bucketed", [False, True])  # eager; padded to decode-graph buckets as graphs run them
def test_the_engine_reads_a_shared_system_prompt_once_and_gives_hfs_greedy_tokens(tiny_model, monkeypatch, bucketed):
    """Nine requests after one 272-token system prompt (the prefix cache gives them its blocks) beside one that does
    not share it: decode runs cascade attention (its prefix pass launched) and every request gets HF's tokens; with
    disable_cascade_attn the pass never runs and the tokens are the same."""
    from nanoref.cuda_graphs import DecodeGraphs

    from .helpers import hf_greedy, random_prompts, shared_prefix_prompts

    system = shared_prefix_prompts(11, 272, [4])[0]
    shared = shared_prefix_prompts(11, 272, [3, 5, 2, 6, 4, 7, 3, 5, 1])  # the same 272 tokens, then each its own
    prompts = [*shared, random_prompts(seed=12, lengths=[290])[0]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    spy = spy_on_the_prefix_pass(monkeypatch)
    outputs = {}
    for disabled in (False, True):
        llm = triton_engine(tiny_model, disable_cascade_attn=disabled)
        if bucketed:  # (the graphs of steps over a shared prefix from 8 sequences too: bucket 64 here)
            runner = llm.model_runner
            runner.decode_graphs = DecodeGraphs(runner, record=False, shared_prefix_min_seqs=8)
        launches = spy.launches
        outputs[disabled] = after_a_system_prompt(llm, system, prompts, params)
        assert (spy.launches > launches) == (not disabled), "cascade attention ran" if disabled else "did not run"
        assert llm.scheduler.block_manager.num_hit_blocks >= 9 * 17  # 272 tokens: 17 blocks of 16 per request
    assert outputs[False] == outputs[True]
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs[False])):
        assert tokens == hf_greedy(tiny_model, prompt, params.max_tokens), f"prompt {i} differs from HF"


class CountedReplays:
    """Stands in for a CUDA graph, noting each replay's bucket."""

    def __init__(self, graph, size: int, replays: list[int]) -> None:
        self.graph, self.size, self.replays = graph, size, replays

    def replay(self) -> None:
        self.replays.append(self.size)
        self.graph.replay()


@pytest.mark.gpu
def test_gpu_decode_graphs_replay_the_cascade_kind_over_a_shared_prompt_and_give_the_same_tokens(tiny_model):
    """With CUDA graphs: a second graph for every 64th bucket, replayed for steps over a shared prefix (70 sequences
    pad up to 128); the tokens are those of an engine without cascade attention (and HF's)."""
    from .helpers import hf_greedy, shared_prefix_prompts

    system = shared_prefix_prompts(21, 300, [4])[0]
    prompts = shared_prefix_prompts(21, 300, [1 + i % 9 for i in range(70)])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for disabled in (False, True):
        llm = LLM(
            tiny_model,
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            num_kvcache_blocks=2048,  # (two engines in one process: the first must leave the second memory)
            disable_cascade_attn=disabled,
        )
        graphs = llm.model_runner.decode_graphs
        assert graphs is not None and bool(graphs.cascade_graphs) == (not disabled)
        assert sorted(graphs.cascade_graphs) == ([] if disabled else list(range(64, 513, 64)))
        replays: list[int] = []
        for size, graph in list(graphs.cascade_graphs.items()):
            graphs.cascade_graphs[size] = CountedReplays(graph, size, replays)
        outputs[disabled] = after_a_system_prompt(llm, system, prompts, params)
        assert bool(replays) == (not disabled) and set(replays) <= {128}, replays  # 70 sequences: bucket 128
    assert outputs[False] == outputs[True]
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs[False])):
        assert tokens == hf_greedy(tiny_model, prompt, params.max_tokens), f"prompt {i} differs from HF"


# -- settings -------------------------------------------------------------------------------------------------------


def test_disable_cascade_attn_is_a_bool(tiny_model):
    from nanoref.config import EngineConfig

    with pytest.raises(ValueError, match="disable_cascade_attn must be True or False, got 'yes'"):
        EngineConfig(tiny_model, device="cpu", disable_cascade_attn="yes")


def test_the_serve_command_passes_disable_cascade_attn(monkeypatch):
    pytest.importorskip("fastapi", reason="the server needs fastapi")
    from .helpers import serve_settings

    assert serve_settings(monkeypatch, ["--disable-cascade-attn"])["disable_cascade_attn"] is True
    assert serve_settings(monkeypatch, [])["disable_cascade_attn"] is False


def test_only_backends_whose_decode_reads_a_shared_prefix_once_get_one(tiny_model):
    """Shared prefixes are looked for only where the backend's decode takes them and they are not disabled."""
    for backend, disabled, expected in (("triton", False, True), ("triton", True, False), ("torch", False, False)):
        llm = LLM(tiny_model, device=DEVICE, attention_backend=backend, disable_cascade_attn=disabled,
                  num_kvcache_blocks=64, enforce_eager=True)  # fmt: skip
        assert cascade.reads_shared_prefixes(llm.model_runner) is expected, (backend, disabled)
        assert (cascade.attach(llm.model_runner) is not None) is expected


@pytest.mark.slow
def test_speculative_verify_steps_read_the_shared_prompt_once_and_keep_hfs_greedy_tokens(tiny_model, monkeypatch):
    """A verify step has 1 + k queries per sequence (rows of the prefix pass's tile too): n-gram speculation over
    nine requests behind one system prompt, with cascade attention, gives HF's greedy tokens."""
    from .helpers import hf_greedy, shared_prefix_prompts

    system = shared_prefix_prompts(13, 272, [4])[0]
    prompts = shared_prefix_prompts(13, 272, [3, 5, 2, 6, 4, 7, 3, 5, 1])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    spy = spy_on_the_prefix_pass(monkeypatch)
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 2,
        "disable_by_batch_size": 0,  # (speculate at any batch size and acceptance: verify steps every step)
        "min_tokens_per_step": 0,
    }
    tokens = after_a_system_prompt(triton_engine(tiny_model, speculative_config=speculative), system, prompts, params)
    assert 3 in spy.query_lens, f"no verify step (1 + 2 queries) ran cascade attention: {spy.query_lens}"
    for i, (prompt, output) in enumerate(zip(prompts, tokens)):
        assert output == hf_greedy(tiny_model, prompt, params.max_tokens), f"prompt {i} differs from HF"


@pytest.mark.slow
def test_an_fp8_cache_gives_the_same_tokens_with_and_without_cascade_attention(tiny_model, monkeypatch):
    """kv_cache_dtype="fp8": the prefix pass reads the 8-bit prefix once (widened as the decode kernel widens it)."""
    from .helpers import shared_prefix_prompts

    system = shared_prefix_prompts(17, 272, [4])[0]
    prompts = shared_prefix_prompts(17, 272, [3, 5, 2, 6, 4, 7, 3, 5, 1])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    spy = spy_on_the_prefix_pass(monkeypatch)
    outputs = {
        disabled: after_a_system_prompt(
            triton_engine(tiny_model, kv_cache_dtype="fp8", disable_cascade_attn=disabled), system, prompts, params
        )
        for disabled in (False, True)
    }
    assert spy.launches > 0
    assert outputs[False] == outputs[True]
