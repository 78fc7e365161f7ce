"""The cpp backend: nanoref's C++ kernels (paged decode attention against the naive padded oracle; the KV store and
the element-wise layers against their torch references), end to end against HF, and the CPU default's build and
fallback.

The kernels are built on first use (`torch.utils.cpp_extension`); these tests skip where this machine cannot build
them (no C++ compiler or no ninja), and say so.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.layers.layernorm import add_rms_norm, rms_norm
from nanoref.layers.rotary import RotaryEmbedding, norm_rotary
from nanoref.ops import attention_cpp, backends, naive_padded_attention, store_kvcache_torch
from nanoref.ops.activation import silu_and_mul
from nanoref.ops.backends import choose_backend

from .helpers import (
    TINY_CONFIGS,
    cu,
    hf_greedy,
    random_paged_cache,
    random_paged_varlen,
    random_prompts,
    random_qkv,
    shared_prefix_prompts,
)

needs_build = pytest.mark.skipif(
    bool(attention_cpp.missing_build_tools()),
    reason=f"the cpp kernel cannot be built here: missing {attention_cpp.missing_build_tools()}",
)


def decode_against_naive(lens, len_q, heads, kv_heads, head_dim, block_size, dtype, causal, seed):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, block_size, kv_heads, head_dim, dtype, g)
    q = torch.randn(len(lens), len_q, heads, head_dim, generator=g).to(dtype)  # (B, Lq, H, D)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = attention_cpp.paged_decode_attention(q, k_cache, v_cache, seqlens, block_table, causal=causal)
    ref = naive_padded_attention(q.flatten(0, 1), k_flat, v_flat, cu([len_q] * len(lens)), cu(lens), causal=causal)
    return out.flatten(0, 1), ref  # (B * Lq, H, D) each


@needs_build
@pytest.mark.parametrize("head_dim", attention_cpp.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_decode_matches_naive_float32(head_dim, heads, kv_heads):
    # lengths across page edges: 1 token, exactly one page, one past it, several pages
    lens = [1, 16, 17, 40, 75]
    out, ref = decode_against_naive(lens, 1, heads, kv_heads, head_dim, 16, torch.float32, True, head_dim + heads)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_build
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_several_queries_per_sequence(causal, block_size):
    """Lq > 1: the last Lq tokens of each history, causal among themselves (aligned bottom-right) or not."""
    out, ref = decode_against_naive([3, 20, 33, 64], 3, 8, 2, 32, block_size, torch.float32, causal, block_size)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    out, ref = decode_against_naive([5, 31, 90], 1, 8, 2, 64, 16, dtype, True, 11)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_build
def test_query_as_strided_view_of_fused_projection():
    """In the model, q is a view into the fused qkv output: its token axis strides past k and v."""
    g = torch.Generator().manual_seed(5)
    lens, heads, kv_heads, dim = [9, 26], 4, 2, 32
    k_cache, v_cache, block_table, k_flat, v_flat = random_paged_cache(lens, 16, kv_heads, dim, torch.float32, g)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, : heads * dim].view(len(lens), 1, heads, dim)  # (B, 1, H, D), not contiguous
    assert not q.is_contiguous()
    out = attention_cpp.paged_decode_attention(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), block_table)
    ref = naive_padded_attention(q.squeeze(1).contiguous(), k_flat, v_flat, cu([1, 1]), cu(lens))
    torch.testing.assert_close(out.squeeze(1), ref, atol=2e-5, rtol=2e-5)


@needs_build
@pytest.mark.parametrize("head_dim", attention_cpp.HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_varlen_prefill_matches_naive(head_dim, heads, kv_heads):
    """Prefill without history: flat q, k, v of several sequences (1 token, page edges, longer than a 64-row run)."""
    g = torch.Generator().manual_seed(head_dim * heads)
    lens = [1, 16, 17, 40, 75]
    q, k, v = random_qkv(lens, heads, kv_heads, head_dim, torch.float32, g)
    out = attention_cpp.varlen_attention(q, k, v, cu(lens), cu(lens), max(lens), max(lens))
    torch.testing.assert_close(out, naive_padded_attention(q, k, v, cu(lens), cu(lens)), atol=2e-5, rtol=2e-5)


@needs_build
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_prefill_over_cached_history_matches_naive(causal, dtype):
    """Prefix-cache hits and chunked prefill: each sequence's queries are the last of its keys, which the kernel
    reads through the block table from the paged cache. A view of a wider tensor as q, as in the model."""
    g = torch.Generator().manual_seed(9)
    x = random_paged_varlen([3, 1, 20, 64], [3, 30, 33, 100], 16, 8, 2, 32, dtype, g)
    wide = torch.cat([x.q, torch.zeros_like(x.q)], dim=1)  # (N, 2H, D)
    q = wide[:, : x.q.shape[1]]  # (N, H, D), its token axis striding past the other half
    out = attention_cpp.varlen_attention(
        q, x.k_cache, x.v_cache, x.cu_q, x.cu_k, max(x.q_lens), max(x.k_lens), causal=causal, block_table=x.block_table
    )
    tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), x.oracle(causal).float(), **tolerance)


@needs_build
def test_a_block_table_that_does_not_cover_a_length_is_an_error_not_a_read_outside_the_cache():
    """A -1 (padding) or an id past the cache where a sequence's length reaches: the torch reference would read block
    0 there; unchecked, the kernel would read outside the cache."""
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, table, _, _ = random_paged_cache([20, 5], 16, 2, 32, torch.float32, g)
    q = torch.randn(2, 1, 4, 32, generator=g)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    padded = table.clone()
    padded[0, 1] = -1  # sequence 0's second block, which its 20 tokens reach
    with pytest.raises(RuntimeError, match=r"block_table\[0, 1\] is -1"):
        attention_cpp.paged_decode_attention(q, k_cache, v_cache, lens, padded)
    with pytest.raises(RuntimeError, match="more than its block table"):
        attention_cpp.paged_decode_attention(q, k_cache, v_cache, lens, table[:, :1])
    bad = table.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="not one of the cache's"):
        attention_cpp.paged_decode_attention(q, k_cache, v_cache, lens, bad)
    with pytest.raises(RuntimeError, match="not one of the cache's"):
        attention_cpp.varlen_attention(q[:, 0], k_cache, v_cache, cu([1, 1]), cu([20, 5]), 1, 20, block_table=bad)


@needs_build
def test_varlen_rejects_lengths_past_the_keys():
    q, k, v = random_qkv([4, 6], 4, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="past the keys"):
        attention_cpp.varlen_attention(q, k, v, cu([4, 6]), cu([4, 7]), 6, 7)
    with pytest.raises(RuntimeError, match="no more than its keys"):
        attention_cpp.varlen_attention(q, k, v, cu([4, 6]), cu([3, 7]), 6, 7)


@needs_build
def test_bad_arguments_raise_clear_errors():
    q = torch.randn(2, 1, 4, 32)
    cache = torch.randn(4, 16, 2, 32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        attention_cpp.paged_decode_attention(q, cache, cache, torch.tensor([3, 4]), table)  # int64 lengths
    with pytest.raises(RuntimeError, match="one dtype"):
        attention_cpp.paged_decode_attention(q.double(), cache, cache, torch.tensor([3, 4], dtype=torch.int32), table)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(
        RuntimeError, match="paged_decode_attention runs on float32, float16 and bfloat16 tensors, not Double"
    ):
        attention_cpp.paged_decode_attention(q.double(), cache.double(), cache.double(), lens, table)
    q48, cache48 = torch.randn(2, 1, 4, 48), torch.randn(4, 16, 2, 48)
    with pytest.raises(RuntimeError, match="built for head_dim 16, 32, 64, 128 or 256, not 48"):
        attention_cpp.paged_decode_attention(q48, cache48, cache48, lens, table)


def torch_checks(source: str) -> list[list[str]]:
    """Every TORCH_CHECK(...) in C++ source, as its top-level arguments (string literals kept whole)."""
    calls = []
    for start in [i + len("TORCH_CHECK(") for i in range(len(source)) if source.startswith("TORCH_CHECK(", i)]:
        args, depth, piece, i, quoted = [], 0, "", start, False
        while depth >= 0:
            c = source[i]
            if quoted:
                quoted = c != '"' or source[i - 1] == "\\"
            elif c == '"':
                quoted = True
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 0:
                args.append(piece.strip())
                piece, i = "", i + 1
                continue
            if depth >= 0:
                piece += c
            i += 1
        calls.append([*args, piece.strip()])
    return calls


def test_every_check_in_the_kernels_hands_torch_one_message_string():
    """TORCH_CHECK(cond, piece, value, ...) formats its message with c10::str in the extension: on one GPU machine's
    image that segfaulted instead of raising, so messages with values are formatted by CHECK_WITH_VALUES first."""
    calls = torch_checks(attention_cpp.CPP_SOURCE)
    assert len(calls) > 20
    several = [call for call in calls if len(call) != 2]
    assert not several, f"TORCH_CHECKs with several message pieces (use CHECK_WITH_VALUES): {several}"
    # the message: string literals (adjacent ones join into one) or the macro's formatted buffer
    literal = re.compile(r'^("([^"\\]|\\.)*"\s*)+$')
    loose = [call for call in calls if not literal.match(call[1]) and call[1] != "static_cast<const char*>(message)"]
    assert not loose, f"TORCH_CHECKs whose message is not a string literal: {loose}"
    assert torch_checks('TORCH_CHECK(a(1, 2) && b, "x, (y", v);') == [["a(1, 2) && b", '"x, (y"', "v"]]


def test_choose_backend_refuses_what_cpp_cannot_serve(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="CPU only"):
        choose_backend("cpp", torch.device("cuda"), torch.bfloat16, None, 128)
    with pytest.raises(ValueError, match="head_dim"):
        choose_backend("cpp", cpu, torch.float32, None, 48)
    monkeypatch.setattr(attention_cpp.shutil, "which", lambda name: None)
    monkeypatch.setattr(attention_cpp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        choose_backend("cpp", cpu, torch.float32, None, 32)


@needs_build
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[pytest.mark.slow] if name == "gqa4-bias" else []) for name in TINY_CONFIGS]
)
def test_greedy_matches_hf(tiny_models, name):
    folder = tiny_models[name]
    prompts = random_prompts(seed=21, lengths=[1, 7, 16, 17, 33, 50])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(folder, device="cpu", attention_backend="cpp", num_kvcache_blocks=256)
    assert llm.config.attention_backend == "cpp"
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        assert output["token_ids"] == hf_greedy(folder, prompt, params.max_tokens), f"prompt {i} differs from HF"


@needs_build
@pytest.mark.slow  # preemption and prefix hits stay token-exact in the quick loop on the torch backend
def test_greedy_matches_hf_under_preemption_and_prefix_hits(tiny_model):
    prompts = shared_prefix_prompts(seed=22, prefix_len=32, suffix_lens=[5, 12, 20, 3, 9, 27])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(
        tiny_model, device="cpu", attention_backend="cpp", num_kvcache_blocks=12, kvcache_block_size=16, max_num_seqs=8
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.block_manager.num_hit_blocks > 0
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(tiny_model, prompt, params.max_tokens)


@needs_build
def test_loading_the_kernel_leaves_sys_path_alone():
    # a fresh interpreter: this one may have imported setuptools already (whose first import changes sys.path)
    script = (
        "import sys\n"
        "from nanoref.ops import attention_cpp\n"
        "before = list(sys.path)\n"
        "attention_cpp.load()\n"
        "added = [p for p in sys.path if p not in before]\n"
        "assert sys.path == before, f'sys.path gained {added}'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_matches_the_torch_store(dtype):
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(7, 2, 32, generator=g).to(dtype) for _ in range(2))
    caches = [torch.randn(5, 16, 2, 32, generator=g).to(dtype) for _ in range(2)]
    slots = torch.tensor([3, -1, 16 * 4 + 15, 16, -1, 0, 33])  # -1: not stored
    expected = [cache.clone() for cache in caches]
    store_kvcache_torch(key, value, *expected, slots)
    attention_cpp.store_kvcache(key, value, *caches, slots)
    assert all(torch.equal(got, want) for got, want in zip(caches, expected))
    with pytest.raises(RuntimeError, match="past the cache"):
        attention_cpp.store_kvcache(key, value, *caches, torch.full((7,), 16 * 5))


# the element-wise kernels against the torch functions the layers run elsewhere: float32 to rounding, half types
# with the reference's casts (hidden sizes that are and are not a multiple of the vector width)
TOLERANCES = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
TOLERANCES[torch.float16] = dict(atol=2e-3, rtol=2e-3)


@needs_build
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("hidden", [128, 48, 7])
def test_norms_and_swiglu_match_the_torch_functions(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(33, hidden, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(attention_cpp.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **TOLERANCES[dtype])
    for got, want in zip(
        attention_cpp.add_rms_norm(x, residual, weight, 1e-6), add_rms_norm(x, residual, weight, 1e-6)
    ):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    gate_up = torch.randn(5, 3, 2 * hidden, generator=g).to(dtype) * 6  # large |gate| too: silu's both tails
    torch.testing.assert_close(attention_cpp.silu_and_mul(gate_up), silu_and_mul(gate_up), **TOLERANCES[dtype])


@needs_build
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("head_dim", [16, 32, 128])
def test_norm_rotary_matches_the_torch_function_on_a_view_of_qkv(dtype, head_dim):
    """As the model calls it: the query and key heads of the fused projection's output, a strided view."""
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 9, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    q_weight, k_weight = (torch.rand(head_dim, generator=g) + 0.5 for _ in range(2))
    weight = torch.cat([q_weight.expand(heads, head_dim), k_weight.expand(kv_heads, head_dim)]).to(dtype)
    rope = RotaryEmbedding(head_dim, 256, 10_000.0)
    positions = torch.randint(0, 256, (tokens,), generator=g)
    args = (qk, weight, 1e-6, positions, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(attention_cpp.norm_rotary(*args), norm_rotary(*args), **TOLERANCES[dtype])
    with pytest.raises(RuntimeError, match="outside the tables"):
        attention_cpp.norm_rotary(qk, weight, 1e-6, positions + 256, rope.cos_cache, rope.sin_cache)


@needs_build
def test_the_cpp_engine_runs_the_cpp_kernels_in_every_layer(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    assert llm.model_runner.backend.name == "cpp"  # the CPU default where the kernels build
    norms = [m for m in llm.model_runner.model.modules() if type(m).__name__ in ("RMSNorm", "SiluAndMul")]
    assert norms and all(m.backend is llm.model_runner.backend for m in norms)
    assert llm.model_runner.backend.rms_norm is attention_cpp.rms_norm


def test_auto_falls_back_to_torch_quietly_without_build_tools(monkeypatch, recwarn):
    monkeypatch.setattr(attention_cpp, "missing_build_tools", lambda: ["a C++ compiler (c++, g++ or clang++)"])
    assert choose_backend("auto", torch.device("cpu"), torch.float32, None, 32) == "torch"
    assert not recwarn.list  # no compiler is a normal machine, not a problem to warn about
    assert choose_backend("auto", torch.device("cpu"), torch.float32, None, 48) == "torch"  # a head_dim it lacks


def test_a_build_that_failed_warns_once_falls_back_to_torch_and_is_not_retried(monkeypatch):
    failure = attention_cpp.CppKernelUnavailableError("building the cpp backend's kernels failed: no such header")
    monkeypatch.setattr(attention_cpp, "missing_build_tools", lambda: [])
    monkeypatch.setattr(attention_cpp, "_failure", failure)
    monkeypatch.setattr(backends, "_warned_cpp_failure", False)
    with pytest.warns(RuntimeWarning, match="no such header.*torch backend instead") as record:
        for _ in range(3):
            assert choose_backend("auto", torch.device("cpu"), torch.float32, None, 32) == "torch"
    assert len(record) == 1
    assert choose_backend("cpp", torch.device("cpu"), torch.float32, None, 32) == "cpp"  # asked for by name:
    with pytest.raises(attention_cpp.CppKernelUnavailableError, match="no such header"):  # the engine says why not
        backends.resolve_backend("cpp", torch.device("cpu"))


def run_python(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )


@needs_build
def test_a_failed_build_leaves_an_engine_on_the_torch_backend_with_its_tokens(tiny_model, tmp_path):
    """A real failed build (a header the compiler cannot find), in a fresh interpreter: two engines, one warning, one
    build attempt; both engines generate HF's greedy tokens on the torch backend."""
    script = (
        "import warnings\n"
        "from nanoref import LLM, SamplingParams\n"
        "from nanoref.ops import attention_cpp\n"
        "attention_cpp.CPP_SOURCE = '#include <nanoref_no_such_header.h>\\n' + attention_cpp.CPP_SOURCE\n"
        "builds = []\n"
        "build = attention_cpp._build\n"
        "attention_cpp._build = lambda *a: builds.append(a) or build(*a)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    engines = [LLM({str(tiny_model)!r}, device='cpu', num_kvcache_blocks=16) for _ in range(2)]\n"
        "assert [e.model_runner.backend.name for e in engines] == ['torch', 'torch']\n"
        "assert len(builds) == 1, builds\n"
        "messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]\n"
        "assert len(messages) == 1 and 'nanoref_no_such_header' in messages[0], messages\n"
        "params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        "print(engines[1].generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]['token_ids'])\n"
    )
    result = run_python(script, {"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == str(hf_greedy(tiny_model, [5, 6, 7, 8, 9], 6))


@needs_build
def test_a_built_kernel_loads_from_the_cache_without_the_build_tools_or_a_message():
    """The second process on a machine loads the cached library directly: no compiler run, no torch.utils.cpp_extension
    import (a second of setuptools), nothing printed; and importing nanoref builds and loads nothing."""
    attention_cpp.load()  # (built here if this is the first use on this machine)
    script = (
        "import sys\n"
        "import torch\n"
        "import nanoref\n"
        "from nanoref.ops import attention_cpp\n"
        "assert not attention_cpp._loaded and not hasattr(torch.ops.nanoref_cpp, 'rms_norm')\n"
        "attention_cpp.load()\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
        "print(attention_cpp.rms_norm(torch.ones(2, 16), torch.ones(16), 1e-6).sum().item())\n"
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and float(result.stdout) == pytest.approx(32.0)


def test_the_build_folder_is_named_after_everything_the_build_depends_on(monkeypatch):
    name = attention_cpp.build_name()
    assert name.startswith("nanoref_cpp_") and attention_cpp.build_name() == name
    monkeypatch.setattr(attention_cpp, "CPP_SOURCE", attention_cpp.CPP_SOURCE + "// another version\n")
    assert attention_cpp.build_name() != name  # another checkout's source: a build of its own, not a rebuild of ours
    monkeypatch.undo()
    monkeypatch.setattr(attention_cpp, "cpu_signature", lambda: "flags : fpu sse2")
    assert attention_cpp.build_name() != name  # another CPU (a home folder shared between machines)


def test_a_damaged_cached_library_is_reported_with_its_path_and_not_loaded_again(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_cpp, "missing_build_tools", lambda: [])
    monkeypatch.setattr(attention_cpp, "extensions_root", lambda: tmp_path)
    monkeypatch.setattr(attention_cpp, "_failure", None)
    folder = tmp_path / attention_cpp.build_name()
    folder.mkdir()
    (folder / f"{folder.name}.so").write_bytes(b"not a shared library")
    with pytest.raises(attention_cpp.CppKernelUnavailableError, match=f"loading .* from {folder}.*failed"):
        attention_cpp._load_or_build()  # (not through load: this process may have loaded the real build)
    with pytest.raises(attention_cpp.CppKernelUnavailableError, match="loading"):
        attention_cpp.load()  # remembered: no second attempt


def empty_build_folder(tmp_path, monkeypatch):
    """This machine's build folder for the kernels, empty, under tmp_path (as if the build tools were there) -> it."""
    monkeypatch.setattr(attention_cpp, "missing_build_tools", lambda: [])
    monkeypatch.setattr(attention_cpp, "extensions_root", lambda: tmp_path)
    folder = tmp_path / attention_cpp.build_name()
    folder.mkdir()
    return folder


def test_a_lock_left_by_a_killed_build_is_removed_before_building(tmp_path, monkeypatch):
    """torch's build lock makes every later process wait for the build that holds it: forever, when that process was
    killed mid-build (a Jupyter kernel restarted during the first build)."""
    import os
    import time

    folder = empty_build_folder(tmp_path, monkeypatch)
    lock = folder / "lock"
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    builds = []
    monkeypatch.setattr(attention_cpp, "_build", lambda name, where: builds.append(lock.exists()))
    attention_cpp._load_or_build()
    assert builds == [False]  # built, with the stale lock gone


def test_a_lock_that_a_build_killed_just_now_left_is_removed_too(tmp_path, monkeypatch):
    """The kernel restarted during the first build and the notebook run again at once: torch's lock, seconds old,
    is no live build's (none holds nanoref's OS lock), so it goes and the kernels are built again (its library may be
    half written). It used to stay, and the engine waited on it forever after "compiling ... about 20 s"."""
    folder = empty_build_folder(tmp_path, monkeypatch)
    (folder / "lock").touch()
    (folder / f"{folder.name}.so").write_bytes(b"half a library")
    builds = []
    monkeypatch.setattr(attention_cpp, "_build", lambda name, where: builds.append((folder / "lock").exists()))
    attention_cpp._load_or_build()
    assert builds == [False]


def build_elsewhere(folder, lock, seconds: float = 0.5):
    """Another machine's build in `folder`, under way: it holds torch's `lock`, and ends after `seconds` (its library
    written, the lock removed). -> its thread."""
    import threading
    import time

    lock.touch()

    def finish():
        time.sleep(seconds)
        (folder / f"{folder.name}.so").write_bytes(b"the other machine's library")
        lock.unlink()

    thread = threading.Thread(target=finish)
    thread.start()
    return thread


def test_without_os_file_locks_only_an_old_torch_lock_is_taken_for_a_killed_builds(tmp_path, monkeypatch, capsys):
    """A network folder that has no OS file locks (flock: ENOLCK) cannot tell a live build from a dead one: a fresh
    torch lock is waited for until it goes (that build's library is loaded, nothing built), one STALE_LOCK_SECONDS old
    is a killed build's and goes (the kernels are built)."""
    import errno
    import os
    import time
    import types

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(attention_cpp, "fcntl", types.SimpleNamespace(flock=no_locks, LOCK_EX=2, LOCK_NB=4, LOCK_UN=8))
    folder = empty_build_folder(tmp_path, monkeypatch)
    lock = folder / "lock"
    builds, loads = [], []
    monkeypatch.setattr(attention_cpp, "_build", lambda name, where: builds.append(lock.exists()))
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    other = build_elsewhere(folder, lock)
    attention_cpp._load_or_build()
    other.join()
    assert builds == [] and loads == [str(folder / f"{folder.name}.so")]
    assert "waiting for the build that holds" in capsys.readouterr().err
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    attention_cpp._load_or_build()
    assert builds == [False]


@pytest.mark.skipif(sys.platform == "win32", reason="OS file locks (fcntl) are POSIX's")
def test_another_machines_live_build_is_waited_for_where_os_locks_are_each_machines_own(tmp_path, monkeypatch):
    """A home folder shared between machines of one CPU, whose OS file locks are each machine's own (NFS mounted
    nolock, Lustre's localflock): nanoref's OS lock is free here while another machine builds, and its torch lock
    was taken for a killed build's, removed, and the kernels built twice into one folder at once. The lock file names
    the machine whose build took it last: another machine's torch lock is waited for, and that build's library
    loaded; one STALE_LOCK_SECONDS old is a killed build's, removed before building."""
    import os
    import time

    folder = empty_build_folder(tmp_path, monkeypatch)
    lock = folder / "lock"
    builds, loads = [], []
    monkeypatch.setattr(attention_cpp, "_build", lambda name, where: builds.append(lock.exists()))
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    (folder / "nanoref.lock").write_text("another-machine")  # (its build took the OS lock there last)
    other = build_elsewhere(folder, lock)
    attention_cpp._load_or_build()
    other.join()
    assert builds == [] and loads == [str(folder / f"{folder.name}.so")]
    (folder / f"{folder.name}.so").unlink()
    (folder / "nanoref.lock").write_text("another-machine")
    lock.touch()
    hour_ago = time.time() - 3600
    os.utime(lock, (hour_ago, hour_ago))
    attention_cpp._load_or_build()
    assert builds == [False]


@pytest.mark.skipif(sys.platform == "win32", reason="OS file locks (fcntl) are POSIX's")
def test_a_live_build_in_another_process_is_waited_for_and_its_library_loaded(tmp_path, monkeypatch, capsys):
    """Another process builds (it holds nanoref's OS lock, and torch's lock is there): this one says it waits, and
    once that build is done loads its library, building nothing and removing no lock of a live build."""
    import fcntl
    import threading
    import time

    folder = empty_build_folder(tmp_path, monkeypatch)
    builds, loads = [], []
    monkeypatch.setattr(attention_cpp, "_build", lambda name, where: builds.append(name))
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    with open(folder / "nanoref.lock", "a") as other:  # (another open file: flock's locks are per open file)
        fcntl.flock(other, fcntl.LOCK_EX)
        (folder / "lock").touch()  # torch's, the other build's
        waiting = threading.Thread(target=attention_cpp._load_or_build)
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and (folder / "lock").exists()
        (folder / f"{folder.name}.so").write_bytes(b"the other build's library")
        (folder / "lock").unlink()  # (torch's, as the build ends)
        fcntl.flock(other, fcntl.LOCK_UN)
    waiting.join(10)
    assert not waiting.is_alive() and builds == [] and loads == [str(folder / f"{folder.name}.so")]
    assert "waiting for another process's build" in capsys.readouterr().err


def test_the_build_finds_a_pip_installed_ninja_off_path_and_leaves_path_as_it_was(tmp_path, monkeypatch):
    """A Jupyter kernel started by its interpreter's full path may lack the environment's bin folder on PATH, where
    `pip install ninja` put the binary torch runs by name."""
    import os

    import torch.utils.cpp_extension

    ninja = pytest.importorskip("ninja")
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *args, **kwargs: seen.append(os.environ["PATH"]))
    monkeypatch.setattr(attention_cpp.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nowhere")
    attention_cpp._build("nanoref_cpp_test", tmp_path / "build")
    assert seen == [ninja.BIN_DIR + os.pathsep + "/nowhere"] and os.environ["PATH"] == "/nowhere"
