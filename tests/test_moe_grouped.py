"""Qwen3-MoE's grouped expert path (nanoref/ops/moe_grouped.py) against the per-expert loop.

On a CPU: the sort by expert, the run ends, each grouped matmul (plain torch, torch._grouped_mm, the Triton
kernel under the interpreter) and the write-back, on fresh random inputs. On a GPU (marked gpu): the CUTLASS
torch._grouped_mm path and the compiled Triton kernel at small and Qwen3-30B-A3B shapes, no host sync, CUDA-graph
capture and replay, and greedy generation with CUDA graphs token-exact with enforce_eager and HF.
"""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, SamplingParams, trace_shapes
from nanoref.models.configs import Qwen3MoeConfig
from nanoref.models.qwen3_moe import Qwen3MoeForCausalLM, moe_experts, route
from nanoref.ops.moe_grouped import (
    grouped_mm_per_row,
    grouped_mm_torch,
    grouped_mm_triton,
    grouped_path_serves,
    moe_experts_grouped,
    pick_grouped_mm,
    row_experts,
    sort_by_expert,
)
from nanoref.ops.triton_setup import interpreting, triton_available
from nanoref.testing import TINY_QWEN3_MOE, make_tiny_qwen3_moe

from .helpers import hf_greedy, random_prompts

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# the CPU tests below hand CPU tensors to the Triton kernel: only its interpreter reads them, which nanoref switches on
# where no GPU is present; with a GPU the tests marked `gpu` run the compiled kernel instead
triton_on_cpu = pytest.mark.skipif(
    triton_available() and torch.cuda.is_available() and not interpreting(),
    reason="Triton compiles for the GPU here (tests marked gpu cover it); CPU tensors need its interpreter",
)
IMPLS = {
    "per_row": grouped_mm_per_row,
    "torch": pytest.param(grouped_mm_torch, marks=needs_grouped_mm),
    "triton": pytest.param(grouped_mm_triton, marks=[needs_triton, triton_on_cpu]),
}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def random_ids(g: torch.Generator, num_tokens: int, num_experts: int, top_k: int, used: int | None = None):
    """(N, K) distinct experts per token, in random order, drawn from the first `used` experts only (so the
    others get no token)."""
    used = num_experts if used is None else used
    return torch.stack([torch.randperm(used, generator=g)[:top_k] for _ in range(num_tokens)])  # (N, K)


def random_experts(g, num_experts, hidden_size, inter, dtype):
    """Stacked expert weights on g's device, scaled so every stage stays O(1) (tolerances then mean the same at
    any size)."""
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=g, device=g.device)  # (E, 2 I, hidden)
    w_down = torch.randn(num_experts, hidden_size, inter, generator=g, device=g.device)  # (E, hidden, I)
    return (w_gate_up / hidden_size**0.5).to(dtype), (w_down / inter**0.5).to(dtype)


def naive_grouped_mm(x, w, offsets):
    """Run by run with Python slices (offsets read on the host): the definition of a grouped matmul."""
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64), 0
    for expert, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end].double() @ w[expert].double().T  # (run, k) @ (k, n)
        start = end
    return out


# -- sorting pairs by expert ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "used"),
    [(1, 8, 2, None), (9, 4, 4, None), (30, 16, 3, 5), (50, 64, 1, None), (12, 128, 8, 20)],
)
def test_sort_by_expert_groups_pairs_and_ends_runs(num_tokens, num_experts, top_k, used):
    g = torch.Generator().manual_seed(num_tokens + num_experts)
    ids = random_ids(g, num_tokens, num_experts, top_k, used)
    flat = ids.flatten()
    order, offsets = sort_by_expert(ids, num_experts)
    assert order.shape == (num_tokens * top_k,) and offsets.shape == (num_experts,) and offsets.dtype == torch.int32
    assert torch.equal(order.sort().values, torch.arange(num_tokens * top_k))  # every pair exactly once
    experts = flat[order]
    assert bool((experts[1:] >= experts[:-1]).all())  # sorted by expert
    same = experts[1:] == experts[:-1]
    assert bool((order[1:][same] > order[:-1][same]).all())  # stable: pair order kept inside an expert
    counts = torch.bincount(flat, minlength=num_experts)  # (E,): independent of the code under test
    assert torch.equal(offsets.long(), counts.cumsum(0))
    assert torch.equal(row_experts(offsets, num_tokens * top_k), experts)


def test_row_experts_of_rows_past_the_last_run_stay_in_bounds():
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # expert 0 and 2 empty; rows 5.. in no run
    assert row_experts(offsets, 7).tolist() == [1, 1, 3, 3, 3, 3, 3]


# -- the grouped matmuls ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "counts",
    [[0, 3, 0, 17, 1, 0], [37, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1], [6, 7, 5, 8, 6, 5]],
    ids=["empty-runs", "one-expert", "one-row-last", "spread"],
)
@pytest.mark.parametrize("grouped_mm", IMPLS.values(), ids=IMPLS.keys())
def test_grouped_mm_matches_run_by_run_matmul(grouped_mm, counts, dtype):
    g = torch.Generator().manual_seed(sum(counts) + len(counts))
    num_rows, k, n = sum(counts), 40, 24  # n, k: not multiples of the Triton tiles
    x = torch.randn(num_rows, k, generator=g).to(dtype)  # (M, k)
    w = (torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype)  # (E, n, k)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)  # (E,)
    out = grouped_mm(x, w, offsets)
    assert out.shape == (num_rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_grouped_mm(x, w, offsets), **TOL[dtype])


# -- the experts: grouped against the loop ------------------------------------------------------------------


CASES = {  # name -> (N, E, K, experts that get tokens: None = all may)
    "one-token": (1, 8, 2, None),
    "every-expert-every-token": (5, 4, 4, None),
    "mostly-empty-experts": (3, 64, 2, None),
    "skewed": (33, 16, 3, 4),  # all 99 pairs on 4 of 16 experts
    "top1": (40, 8, 1, None),
    "top8": (12, 32, 8, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("grouped_mm", IMPLS.values(), ids=IMPLS.keys())
def test_grouped_experts_match_loop(grouped_mm, case, dtype):
    num_tokens, num_experts, top_k, used = case
    g = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    hidden_size, inter = 32, 16
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)  # (N, hidden)
    w_gate_up, w_down = random_experts(g, num_experts, hidden_size, inter, dtype)
    topk_ids = random_ids(g, num_tokens, num_experts, top_k, used)  # (N, K)
    topk_weights = torch.rand(num_tokens, top_k, generator=g).to(dtype)  # (N, K)
    out = moe_experts_grouped(hidden, topk_weights, topk_ids, w_gate_up, w_down, grouped_mm)
    assert out.shape == hidden.shape and out.dtype == dtype
    torch.testing.assert_close(out, moe_experts(hidden, topk_weights, topk_ids, w_gate_up, w_down), **TOL[dtype])


@pytest.mark.parametrize("grouped_mm", IMPLS.values(), ids=IMPLS.keys())
def test_grouped_experts_with_routed_tokens_all_on_the_same_experts(grouped_mm):
    """Duplicate-heavy routing, through the real router: every token's hidden state is the same vector, so all
    pick the same K experts, whose runs are then the whole batch; the other experts get nobody."""
    g = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, hidden_size, inter = 70, 8, 2, 32, 16
    hidden = torch.randn(1, hidden_size, generator=g).expand(num_tokens, -1).contiguous()  # (N, hidden)
    hidden = hidden + 1e-3 * torch.randn(num_tokens, hidden_size, generator=g)  # rows differ, routing does not
    router = torch.randn(num_experts, hidden_size, generator=g)
    _, topk_weights, topk_ids = route(hidden, router, top_k, norm_topk_prob=True)
    assert len(topk_ids.unique()) == top_k  # the premise: all tokens on the same K experts
    w_gate_up, w_down = random_experts(g, num_experts, hidden_size, inter, torch.float32)
    out = moe_experts_grouped(hidden, topk_weights, topk_ids, w_gate_up, w_down, grouped_mm)
    expected = moe_experts(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("grouped_mm", IMPLS.values(), ids=IMPLS.keys())
def test_grouped_experts_leave_unrouted_experts_and_inputs_alone(grouped_mm):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 16, generator=g)
    w_gate_up, w_down = random_experts(g, 4, 16, 8, torch.float32)
    topk_ids = torch.tensor([[2], [2], [0], [2], [0], [2]])  # experts 1 and 3 get nobody
    weights = torch.rand(6, 1, generator=g)
    expected = moe_experts(hidden, weights, topk_ids, w_gate_up, w_down)
    before = hidden.clone()
    w_gate_up[[1, 3]] = float("nan")  # an expert nobody chose must not be read (its NaNs would spread)
    w_down[[1, 3]] = float("nan")
    out = moe_experts_grouped(hidden, weights, topk_ids, w_gate_up, w_down, grouped_mm)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert torch.equal(hidden, before)


def test_grouped_shapes_do_not_depend_on_the_routing():
    """What makes the path recordable in a CUDA graph: the same shapes whatever the routing. The loop's stages
    (one per expert that got tokens, each its own size) change with it."""
    g = torch.Generator().manual_seed(8)
    num_tokens, num_experts, top_k, hidden_size, inter = 10, 8, 2, 32, 16
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    w_gate_up, w_down = random_experts(g, num_experts, hidden_size, inter, torch.float32)
    weights = torch.rand(num_tokens, top_k, generator=g)
    routings = [random_ids(g, num_tokens, num_experts, top_k), random_ids(g, num_tokens, num_experts, top_k, 2)]
    grouped, loop = [], []
    for topk_ids in routings:
        with trace_shapes(layers=None, echo=False) as trace:
            moe_experts_grouped(hidden, weights, topk_ids, w_gate_up, w_down, grouped_mm_per_row)
            moe_experts(hidden, weights, topk_ids, w_gate_up, w_down)
        (step,) = trace.steps
        grouped.append(step.stage("moe.grouped"))
        loop.append(sorted(shapes["x"] for stage, shapes in step.stages if stage.startswith("moe.expert.")))
    rows = num_tokens * top_k
    expected = {
        "order": (rows,),
        "offsets": (num_experts,),
        "x": (rows, hidden_size),
        "gate_up": (rows, 2 * inter),
        "y": (rows, hidden_size),
    }
    assert grouped[0] == grouped[1] == expected
    assert loop[0] != loop[1] and len(loop[1]) == 2  # the loop's shapes follow the routing


# -- choosing the path ---------------------------------------------------------------------------------


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.from_dict({**TINY_QWEN3_MOE, **overrides})


def test_cpu_keeps_the_loop_and_no_cuda_graphs(monkeypatch):
    import nanoref.models.qwen3_moe as qwen3_moe

    model = Qwen3MoeForCausalLM(tiny_moe_config(), max_positions=32)
    assert model.supports_cuda_graphs is False
    block = model.sparse_blocks()[0]
    for param in block.parameters():  # router and experts: made with torch.empty
        torch.nn.init.normal_(param, std=0.1)
    assert not grouped_path_serves(block.experts.gate_up_proj)

    def must_not_run(*args, **kwargs):
        raise AssertionError("the grouped path ran on a CPU")

    monkeypatch.setattr(qwen3_moe, "moe_experts_grouped", must_not_run)
    with torch.inference_mode():
        out = block(torch.randn(5, TINY_QWEN3_MOE["hidden_size"]))
    assert out.shape == (5, TINY_QWEN3_MOE["hidden_size"]) and bool(out.isfinite().all())


def test_a_model_without_sparse_layers_supports_cuda_graphs():
    model = Qwen3MoeForCausalLM(tiny_moe_config(mlp_only_layers=[0, 1, 2, 3]), max_positions=32)
    assert model.sparse_blocks() == {} and model.supports_cuda_graphs is True


@needs_grouped_mm
def test_pick_on_cpu_follows_torch_grouped_mm_alignment():
    aligned = torch.empty(4, 2 * 16, 32)  # (E, 2 I, hidden): rows of 64 and 128 bytes in float32
    assert pick_grouped_mm(aligned) is grouped_mm_torch
    ragged = torch.empty(4, 2 * 5, 32, dtype=torch.bfloat16)  # I = 5: 10-byte rows, which torch._grouped_mm refuses
    assert pick_grouped_mm(ragged) is grouped_mm_per_row


@needs_triton
def test_triton_grouped_mm_names_mismatched_shapes():
    from nanoref.ops.moe_grouped_triton import grouped_mm

    with pytest.raises(ValueError, match=r"x \(5, 8\), w \(2, 3, 7\) and offsets \(2,\) do not fit"):
        grouped_mm(torch.zeros(5, 8), torch.zeros(2, 3, 7), torch.tensor([2, 5], dtype=torch.int32))


# -- on a GPU --------------------------------------------------------------------------------------------------

QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, top_k=8, inter=768)  # one sparse layer's shapes
SMALL = dict(hidden_size=64, num_experts=8, top_k=2, inter=32)


def routed_problem(num_tokens, hidden_size, num_experts, top_k, inter, dtype, seed=0):
    """Random hidden states routed by a random router (route(), as the model does), and random experts."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=g).to(dtype)  # (N, hidden)
    router = torch.randn(num_experts, hidden_size, device="cuda", generator=g).to(dtype)  # (E, hidden)
    _, topk_weights, topk_ids = route(hidden, router, top_k, norm_topk_prob=True)
    w_gate_up, w_down = random_experts(g, num_experts, hidden_size, inter, dtype)
    return hidden, topk_weights, topk_ids, w_gate_up, w_down


def relative_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    return float((out.float() - truth).norm() / truth.norm())


def assert_as_close_as_loop(problem, grouped_mm):
    """bf16: grouped and loop both against the loop in float32 on the same (bf16-rounded) inputs. The grouped path
    must be about as exact as the loop (it sums a token's K experts in float32; the loop in bf16)."""
    out = moe_experts_grouped(*problem, grouped_mm)
    loop = moe_experts(*problem)
    truth = moe_experts(*(t.float() if t.is_floating_point() else t for t in problem))
    grouped_error, loop_error = relative_error(out, truth), relative_error(loop, truth)
    assert grouped_error < 1e-2 and grouped_error <= 1.5 * loop_error + 1e-4, (grouped_error, loop_error)


@pytest.mark.gpu
def test_hopper_bf16_picks_torch_grouped_mm():
    w = torch.empty(128, 2 * 768, 2048, device="cuda", dtype=torch.bfloat16)
    expected = grouped_mm_torch if torch.cuda.get_device_capability()[0] in (9, 10) else grouped_mm_triton
    assert pick_grouped_mm(w) is expected and grouped_path_serves(w)
    assert pick_grouped_mm(w.float()) is grouped_mm_triton  # float32: CUTLASS's path is bf16 only


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 1024, 4096])
@pytest.mark.parametrize("shapes", [SMALL, QWEN3_30B_A3B], ids=["small", "qwen3-30b-a3b"])
@pytest.mark.parametrize("grouped_mm", [grouped_mm_torch, grouped_mm_triton], ids=["torch", "triton"])
def test_gpu_grouped_bf16_matches_loop(grouped_mm, shapes, num_tokens):
    if grouped_mm is grouped_mm_torch and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm's single-kernel path needs a Hopper or Blackwell GPU")
    assert_as_close_as_loop(routed_problem(num_tokens, **shapes, dtype=torch.bfloat16), grouped_mm)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 37, 512])
def test_gpu_triton_float32_matches_loop(num_tokens):
    problem = routed_problem(num_tokens, **QWEN3_30B_A3B, dtype=torch.float32, seed=1)
    out = moe_experts_grouped(*problem, grouped_mm_triton)
    torch.testing.assert_close(out, moe_experts(*problem), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_path_never_syncs_with_the_host(dtype):
    problem = routed_problem(256, **QWEN3_30B_A3B, dtype=dtype, seed=2)
    moe_experts_grouped(*problem)  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait now raises
    try:
        moe_experts_grouped(*problem)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the check works: the loop does sync (torch.where)
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe_experts(*problem)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_path_replays_from_a_cuda_graph_with_new_routing(dtype):
    """Record once, then replay on different tokens and routing written into the same buffers."""
    static = list(routed_problem(64, **QWEN3_30B_A3B, dtype=dtype, seed=3))  # hidden, weights, ids, w_gu, w_down
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_experts_grouped(*static)  # warm up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_grouped(*static)
    for seed in (4, 5):
        fresh = routed_problem(64, **QWEN3_30B_A3B, dtype=dtype, seed=seed)
        for buffer, value in zip(static[:3], fresh[:3]):  # new tokens and routing; same experts
            buffer.copy_(value)
        graph.replay()
        expected = moe_experts(*static)
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        else:
            assert relative_error(out, expected.float()) < 1e-2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe_grouped") / "m", seed=21, num_experts_per_tok=3)


@pytest.mark.gpu
def test_gpu_cuda_graphs_match_eager_and_hf(moe_model):
    prompts = random_prompts(seed=22, lengths=[3, 9, 17, 25, 33, 1, 40, 12, 5, 30, 18, 22, 7, 2, 16, 31, 8, 19, 27])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", num_kvcache_blocks=256, max_num_seqs=20)
    graphed = LLM(moe_model, **kwargs)
    eager = LLM(moe_model, enforce_eager=True, **kwargs)
    assert graphed.model_runner.model.supports_cuda_graphs and max(graphed.model_runner.decode_graphs.graphs) == 20
    assert eager.model_runner.decode_graphs is None
    out_graph = graphed.generate(prompts, params, use_tqdm=False)
    assert out_graph == eager.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, out_graph):
        assert output["token_ids"] == hf_greedy(moe_model, prompt, params.max_tokens)


@pytest.mark.gpu
def test_gpu_bf16_model_records_graphs_with_torch_grouped_mm(moe_model):
    llm = LLM(moe_model, device="cuda", dtype="bfloat16", num_kvcache_blocks=64, max_num_seqs=8)
    assert llm.model_runner.decode_graphs.graphs, "the grouped path should let the bf16 model record its decode graphs"
    outputs = llm.generate(random_prompts(seed=23, lengths=[4, 11, 30]), SamplingParams(temperature=0, max_tokens=12,
                           ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert all(len(o["token_ids"]) == 12 and all(0 <= t < 256 for t in o["token_ids"]) for o in outputs)
