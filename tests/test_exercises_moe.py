"""Notebook 09's exercise seams and checks: the engine calls the MoE seams, the checks accept nanoref's own router
and expert loop and name typical mistakes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoref import LLM, SamplingParams
from nanoref.exercises import ExerciseFailure, check_generation, check_moe_experts, check_moe_route, tiny_moe_model
from nanoref.layers.activation import silu_and_mul
from nanoref.models.qwen3_moe import moe_experts, route
from nanoref.utils import seams

from .helpers import assert_readable_failure


@pytest.mark.parametrize("name, default", [("moe_route", route), ("moe_experts", moe_experts)])
def test_the_engine_calls_each_moe_seam_only_inside_use(name, default):
    llm = LLM(tiny_moe_model(), device="cpu", num_kvcache_blocks=16)  # eager everywhere: every step calls the seam
    params = SamplingParams(temperature=0, max_tokens=3)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    reference = llm.generate(prompts, params, use_tqdm=False)
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return default(*args)

    with seams.use(**{name: counting}):
        replaced = llm.generate(prompts, params, use_tqdm=False)
    assert replaced == reference
    assert len(calls) == 4 * 3  # 4 sparse layers, 3 steps (a prefill of 8 tokens, 2 decode steps)
    assert calls[0] == (8, 64) and calls[-1] == (2, 64)
    llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) == 12 and not seams.active()


def test_checks_accept_nanorefs_own_functions():
    check_moe_route(route)
    check_moe_experts(moe_experts)


# -- wrong expert loops -------------------------------------------------------------------------------------
def loop(hidden, topk_weights, topk_ids, w_gate_up, w_down, *, weighted=True, write="index_add", gate_first=True):
    """The per-expert loop with one thing changed (the mistakes the check should name)."""
    out = torch.zeros_like(hidden)
    for expert in range(w_gate_up.shape[0]):
        rows, slots = torch.where(topk_ids == expert)
        gate, up = F.linear(hidden[rows], w_gate_up[expert]).chunk(2, dim=-1)
        if not gate_first:
            gate, up = up, gate
        y = F.linear(F.silu(gate) * up, w_down[expert])
        if weighted:
            y = y * topk_weights[rows, slots].unsqueeze(-1)
        if write == "index_add":
            out.index_add_(0, rows, y)
        else:
            out[rows] = y
    return out


def flat_plus_equals(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    # every (token, slot) pair at once, written back with `+=` through a repeated index: duplicates do not add up
    rows = torch.arange(hidden.shape[0]).repeat_interleave(topk_ids.shape[1])  # (N K,)
    experts = topk_ids.flatten()  # (N K,)
    gate_up = torch.einsum("mh,mih->mi", hidden[rows], w_gate_up[experts])  # (N K, 2 I)
    y = torch.einsum("mi,mhi->mh", silu_and_mul(gate_up), w_down[experts]) * topk_weights.flatten()[:, None]
    out = torch.zeros_like(hidden)
    out[rows] += y
    return out


def token_by_token(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    # right, but one small product per (token, expert) pair instead of one per expert
    out = torch.zeros_like(hidden)
    for n in range(hidden.shape[0]):
        for k, e in enumerate(topk_ids[n].tolist()):
            out[n] += topk_weights[n, k] * (w_down[e] @ silu_and_mul(w_gate_up[e] @ hidden[n]))
    return out


def first_slot_weight(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    return moe_experts(hidden, topk_weights[:, :1].expand_as(topk_weights), topk_ids, w_gate_up, w_down)


def in_place(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    out = moe_experts(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    hidden.copy_(out)
    return hidden


def weights_on_the_input(hidden, topk_weights, topk_ids, w_gate_up, w_down):  # scales x, not the expert's output
    out = torch.zeros_like(hidden)
    for expert in range(w_gate_up.shape[0]):
        rows, slots = torch.where(topk_ids == expert)
        x = hidden[rows] * topk_weights[rows, slots].unsqueeze(-1)  # (M, hidden)
        out.index_add_(0, rows, F.linear(silu_and_mul(F.linear(x, w_gate_up[expert])), w_down[expert]))
    return out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (weights_on_the_input, "your router weights scale the experts' input;\\s+they scale each expert's output"),
        (lambda *a: loop(*a, weighted=False), "plain sum.*topk_weights\\[n, k\\]"),
        (lambda *a: loop(*a, gate_first=False), "gate and up are swapped"),
        (lambda *a: loop(*a, write="assign"), "only one of its token's 2 weighted expert outputs.*index_add_"),
        (flat_plus_equals, "only one of its token's 2.*out\\[rows\\] \\+= y keeps only one write"),
        (token_by_token, "right, but your moe_experts ran 52 matrix products for 26 \\(token, expert\\) pairs"),
        (first_slot_weight, "row 0 is .* experts \\[.*\\] with weights"),
        (in_place, "changed one of its inputs in place"),
        (lambda *a: moe_experts(*a).float(), "dtype torch.float32, expected torch.bfloat16"),
        (lambda *a: moe_experts(*a)[:-1], "shape \\(12, 24\\), expected \\(13, 24\\)"),
        (lambda h, w, i, gu, d: moe_experts(h, w, i, gu.transpose(1, 2), d), "your moe_experts raised RuntimeError"),
    ],
)
def test_wrong_moe_experts_fails_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_moe_experts(wrong, engine=False)
    assert_readable_failure(failure.value)


def test_a_wrong_expert_loop_changes_generation():
    """The engine half of the check bites: a wrong loop in every sparse layer changes HF's tokens."""
    with pytest.raises(ExerciseFailure, match="generates token"):
        check_generation({"moe_experts": lambda *a: loop(*a, write="assign")}, model=tiny_moe_model())


def test_a_loop_right_only_on_the_checks_inputs_is_caught_by_the_engine():
    def only_small_hidden(hidden, *rest):
        out = moe_experts(hidden, *rest)
        return out if hidden.shape[1] < 64 else 1.5 * out  # right at the check's size, wrong at the model's

    with pytest.raises(ExerciseFailure, match="with your `moe_experts` in the engine"):
        check_moe_experts(only_small_hidden)


def all_but_the_last_expert(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    # loops over range(E - 1): the last expert's tokens get nothing from it
    out = torch.zeros_like(hidden)
    for expert in range(w_gate_up.shape[0] - 1):
        rows, slots = torch.where(topk_ids == expert)
        y = F.linear(silu_and_mul(F.linear(hidden[rows], w_gate_up[expert])), w_down[expert])
        out.index_add_(0, rows, y * topk_weights[rows, slots].unsqueeze(-1))
    return out


def all_but_the_first_expert(hidden, topk_weights, topk_ids, w_gate_up, w_down):
    out = torch.zeros_like(hidden)
    for expert in range(1, w_gate_up.shape[0]):
        rows, slots = torch.where(topk_ids == expert)
        y = F.linear(silu_and_mul(F.linear(hidden[rows], w_gate_up[expert])), w_down[expert])
        out.index_add_(0, rows, y * topk_weights[rows, slots].unsqueeze(-1))
    return out


@pytest.mark.parametrize("wrong", [all_but_the_last_expert, all_but_the_first_expert])
@pytest.mark.parametrize("seed", range(8))
def test_an_expert_loop_that_skips_an_expert_fails_on_every_draw(wrong, seed):
    with pytest.raises(ExerciseFailure, match="(?s)every expert.*range\\(E\\)") as failure:
        check_moe_experts(wrong, seed=seed, engine=False)
    assert_readable_failure(failure.value)


def test_nanorefs_expert_loop_passes_on_other_draws():
    for seed in range(8):
        check_moe_experts(moe_experts, seed=seed, engine=False)


# -- wrong routers ------------------------------------------------------------------------------------------
def softmax_of_kept_logits(hidden, router_weight, top_k, norm_topk_prob):
    logits = F.linear(hidden, router_weight)
    kept, ids = logits.topk(top_k, dim=-1)
    return logits, kept.float().softmax(dim=-1).to(hidden.dtype), ids


def never_renormalised(hidden, router_weight, top_k, norm_topk_prob):
    return route(hidden, router_weight, top_k, False)


def logits_as_weights(hidden, router_weight, top_k, norm_topk_prob):
    logits = F.linear(hidden, router_weight)
    weights, ids = logits.topk(top_k, dim=-1)
    return logits, weights, ids


def probabilities_as_logits(hidden, router_weight, top_k, norm_topk_prob):
    logits, weights, ids = route(hidden, router_weight, top_k, norm_topk_prob)
    return logits.float().softmax(dim=-1).to(hidden.dtype), weights, ids


def reversed_order(hidden, router_weight, top_k, norm_topk_prob):
    logits, weights, ids = route(hidden, router_weight, top_k, norm_topk_prob)
    return logits, weights.flip(-1), ids.flip(-1)


def least_probable(hidden, router_weight, top_k, norm_topk_prob):
    logits = F.linear(hidden, router_weight)
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1, largest=False)
    return logits, weights.to(hidden.dtype), ids


@pytest.mark.parametrize(
    "wrong, message",
    [
        (softmax_of_kept_logits, "sum to 1 per token; with norm_topk_prob=False"),
        (never_renormalised, "with norm_topk_prob=True, divide the k kept probabilities by their sum"),
        (logits_as_weights, "topk_weights are router logits"),
        (probabilities_as_logits, "router_logits hold probabilities"),
        (reversed_order, "not in descending probability order"),
        (least_probable, "token 0 picks experts .* but the 3 most probable are"),
        (lambda *a: route(*a)[:2], "tuple \\(router_logits, topk_weights, topk_ids\\), got tuple of length 2"),
        (lambda *a: (route(*a)[0], route(*a)[1].float(), route(*a)[2]), "topk_weights has dtype torch.float32"),
        (lambda *a: (route(*a)[0], route(*a)[1], route(*a)[2].int()), "topk_ids has dtype torch.int32"),
    ],
)
def test_wrong_moe_route_fails_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_moe_route(wrong, engine=False)
    assert_readable_failure(failure.value)


def softmax_in_input_dtype(hidden, router_weight, top_k, norm_topk_prob):
    # the softmax, the top-k and the renormalisation in bf16: close probabilities round to equal values
    logits = F.linear(hidden, router_weight)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights, ids


def test_a_router_softmax_in_bf16_fails_naming_the_float32_rule():
    with pytest.raises(ExerciseFailure, match="bfloat16 .*the router's softmax must run in float32") as failure:
        check_moe_route(softmax_in_input_dtype, engine=False)
    assert_readable_failure(failure.value)


def logits_in_float32(hidden, router_weight, top_k, norm_topk_prob):
    # the softmax in float32, as asked, but over logits from a float32 product: not the checkpoint's (HF's) logits
    logits = F.linear(hidden.float(), router_weight.float())
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits.to(hidden.dtype), weights.to(hidden.dtype), ids


@pytest.mark.parametrize("seed", range(6))
def test_a_router_whose_product_runs_in_float32_is_told_so_not_that_its_float32_softmax_is_missing(seed):
    with pytest.raises(ExerciseFailure) as failure:
        check_moe_route(logits_in_float32, seed=seed, engine=False)
    message = str(failure.value).replace("\n", " ")
    assert "router_logits in hidden's dtype (not float32)" in message
    assert "the router's softmax must run in float32" not in message
    assert_readable_failure(failure.value)


def test_nanorefs_router_passes_on_other_draws():
    for seed in range(5):
        check_moe_route(route, seed=seed, engine=False)


def test_a_wrong_router_changes_generation():
    with pytest.raises(ExerciseFailure, match="generates token"):
        check_generation({"moe_route": never_renormalised}, model=tiny_moe_model())


def test_an_unwritten_exercise_raises_not_implemented_error():
    """A student copy's stub stops the notebook with NotImplementedError (what the classroom tests look for)."""

    def stub(*args):
        raise NotImplementedError()

    for check in (check_moe_route, check_moe_experts):
        with pytest.raises(NotImplementedError):
            check(stub, engine=False)
