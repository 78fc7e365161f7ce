"""Qwen3-MoE: routing, the expert loop, loading both checkpoint layouts, and greedy output token-exact with HF."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanoref import LLM, SamplingParams, trace_shapes
from nanoref.models import Qwen3MoeForCausalLM, load_model_config
from nanoref.models.qwen3 import Qwen3MLP
from nanoref.models.qwen3_moe import Qwen3MoeSparseMoeBlock, count_expert_tokens, moe_experts, route
from nanoref.testing import make_tiny_qwen3_moe
from nanoref.utils.context import Context, reset_context, set_context
from nanoref.utils.loader import ModelFolderError

from .helpers import (
    assert_exact_across_cached_calls,
    assert_exact_through_preemption,
    assert_matches_hf,
    assert_no_block_leaked,
    copy_with_config,
    hf_model,
    random_prompts,
)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

# name -> overrides of nanoref.testing.TINY_QWEN3_MOE (4 layers, 8 experts, top-2, norm_topk_prob on)
MOE_CONFIGS = {
    "top2-norm": dict(),
    "top1-nonorm": dict(num_experts_per_tok=1, norm_topk_prob=False),
    "top3-step2": dict(num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2),
    "mlp-only": dict(mlp_only_layers=[0, 3], num_experts=6, num_experts_per_tok=4),
}
# which of the 4 layers HF makes sparse for each config (the rule in HF's Qwen3MoeDecoderLayer)
SPARSE_LAYERS = {"top2-norm": [0, 1, 2, 3], "top1-nonorm": [0, 1, 2, 3], "top3-step2": [1, 3], "mlp-only": [1, 2]}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return {
        name: make_tiny_qwen3_moe(root / name, seed=10 + i, **overrides)
        for i, (name, overrides) in enumerate(MOE_CONFIGS.items())
    }


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """nanoref's logits for every prompt token, all prompts in one flat prefill: (N, vocab)."""
    ids = torch.tensor([t for p in prompts for t in p])  # (N,)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])  # (N,)
    cu = torch.tensor([0] + torch.tensor([len(p) for p in prompts]).cumsum(0).tolist(), dtype=torch.int32)
    max_len = max(len(p) for p in prompts)
    set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len))
    try:
        with torch.inference_mode():
            hidden = llm.model_runner.model(ids, positions)  # (N, hidden)
            set_context(Context(is_prefill=False))  # every row: logits for all tokens
            return llm.model_runner.model.compute_logits(hidden)  # (N, vocab)
    finally:
        reset_context()


# -- the pure functions against independent references ---------------------------------------------


def naive_moe(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    """Token by token, slot by slot: out[n] = sum_k w[n, k] * down(silu(gate x) * up x) of expert ids[n, k]."""
    inter = w_down.shape[-1]
    out = torch.zeros_like(hidden)
    for n in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[n, k])
            gate = w_gate_up[e, :inter] @ hidden[n]  # (I,)
            up = w_gate_up[e, inter:] @ hidden[n]  # (I,)
            out[n] += topk_weights[n, k] * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 4, 1), (7, 8, 2), (23, 6, 3), (40, 16, 8)])
def test_moe_experts_matches_naive_per_token(num_tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    hidden_size, inter = 24, 10
    hidden = torch.randn(num_tokens, hidden_size, generator=g, dtype=torch.float64)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=g, dtype=torch.float64) * 0.3
    w_down = torch.randn(num_experts, hidden_size, inter, generator=g, dtype=torch.float64) * 0.3
    # distinct experts per token, in random order, with random (unnormalised) weights
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])  # (N, K)
    topk_weights = torch.rand(num_tokens, top_k, generator=g, dtype=torch.float64)  # (N, K)
    out = moe_experts(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(out, naive_moe(hidden, topk_weights, topk_ids, w_gate_up, w_down))


def test_moe_experts_leaves_unrouted_experts_and_inputs_alone():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 8, generator=g)
    w_gate_up, w_down = torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 3, generator=g)
    topk_ids = torch.tensor([[2], [2], [0], [2], [0], [2]])  # experts 1 and 3 get nobody
    weights = torch.rand(6, 1, generator=g)
    before = hidden.clone()
    poisoned = w_gate_up.clone()
    poisoned[[1, 3]] = float("nan")  # an expert nobody chose must not be touched (its NaNs would spread)
    out = moe_experts(hidden, weights, topk_ids, poisoned, w_down)
    torch.testing.assert_close(out, naive_moe(hidden, weights, topk_ids, w_gate_up, w_down))
    assert torch.equal(hidden, before)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_hf_router(norm_topk_prob, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=32, num_experts=12, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    hf_router = Qwen3MoeTopKRouter(config)
    g = torch.Generator().manual_seed(int(norm_topk_prob))
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(12, 32, generator=g))
    hf_router = hf_router.to(dtype)
    hidden = torch.randn(19, 32, generator=g).to(dtype)
    with torch.no_grad():
        expected_logits, expected_weights, expected_ids = hf_router(hidden)
    logits, weights, ids = route(hidden, hf_router.weight.detach(), 3, norm_topk_prob)
    assert weights.dtype == dtype and ids.dtype == torch.int64
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    if norm_topk_prob:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(19), rtol=1e-2, atol=1e-2)


# -- the model against HF transformers --------------------------------------------------------------


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_sparse_layers_follow_hf(moe_models, name):
    folder = moe_models[name]
    _, architecture, config = load_model_config(folder)
    assert architecture == "Qwen3MoeForCausalLM"
    model = Qwen3MoeForCausalLM(config, max_positions=64)
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    dense = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MLP)]
    assert sparse == SPARSE_LAYERS[name]
    assert sorted(sparse + dense) == list(range(config.num_hidden_layers))
    hf = hf_model(folder)
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]
    assert sparse == hf_sparse


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_prefill_logits_allclose_hf(moe_models, name):
    folder = moe_models[name]
    prompts = random_prompts(seed=6, lengths=[3, 21, 40])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=32)
    logits = prefill_logits(llm, prompts)
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = hf_model(folder)(torch.tensor([prompt])).logits[0]  # (L, vocab)
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, rtol=1e-4, atol=1e-4)
        start += len(prompt)


# HF's generate is slow on MoE: the quick loop checks every config's prefill logits against HF
# (test_prefill_logits_allclose_hf) and generates token-exact on mlp-only (and chunked on top3-step2)
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[] if name == "mlp-only" else [pytest.mark.slow]) for name in MOE_CONFIGS]
)
def test_greedy_matches_hf(moe_models, name):
    folder = moe_models[name]
    prompts = random_prompts(seed=1, lengths=[1, 7, 17, 33])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=64)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(folder, prompts, outputs, GREEDY.max_tokens)
    assert_no_block_leaked(llm)


def test_greedy_matches_hf_chunked_prefill(moe_models):
    """A token budget smaller than the prompts: every prompt is prefilled in several chunks."""
    folder = moe_models["top3-step2"]
    prompts = random_prompts(seed=2, lengths=[45, 30, 9])
    llm = LLM(folder, device="cpu", num_kvcache_blocks=64, max_num_batched_tokens=13)
    prefill_tokens = []
    original_schedule = llm.scheduler.schedule

    def recording_schedule():
        seqs, is_prefill = original_schedule()
        if is_prefill:
            prefill_tokens.append(sum(seq.num_scheduled_tokens for seq in seqs))
        return seqs, is_prefill

    llm.scheduler.schedule = recording_schedule
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(folder, prompts, outputs, GREEDY.max_tokens)
    assert max(prefill_tokens) <= 13 and len(prefill_tokens) >= 84 // 13  # the prompts really were split
    assert_no_block_leaked(llm)


def test_greedy_matches_hf_under_preemption_and_prefix_hits(moe_models):
    """So few KV blocks that decode must preempt; prompts share prefixes, so recompute hits the cache."""
    assert_exact_through_preemption(
        moe_models["mlp-only"], suffix_lens=[5, 12, 20, 3], max_tokens=30, num_kvcache_blocks=9, max_num_seqs=4
    )


def test_prefix_cache_hits_across_calls_keep_output_exact(moe_models):
    assert_exact_across_cached_calls(moe_models["top1-nonorm"], GREEDY.max_tokens)


# -- checkpoint layouts --------------------------------------------------------------------------


def expert_tensor_names(folder) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return [name for name in handle.keys() if ".experts." in name]


def test_hub_layout_and_transformers_stacked_layout_load_the_same(tmp_path, moe_models):
    """save_pretrained writes one tensor per expert (the hub's layout); with save_original_format=False it keeps
    transformers' stacked (E, 2 I, hidden) / (E, hidden, I) tensors. Both load, into the same weights."""
    hub = moe_models["top2-norm"]
    stacked = make_tiny_qwen3_moe(tmp_path / "stacked", seed=10, save_original_format=False)
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in expert_tensor_names(hub)
    assert sorted(expert_tensor_names(stacked))[:2] == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    a = LLM(hub, device="cpu", num_kvcache_blocks=16).model_runner.model.state_dict()
    b = LLM(stacked, device="cpu", num_kvcache_blocks=16).model_runner.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and the per-expert tensors went where HF's loader puts them (gate rows, then up rows)
    hub_tensors = load_file(str(hub / "model.safetensors"))
    stack = a["model.layers.2.mlp.experts.gate_up_proj"]  # (E, 2 I, hidden)
    assert torch.equal(stack[5, :32], hub_tensors["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(stack[5, 32:], hub_tensors["model.layers.2.mlp.experts.5.up_proj.weight"])
    prompt = random_prompts(seed=9, lengths=[11])
    output = LLM(stacked, device="cpu", num_kvcache_blocks=16).generate(prompt, GREEDY, use_tqdm=False)
    assert_matches_hf(stacked, prompt, output, GREEDY.max_tokens)


def rewrite_weights(tmp_path, folder, edit):
    """A copy of a model folder whose tensors went through `edit(tensors)`."""
    copy = copy_with_config(tmp_path, folder, lambda config: None)
    tensors = load_file(str(copy / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"))
    return copy


def test_checkpoint_lacking_one_expert_names_it(tmp_path, moe_models):
    folder = rewrite_weights(
        tmp_path, moe_models["top2-norm"], lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    )
    with pytest.raises(ModelFolderError, match="lacks 1 tensors: model.layers.1.mlp.experts.3.up_proj.weight"):
        LLM(folder, device="cpu", num_kvcache_blocks=16)


def test_expert_tensor_of_the_wrong_shape_is_named(tmp_path, moe_models):
    name = "model.layers.0.mlp.experts.2.down_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()

    folder = rewrite_weights(tmp_path, moe_models["top2-norm"], edit)
    with pytest.raises(ModelFolderError, match=rf"tensor '{name}': checkpoint tensor has shape \(64, 31\)"):
        LLM(folder, device="cpu", num_kvcache_blocks=16)


def test_expert_beyond_num_experts_matches_no_parameter(tmp_path, moe_models):
    name = "model.layers.0.mlp.experts.8.gate_proj.weight"  # 8 experts: ids 0..7

    def edit(tensors):
        tensors[name] = tensors["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()

    folder = rewrite_weights(tmp_path, moe_models["top2-norm"], edit)
    with pytest.raises(ModelFolderError, match=f"tensor '{name}' matches no parameter"):
        LLM(folder, device="cpu", num_kvcache_blocks=16)


def test_stacked_and_per_expert_tensors_together_are_refused(tmp_path, moe_models):
    def edit(tensors):
        tensors["model.layers.0.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(8)]
        )

    folder = rewrite_weights(tmp_path, moe_models["top2-norm"], edit)
    with pytest.raises(ModelFolderError, match="either whole or in pieces"):
        LLM(folder, device="cpu", num_kvcache_blocks=16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be at most num_local_experts"),
        (lambda c: c.update(num_experts_per_tok=0), "num_experts_per_tok must be an integer >= 1"),
        (lambda c: c.pop("moe_intermediate_size"), "lacks required Qwen3-MoE fields: moe_intermediate_size"),
        (lambda c: c.pop("num_local_experts"), "lacks required Qwen3-MoE fields: num_experts"),
        (lambda c: c.update(num_experts=4), r"num_experts \(4\) and num_local_experts \(8\) disagree"),
        (lambda c: c.update(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
        (lambda c: c.update(decoder_sparse_step=0), "decoder_sparse_step must be an integer >= 1"),
        (lambda c: c.update(mlp_only_layers=[4]), r"mlp_only_layers must be a list of layer indices in \[0, 4\)"),
        (lambda c: c.update(mlp_only_layers=3), "mlp_only_layers must be a list"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (lambda c: c.update(use_sliding_window=True, sliding_window=4), "use_sliding_window must be false"),
    ],
)
def test_malformed_moe_config_is_named(tmp_path, moe_models, edit, message):
    folder = copy_with_config(tmp_path, moe_models["top2-norm"], edit)
    with pytest.raises(ModelFolderError, match=message):
        LLM(folder, device="cpu", num_kvcache_blocks=16)


def test_hub_style_config_loads(tmp_path, moe_models):
    """The hub's Qwen3-MoE config.json says num_experts (transformers 5 writes num_local_experts), a top-level
    rope_theta, and mlp_only_layers as [] or null."""

    def edit(config):
        config["num_experts"] = config.pop("num_local_experts")
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        config["mlp_only_layers"] = None

    folder = copy_with_config(tmp_path, moe_models["top2-norm"], edit)
    _, _, config = load_model_config(folder)
    assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (8, 2, [])
    assert json.loads((folder / "config.json").read_text())["num_experts"] == 8


def test_zero_experts_is_a_dense_model_as_in_hf(tmp_path):
    """num_experts 0 makes every layer dense in transformers and vLLM (whatever num_experts_per_tok says): it loaded
    as a ValueError 'num_local_experts must be an integer >= 1'."""
    folder = make_tiny_qwen3_moe(tmp_path / "m", seed=5, num_experts=0, num_experts_per_tok=2)
    _, _, config = load_model_config(folder)
    assert config.num_experts == 0
    llm = LLM(folder, device="cpu", num_kvcache_blocks=32)
    assert all(isinstance(layer.mlp, Qwen3MLP) for layer in llm.model_runner.model.model.layers)
    prompts = random_prompts(seed=7, lengths=[4, 13])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(folder, prompts, outputs, GREEDY.max_tokens)


def test_make_tiny_qwen3_moe_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    make_tiny_qwen3_moe(tmp_path / "a", num_hidden_layers=1)
    assert torch.equal(torch.get_rng_state(), state)


# -- tracing and expert load -------------------------------------------------------------------------


def test_trace_records_router_shapes(moe_models):
    folder = moe_models["top3-step2"]  # layers 1 and 3 sparse, 8 experts, top-3
    llm = LLM(folder, device="cpu", num_kvcache_blocks=16)
    with trace_shapes(layers=None, max_steps=2, echo=False) as trace:
        llm.generate([[1, 2, 3, 4, 5], [6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    prefill, decode = trace.steps
    assert prefill.stage("layers.1.moe.router") == {
        "hidden": (7, 64),
        "router_logits": (7, 8),
        "topk_weights": (7, 3),
        "topk_ids": (7, 3),
    }
    # one stage per expert that got tokens: its gathered rows, and together every token K times
    experts = [shapes for stage, shapes in prefill.stages if stage.startswith("layers.1.moe.expert.")]
    assert 1 <= len(experts) <= 8
    assert sum(shapes["x"][0] for shapes in experts) == 7 * 3
    assert all(shapes["gate_up"] == (shapes["x"][0], 64) and shapes["y"] == shapes["x"] for shapes in experts)
    assert decode.stage("layers.3.moe.router")["topk_ids"] == (2, 3)
    assert decode.stage("layers.3.moe.experts") == {"w_gate_up": (8, 64, 64), "w_down": (8, 64, 32), "out": (2, 64)}
    assert decode.stage("layers.0.mlp")["out"] == (2, 64)  # layer 0 is dense
    with pytest.raises(KeyError):
        decode.stage("layers.0.moe.router")


def test_count_expert_tokens_counts_every_routed_token(moe_models):
    folder = moe_models["mlp-only"]  # layers 1 and 2 sparse, 6 experts, top-4
    llm = LLM(folder, device="cpu", num_kvcache_blocks=32)
    prompts = random_prompts(seed=8, lengths=[9, 14])
    model = llm.model_runner.model
    with count_expert_tokens(model) as counts:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert sorted(counts) == [1, 2]
    tokens = sum(len(p) for p in prompts) + len(prompts) * (5 - 1)  # every prompt token, then one per decode step
    for layer, count in counts.items():
        assert count.shape == (6,) and int(count.sum()) == tokens * 4, layer
    # the hooks are gone afterwards: the counts stay put
    frozen = {layer: count.clone() for layer, count in counts.items()}
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert all(torch.equal(counts[layer], frozen[layer]) for layer in counts)
    # and they agree with running the router by hand on one layer's input
    block = model.sparse_blocks()[1]
    hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    with count_expert_tokens(model) as fresh, torch.inference_mode():
        block(hidden)
    _, _, ids = route(hidden, block.gate.weight, 4, block.norm_topk_prob)
    assert torch.equal(fresh[1], torch.bincount(ids.flatten(), minlength=6))
    assert int(fresh[2].sum()) == 0
