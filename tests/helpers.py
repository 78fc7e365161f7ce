"""Helpers shared by the test files: tiny model settings, HF transformers' greedy reference, prompts."""

from __future__ import annotations

import importlib.util
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
import torch

from nanoref.ops import attention_cpp, gather_paged

# name -> overrides of nanoref.testing.TINY_QWEN3: tied/untied heads, GQA ratios 1, 2 and 4, q/k/v bias
TINY_CONFIGS = {
    "gqa2-untied": dict(),
    "gqa1-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
    "gqa4-bias": dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_hidden_layers=3, attention_bias=True
    ),
}


# structured output's grammar library is an optional extra: a test whose requests need it skips, naming it, where it
# is not installed (a GPU machine's image, say) rather than failing on the server's 400 "needs the xgrammar package"
needs_xgrammar = pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed (pip install 'nanoref[structured]')"
)

# what attention_backend="auto" gives on a CPU: nanoref's C++ kernels where this machine can build them
CPU_DEFAULT_BACKEND = "torch" if attention_cpp.missing_build_tools() else "cpp"

_HF_CACHE: dict = {}


def hf_model(folder, attn_implementation: str | None = None):
    """HF transformers' model of a folder, float32, cached; attn_implementation: an attention function registered
    with HF's `AttentionInterface` (None: HF's default)."""
    from transformers import AutoModelForCausalLM

    key = (str(folder), attn_implementation)
    if key not in _HF_CACHE:
        options = {"attn_implementation": attn_implementation} if attn_implementation else {}
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **options).eval()
    return _HF_CACHE[key]


def hf_greedy(folder, prompt: list[int], max_new_tokens: int, attn_implementation: str | None = None) -> list[int]:
    """HF transformers `generate`, greedy, one prompt at a time (no padding involved)."""
    model = hf_model(folder, attn_implementation)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt) :].tolist()


def assert_matches_hf(folder, prompts, outputs, max_tokens):
    """Each output's tokens equal HF's greedy `generate` for its prompt."""
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        expected = hf_greedy(folder, prompt, max_tokens)
        assert output["token_ids"] == expected, f"prompt {i} (len {len(prompt)}) differs from HF"


def assert_no_block_leaked(llm) -> None:
    """Every KV block is back in the free list and the block manager's invariants hold."""
    manager = llm.scheduler.block_manager
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks


def assert_exact_through_preemption(folder, suffix_lens: list[int], max_tokens: int, **engine) -> None:
    """Greedy output equals HF's with so few KV blocks (`engine`) that decode must preempt; the prompts share a
    32-token prefix, so a preempted sequence's recompute hits the prefix cache."""
    from nanoref import LLM, SamplingParams

    prompts = shared_prefix_prompts(seed=3, prefix_len=32, suffix_lens=suffix_lens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(folder, device="cpu", kvcache_block_size=16, **engine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_preempted_and_recomputed_from_the_cache(llm)
    assert_matches_hf(folder, prompts, outputs, max_tokens)
    assert_no_block_leaked(llm)


def assert_exact_across_cached_calls(folder, max_tokens: int) -> None:
    """Two calls with the same prompts (a shared 48-token prefix): the second is served from the prefix cache,
    and both equal HF's greedy tokens."""
    from nanoref import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = shared_prefix_prompts(seed=4, prefix_len=48, suffix_lens=[4, 19])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=64)
    first = llm.generate(prompts, params, use_tqdm=False)
    hits_before = llm.scheduler.block_manager.num_hit_blocks
    second = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.block_manager.num_hit_blocks >= hits_before + 2 * 3  # 48 shared tokens = 3 blocks each
    assert first == second
    assert_matches_hf(folder, prompts, second, max_tokens)


def assert_preempted_and_recomputed_from_the_cache(llm) -> None:
    """The last generate preempted a sequence, and a later admission (a preempted one's recompute among them) took
    blocks from the prefix cache: hits in the first admissions alone would not show that recompute can hit."""
    steps = llm.metrics.steps
    preempting = [step.index for step in steps if step.preempted]
    assert preempting, "the KV budget was meant to force preemption"
    assert any(step.num_hit_blocks for step in steps if step.index > preempting[0]), (
        "after the first preemption no admission hit the prefix cache"
    )


def assert_a_failing_worker_is_reported(folder, within_s: float, **engine) -> None:
    """A two-rank engine whose rank 1 raises in its forward: the caller gets the worker's error within `within_s`,
    the workers stop, no request stays queued, later calls are refused, and a new engine starts in this process
    (torch.distributed was left as found) and generates HF's tokens."""
    import time

    import pytest

    from nanoref import LLM, SamplingParams
    from nanoref.parallel.tensor_parallel import TensorParallelError

    from .tp_faults import break_forward_on_rank

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(folder, tensor_parallel_size=2, **engine)
    workers = list(llm.model_runner.followers.procs)
    llm.model_runner.run_on_all_ranks(break_forward_on_rank, 1)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="injected fault on rank 1"):
        llm.generate([[1, 2, 3, 4]], greedy, use_tqdm=False)
    assert time.monotonic() - start < within_s
    assert all(not proc.is_alive() for proc in workers)
    assert llm.scheduler.is_finished()  # the failed call's request is not left queued
    with pytest.raises(TensorParallelError, match="create a new LLM"):
        llm.generate([[1, 2, 3]], greedy, use_tqdm=False)
    llm.close()  # a second stop is harmless
    with LLM(folder, tensor_parallel_size=2, **{k: v for k, v in engine.items() if k != "enforce_eager"}) as again:
        assert again.generate([[1, 2, 3]], greedy, use_tqdm=False)[0]["token_ids"] == hf_greedy(folder, [1, 2, 3], 8)


def enable_bucketed_decode(llm) -> None:
    """Decode the way CUDA graphs do (each batch padded to its bucket in the static buffers, through the
    `pad_decode_batch` seam), run eagerly: on a CPU too. The one place the tests switch it on."""
    from nanoref.cuda_graphs import enable_bucketed_decode as enable

    enable(llm.model_runner)


class Counting:
    """Stands in for a function (a seam's default, a learner's answer) and counts the calls through it; a Triton
    kernel's launches too."""

    def __init__(self, function) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)

    def __getitem__(self, grid):  # a Triton kernel is launched as kernel[grid](...)
        self.calls += 1
        return self.function[grid]


def num_decode_steps(llm) -> int:
    """The decode steps of the engine's latest generate call."""
    return sum(step.kind == "decode" for step in llm.metrics.steps)


def assert_called_every_decode_step(llm, counting: Counting) -> None:
    """The latest generate call decoded, and went through `counting` at least once per decode step (the
    bucketed path ran, not the plain one)."""
    steps = num_decode_steps(llm)
    assert steps > 0, "the generate call never decoded"
    assert counting.calls >= steps, f"{counting.calls} calls in {steps} decode steps: the bucketed path did not run"


def new_sequence(tokens: list[int], block_size: int = 16, max_tokens: int = 8):
    """A greedy request for `tokens` that generates exactly `max_tokens` (no EOS), for a bare block manager or
    scheduler."""
    from nanoref import SamplingParams
    from nanoref.engine.sequence import Sequence

    return Sequence(tokens, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), block_size)


def prefill(manager, seq) -> None:
    """What a finished prefill does to the bookkeeping: every token's K/V is in the cache and the full blocks'
    hashes are published."""
    seq.num_computed_tokens = seq.num_tokens
    manager.commit(seq)


def cached_prompt(manager, tokens: list[int], *, release: bool = False):
    """A sequence of `tokens` allocated and prefilled on `manager`; with `release` its blocks then go back to the
    free list, where their content stays hittable until they are reused."""
    seq = new_sequence(tokens, manager.block_size)
    manager.allocate(seq)
    prefill(manager, seq)
    if release:
        manager.deallocate(seq)
    return seq


def serve_settings(monkeypatch, argv: list[str]) -> dict:
    """The engine settings `python -m nanoref.serve --device cpu --port 0 ARGV` builds its engine with (stopped just
    before the engine loads: the command then exits with 2)."""
    from nanoref.serve import main
    from nanoref.serving.async_llm import AsyncLLM

    seen: dict = {}

    def capture(model, **settings):
        seen.update(settings)
        raise ValueError("stop here")

    with monkeypatch.context() as patch:
        patch.setattr(AsyncLLM, "from_model", capture)
        assert main(["--device", "cpu", "--port", "0", *argv]) == 2
    return seen


def listening_sockets() -> set[tuple[str, str]]:
    """This process's listening TCP sockets, as (local address, port) in /proc/net's hex: the sockets among this
    process's file descriptors (/proc/self/fd) whose inode /proc/net/tcp{,6} lists in state LISTEN (0A). Linux."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    found.add((address, port))
    return found


def own_answers() -> dict:
    """Exercise seam -> nanoref's own function for it (what every check must accept); the Triton seams only where
    Triton is installed."""
    from nanoref.cuda_graphs import pad_decode_batch
    from nanoref.engine.block_manager import find_cached_prefix
    from nanoref.engine.detokenizer import find_stop_string, stop_hold_back
    from nanoref.engine.scheduler import choose_preemption_victim
    from nanoref.engine.step_inputs import prefill_metadata
    from nanoref.layers.activation import silu_and_mul
    from nanoref.layers.embed_head import vocab_parallel_embed
    from nanoref.layers.layernorm import add_rms_norm, rms_norm
    from nanoref.layers.logits_processors import apply_token_bitmask
    from nanoref.layers.rotary import apply_rotary
    from nanoref.layers.sampler import apply_top_k_top_p
    from nanoref.models.qwen3_moe import moe_experts, route
    from nanoref.ops import attention_torch
    from nanoref.ops.lora import lora_delta
    from nanoref.ops.triton_setup import triton_available
    from nanoref.speculative.acceptance import accept_greedy, rejection_sample

    answers = dict(
        prefill_metadata=prefill_metadata,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        paged_decode_attention=attention_torch.paged_decode_attention,
        find_cached_prefix=find_cached_prefix,
        choose_preemption_victim=choose_preemption_victim,
        pad_decode_batch=pad_decode_batch,
        apply_rotary=apply_rotary,
        silu_and_mul=silu_and_mul,
        apply_top_k_top_p=apply_top_k_top_p,
        vocab_parallel_embed=vocab_parallel_embed,
        moe_route=route,
        moe_experts=moe_experts,
        find_stop_string=find_stop_string,
        stop_hold_back=stop_hold_back,
        accept_greedy=accept_greedy,
        rejection_sample=rejection_sample,
        apply_token_bitmask=apply_token_bitmask,
        lora_delta=lora_delta,
    )
    if triton_available():  # the two Triton seams (Linux only)
        from nanoref.ops import attention_triton
        from nanoref.ops.store_kvcache_triton import store_kvcache_kernel

        answers.update(store_kvcache_kernel=store_kvcache_kernel, merge_splits=attention_triton.merge_splits)
    return answers


def random_prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def shared_prefix_prompts(seed: int, prefix_len: int, suffix_lens: list[int], vocab: int = 256) -> list[list[int]]:
    """Prompts that all start with the same `prefix_len` tokens (prefix-cache material)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=g).tolist() for n in suffix_lens]


def copy_with_config(tmp_path, model_folder, edit):
    """A copy of a model folder whose config.json went through `edit(config)`."""
    folder = tmp_path / "m"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def copy_with_eos(tmp_path, model_folder, eos: int):
    """A copy of a model folder whose config.json and generation_config.json (where it has one) name `eos` as the
    EOS id: HF's `generate`, vLLM and nanoref read the latter file's."""
    folder = copy_with_config(tmp_path, model_folder, lambda c: c.update(eos_token_id=eos))
    path = folder / "generation_config.json"
    if path.is_file():
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    return folder


# -- attention inputs ----------------------------------------------------------------------------
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def random_qkv(lens, num_heads, num_kv_heads, head_dim, dtype, g):
    """Fresh random packed q (N, H, D), k and v (N, Hk, D) for sequences of `lens` tokens (N = sum(lens))."""
    n = sum(lens)
    q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def random_paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, g):
    """Fill a paged cache with random K/V for sequences of `lens` tokens, in shuffled blocks.

    Returns k_cache, v_cache, block_table (B, max_blocks, -1 padded), and the contiguous K/V (flat).
    """
    blocks_per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()  # physical blocks in no particular order
    width = max(blocks_per_seq)
    block_table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, nb in enumerate(blocks_per_seq):
        block_table[b, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    k_flat = torch.cat([gather_paged(k_cache, block_table[b], n) for b, n in enumerate(lens)])
    v_flat = torch.cat([gather_paged(v_cache, block_table[b], n) for b, n in enumerate(lens)])
    return k_cache, v_cache, block_table, k_flat, v_flat


@dataclass(frozen=True)
class PagedInputs:
    """Fresh random queries over histories held in a shuffled paged cache, and the same K/V laid out flat for the
    naive oracle. Each sequence's queries are the last `q_lens[b]` tokens of its `k_lens[b]`."""

    q: torch.Tensor  # decode: (B, Lq, H, D); varlen: (sum(q_lens), H, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, Hk, D)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # (B, max_blocks) int32, -1 padded
    k_flat: torch.Tensor  # (sum(k_lens), Hk, D)
    v_flat: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]

    def to(self, device) -> PagedInputs:
        tensors = ("q", "k_cache", "v_cache", "block_table", "k_flat", "v_flat")
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors})

    @property
    def seqlens(self) -> torch.Tensor:
        """Each sequence's context length (B,) int32: the decode kernels' `cache_seqlens`."""
        return torch.tensor(self.k_lens, dtype=torch.int32, device=self.q.device)

    @property
    def cu_q(self) -> torch.Tensor:
        return cu(self.q_lens).to(self.q.device)

    @property
    def cu_k(self) -> torch.Tensor:
        return cu(self.k_lens).to(self.q.device)

    def oracle(self, causal: bool = True) -> torch.Tensor:
        """naive_padded_attention over the flat K/V -> (sum(q_lens), H, D), whichever layout q has."""
        from nanoref.ops import naive_padded_attention

        q = self.q.flatten(0, 1) if self.q.dim() == 4 else self.q  # (sum(q_lens), H, D)
        return naive_padded_attention(q, self.k_flat, self.v_flat, self.cu_q, self.cu_k, causal=causal)


def random_paged_decode(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, g, len_q: int = 1) -> PagedInputs:
    """Decode inputs: `len_q` new tokens (q: (B, Lq, H, D)) at the end of each of the `lens` cached histories."""
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(
        lens, block_size, num_kv_heads, head_dim, dtype, g
    )
    q = torch.randn(len(lens), len_q, num_heads, head_dim, generator=g).to(dtype)  # (B, Lq, H, D)
    return PagedInputs(q, k_cache, v_cache, block_table, k_flat, v_flat, [len_q] * len(lens), list(lens))


def random_paged_varlen(q_lens, k_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, g) -> PagedInputs:
    """Varlen prefill over cached history (prefix-cache hits, chunked prefill): packed q (sum(q_lens), H, D)."""
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(
        k_lens, block_size, num_kv_heads, head_dim, dtype, g
    )
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)  # (sum(q_lens), H, D)
    return PagedInputs(q, k_cache, v_cache, block_table, k_flat, v_flat, list(q_lens), list(k_lens))


def assert_readable_failure(error: BaseException) -> None:
    """An exercise check's message: its first line says what is wrong on its own and fits a grader's report
    (nbgrader keeps little more); values and the learner's source line come on the lines after."""
    first = str(error).splitlines()[0]
    assert len(first) <= 200, f"first line of {len(first)} characters: {first!r}"


SERVER_TIMEOUT = 30.0  # every client call to a test server has one: a bug fails a test, never hangs it


@dataclass
class Server:
    """A real nanoref server on 127.0.0.1 (see `running_server`), for OpenAI's own client."""

    url: str
    engine: object  # the AsyncLLM it serves

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=SERVER_TIMEOUT, max_retries=0)

    def blocks_used(self) -> int:
        return self.engine.stats().num_kv_blocks_used

    def wait_until_idle(self, seconds: float = SERVER_TIMEOUT) -> None:
        """Every request done and every KV block back, within a deadline."""
        import time

        def busy() -> bool:  # (from the engine's step messages: true of both of AsyncLLM's forms)
            stats = self.engine.stats()
            return bool(stats.num_kv_blocks_used or stats.num_running or stats.num_waiting)

        deadline = time.monotonic() + seconds
        while busy():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.blocks_used()} KV blocks still held after {seconds} s")
            time.sleep(0.01)


@contextmanager
def running_server(engine, model_name: str, **app_options):
    """Serve `engine` (an AsyncLLM) on a free port of 127.0.0.1 in a thread, until the block ends (the engine is
    closed then too): the package's own `serve_in_background`, with this file's `Server` handle. app_options:
    build_app's settings (e.g. enable_auto_tool_choice)."""
    from nanoref.serving.api_server import serve_in_background

    try:
        with serve_in_background(engine, model_name, **app_options) as url:
            yield Server(url, engine)
    finally:
        engine.close()


@contextmanager
def decode_launches_never_wait(llm):
    """Inside: a decode step's launch that makes the host wait for the device raises (torch's sync debug mode),
    which is what the overlapped loop needs (a wait inside launch makes the host wait for the step in flight).
    Prefill launches may wait (they never run ahead)."""
    runner = llm.model_runner
    launch = runner.launch

    def strict(seqs, is_prefill, input_ids=None):
        if is_prefill:
            return launch(seqs, is_prefill, input_ids)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(seqs, is_prefill, input_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = strict
    try:
        yield
    finally:
        del runner.launch  # (the method again)
