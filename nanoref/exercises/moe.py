"""Checks for notebook 09's exercises: Qwen3-MoE's router (`moe_route`) and its expert loop (`moe_experts`).

Each check tests the learner's function alone on fresh random inputs against nanoref's own (`route`,
`moe_experts` in `nanoref.models.qwen3_moe`), naming the mistake when it recognises one, then runs the real engine
with it in place on a tiny random Qwen3-MoE and compares greedy generation token by token with HF transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    check_generation,
    input_generator,
    scratch_folder,
)
from nanoref.exercises.tensors import check_rounding, describe_row, expect_tensor, first_bad_row, ulps_apart
from nanoref.layers.activation import silu_and_mul
from nanoref.models.qwen3_moe import moe_experts, route
from nanoref.testing import make_tiny_qwen3_moe

# (atol, rtol) per dtype
_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}
_HIDDEN, _INTERMEDIATE = 24, 10  # distinct from every count below, so a transposed weight fails on its shape

_MOE_MODELS: dict[tuple, Path] = {}


def tiny_moe_model(seed: int = 0, **overrides: Any) -> Path:
    """A random tiny Qwen3-MoE folder (HF format; 4 sparse layers of 8 experts, top-2), built once per process."""
    key = (seed, tuple(sorted((name, repr(value)) for name, value in overrides.items())))
    if key not in _MOE_MODELS:
        folder = scratch_folder("tiny-qwen3-moe")
        _MOE_MODELS[key] = make_tiny_qwen3_moe(folder, seed=seed, **overrides)
    return _MOE_MODELS[key]


def _unchanged(name: str, case: str, before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    if not all(torch.equal(a, b) for a, b in zip(before, after)):
        raise ExerciseFailure(f"{case}: your {name} changed one of its inputs in place; return a new tensor instead")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    atol, rtol = _TOLERANCE[want.dtype]
    return first_bad_row(got, want, atol, rtol) is None


# -- the router ---------------------------------------------------------------------------------------------
SOFTMAX_RULE = "the router's softmax must run in float32: softmax(router_logits, dim=-1, dtype=torch.float32)"
LOGITS_RULE = (
    "router_logits in hidden's dtype (not float32), as HF's gate computes them; only the softmax runs in float32. "
    "Logits computed in float32 pick other experts and weights than the checkpoint's model: F.linear(hidden, "
    "router_weight), then softmax(router_logits, dim=-1, dtype=torch.float32)"
)


def _near_ties(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> None:
    """Make tokens 0 and 1 route on a near tie, in place: two experts compete for the last of the top_k places
    with logits one bfloat16 step apart, the lower-numbered expert ahead for token 1 and behind for token 0.
    Their float32 probabilities differ; rounded to bfloat16 they are equal, so a bfloat16 softmax's top-k picks
    by tie-breaking, and whichever way it breaks ties it picks wrong for one of the two tokens."""
    num_experts = router_weight.shape[0]
    low, high = 0.0625, 0.0625 + 2**-11  # 2**-11: bfloat16's step at 1/16
    first, second = num_experts // 3, 2 * num_experts // 3  # the two rivals
    for token, (a, b) in enumerate(((low, high), (high, low))):
        column = torch.full((num_experts,), -1.0)  # (E,): the rest far behind
        column[: top_k - 1] = 1.0  # experts 0 .. top_k-2: clearly ahead of the rivals
        column[first], column[second] = a, b
        hidden[token] = 0.0
        hidden[token, token] = 1.0  # token's logits are router_weight[:, token]
        router_weight[:, token] = column.to(router_weight.dtype)


def check_moe_route(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(hidden, router_weight, top_k, norm_topk_prob) -> (router_logits, topk_weights, topk_ids)` against
    nanoref's `route`, then greedy generation with it in every sparse layer against HF."""
    generator = input_generator(seed)
    cases = [  # (tokens, experts, top_k, norm_topk_prob, dtype)
        (11, 10, 3, False, torch.float32),
        (11, 10, 3, True, torch.float32),
        (1, 6, 1, True, torch.float32),  # one token, one expert: its weight renormalises to 1
        (9, 12, 2, True, torch.bfloat16),  # tokens 0 and 1 on a near tie (_near_ties)
        (40, 12, 3, True, torch.bfloat16),
        (9, 12, 2, False, torch.bfloat16),
    ]
    for num_tokens, num_experts, top_k, norm, dtype in cases:
        case = (
            f"{str(dtype).removeprefix('torch.')} hidden ({num_tokens}, {_HIDDEN}), {num_experts} experts, "
            f"top_k={top_k}, norm_topk_prob={norm}"
        )
        hidden = torch.randn(num_tokens, _HIDDEN, generator=generator).to(dtype)  # (N, hidden)
        router_weight = (0.4 * torch.randn(num_experts, _HIDDEN, generator=generator)).to(dtype)  # (E, hidden)
        if dtype == torch.bfloat16:
            _near_ties(hidden, router_weight, top_k)
        inputs = [hidden.clone(), router_weight.clone()]
        result = call_learner(fn, "moe_route", hidden, router_weight, top_k, norm, case=case)
        _unchanged("moe_route", case, inputs, [hidden, router_weight])
        if not (isinstance(result, tuple) and len(result) == 3):
            raise ExerciseFailure(
                f"moe_route should return a tuple (router_logits, topk_weights, topk_ids), got "
                f"{type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, tuple) else "")
            )
        logits, weights, ids = result
        want_logits, _, want_ids = route(hidden, router_weight, top_k, norm)
        _check_router_logits(logits, want_logits, case)
        probs = torch.softmax(want_logits, dim=-1, dtype=torch.float32)  # (N, E): the reference probabilities
        # the probabilities of logits computed in float32 (a product run in float32, its result cast back): the slip
        # LOGITS_RULE names, where the logits are 16-bit (in float32 they are the reference)
        slip = F.linear(hidden.float(), router_weight.float()).softmax(dim=-1) if dtype != torch.float32 else None
        _check_topk_ids(ids, probs, want_ids, top_k, dtype, case, slip)
        _check_topk_weights(weights, probs, ids, logits, norm, dtype, case, slip)
    if engine:
        check_generation({"moe_route": fn}, model=tiny_moe_model())


def _check_router_logits(logits: object, want: torch.Tensor, case: str) -> None:
    logits = expect_tensor(logits, f"{case}: router_logits", want.shape, want.dtype)
    if _close(logits, want):
        return
    if _close(logits.float().softmax(dim=-1).to(want.dtype), want.float().softmax(dim=-1).to(want.dtype)):
        raise ExerciseFailure(
            f"{case}: router_logits are off by a constant per row; return the raw scores hidden @ router_weight.T"
        )
    if _close(logits, want.float().softmax(dim=-1).to(want.dtype)):
        raise ExerciseFailure(
            f"{case}: router_logits hold probabilities; return the raw scores hidden @ router_weight.T (the "
            "softmax is only for picking the experts and their weights)"
        )
    row = first_bad_row(logits, want, *_TOLERANCE[want.dtype])
    raise ExerciseFailure(
        f"{case}: row {row} of router_logits is {describe_row(logits, want, row)}: router_logits (N, E) = "
        "F.linear(hidden, router_weight), one score per expert"
    )


def _check_topk_ids(
    ids: object,
    probs: torch.Tensor,
    want_ids: torch.Tensor,
    top_k: int,
    dtype: torch.dtype,
    case: str,
    slip: torch.Tensor | None = None,
) -> None:
    if isinstance(ids, torch.Tensor) and ids.dtype != torch.int64:
        raise ExerciseFailure(f"{case}: topk_ids has dtype {ids.dtype}, expected torch.int64 (torch.topk's indices)")
    ids = expect_tensor(ids, f"{case}: topk_ids", want_ids.shape, torch.int64)
    if not bool(((ids >= 0) & (ids < probs.shape[1])).all()):
        raise ExerciseFailure(f"{case}: topk_ids must be expert indices in [0, {probs.shape[1]})")
    best = probs.topk(top_k, dim=-1).values  # (N, K): the K largest probabilities, descending
    picked = probs.gather(1, ids)  # (N, K): the probabilities of the experts you picked
    for row in range(ids.shape[0]):
        chosen = ids[row].tolist()
        if len(set(chosen)) != top_k:
            raise ExerciseFailure(f"{case}: token {row} picks expert(s) {chosen}, some twice; pick {top_k} experts")
        mine = picked[row].sort(descending=True).values  # (K,)
        if not torch.allclose(mine, best[row], rtol=1e-5, atol=1e-7):
            details = (
                f"\ntoken {row} picks experts {chosen} (probabilities {[round(p, 6) for p in picked[row].tolist()]}), "
                f"but the {top_k} most probable are {want_ids[row].tolist()} "
                f"({[round(p, 6) for p in best[row].tolist()]})"
            )
            if slip is not None and torch.equal(ids[row], slip[row].topk(top_k).indices):
                raise ExerciseFailure(f"{case}: {LOGITS_RULE}" + details)
            if dtype == torch.bfloat16 and torch.equal(mine.to(dtype), best[row].to(dtype)):
                raise ExerciseFailure(
                    f"{case}: {SOFTMAX_RULE}" + details + ": rounded to bfloat16 they are equal, and the pick among "
                    "them comes down to rounding"
                )
            raise ExerciseFailure(
                f"{case}: token {row} does not pick the {top_k} most probable experts: take torch.topk of the "
                "softmax over all experts" + details
            )
        if not bool((picked[row][:-1] >= picked[row][1:] - 1e-7).all()):
            raise ExerciseFailure(
                f"{case}: token {row}'s experts {chosen} are not in descending probability order; keep torch.topk's "
                "order (the most probable expert first)"
            )


def _check_topk_weights(
    weights: object,
    probs: torch.Tensor,
    ids: torch.Tensor,
    logits: torch.Tensor,
    norm: bool,
    dtype: torch.dtype,
    case: str,
    slip: torch.Tensor | None = None,
) -> None:
    weights = expect_tensor(weights, f"{case}: topk_weights", ids.shape, dtype)
    kept = probs.gather(1, ids)  # (N, K) float32: the picked experts' probabilities
    renormalised = kept / kept.sum(dim=-1, keepdim=True)  # (N, K)
    want = (renormalised if norm else kept).to(dtype)
    if slip is not None and _close(weights, want) and not torch.equal(weights, want):
        slipped = slip.gather(1, ids)  # (N, K)
        slipped = (slipped / slipped.sum(dim=-1, keepdim=True) if norm else slipped).to(dtype)
        if int(ulps_apart(weights, slipped).max()) <= 1:
            check_rounding(weights, want, f"{case}: topk_weights", LOGITS_RULE)
    if _close(weights, want):
        check_rounding(
            weights, want, f"{case}: topk_weights", SOFTMAX_RULE + ", the weights cast to hidden's dtype last"
        )
        return
    if _close(weights, logits.gather(1, ids)):
        raise ExerciseFailure(f"{case}: topk_weights are router logits; take the softmax over all experts first")
    if not norm and _close(weights, renormalised.to(dtype)):
        raise ExerciseFailure(
            f"{case}: your weights sum to 1 per token; with norm_topk_prob=False they keep their share of all the "
            "experts: softmax over all E logits, then take the top k (a softmax over the k kept logits alone "
            "renormalises them too)"
        )
    if norm and _close(weights, kept.to(dtype)):
        raise ExerciseFailure(
            f"{case}: with norm_topk_prob=True, divide the k kept probabilities by their sum, so that each token's "
            "weights sum to 1"
        )
    row = first_bad_row(weights, want, *_TOLERANCE[dtype])
    raise ExerciseFailure(
        f"{case}: row {row} of topk_weights is {describe_row(weights, want, row)}: the softmax probabilities (in "
        "float32, over all experts) of the experts in topk_ids, in the same order"
        + (", divided by their sum" if norm else "")
    )


# -- the experts -------------------------------------------------------------------------------------------
def _expert_outputs(
    hidden: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """(N, K, hidden): each token's K experts' outputs, unweighted, token by token (the definition, slowly)."""
    rows = []
    for n in range(hidden.shape[0]):
        rows.append(
            torch.stack(
                [F.linear(silu_and_mul(F.linear(hidden[n], w_gate_up[e])), w_down[e]) for e in topk_ids[n].tolist()]
            )
        )
    return torch.stack(rows)


def _experts_case(generator: torch.Generator, num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype):
    hidden = torch.randn(num_tokens, _HIDDEN, generator=generator)  # (N, hidden)
    w_gate_up = torch.randn(num_experts, 2 * _INTERMEDIATE, _HIDDEN, generator=generator) * _HIDDEN**-0.5
    w_down = torch.randn(num_experts, _HIDDEN, _INTERMEDIATE, generator=generator) * _INTERMEDIATE**-0.5
    # each token's K distinct experts. One expert between the first and the last is never picked (an expert with no
    # tokens this step); the first and the last are always picked, so that a loop that skips either one fails
    idle = 1 + int(torch.randint(num_experts - 2, (1,), generator=generator))
    others = torch.tensor([e for e in range(num_experts) if e != idle])  # (E - 1,)
    topk_ids = torch.stack(
        [others[torch.randperm(num_experts - 1, generator=generator)[:top_k]] for _ in range(num_tokens)]
    )
    for i, expert in enumerate((num_experts - 1, 0)):
        token = i * (num_tokens - 1)  # the last expert in the first token, the first expert in the last token
        row = topk_ids[token]  # (K,): a view
        if not bool((row == expert).any()):
            free = [k for k in range(top_k) if row[k] != num_experts - 1 or expert == num_experts - 1]
            row[free[int(torch.randint(len(free), (1,), generator=generator))]] = expert
    topk_weights = 0.1 + torch.rand(num_tokens, top_k, generator=generator)  # (N, K): distinct, not summing to 1
    return hidden.to(dtype), topk_weights.to(dtype), topk_ids, w_gate_up.to(dtype), w_down.to(dtype)


# torch functions that multiply matrices (a learner may write any of them)
_PRODUCTS = {
    "linear",
    "matmul",
    "mm",
    "bmm",
    "einsum",
    "addmm",
    "baddbmm",
    "mv",
    "tensordot",
    "__matmul__",
    "__rmatmul__",
}


class _CountProducts(TorchFunctionMode):
    """Counts the matrix products a function runs (calls nested inside one are not seen: the mode steps aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _PRODUCTS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def check_moe_experts(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(hidden, topk_weights, topk_ids, w_gate_up, w_down) -> (N, hidden)` against nanoref's `moe_experts`,
    then greedy generation with it in every sparse layer against HF."""
    generator = input_generator(seed)
    cases = [  # (tokens, experts, top_k, dtype)
        (13, 6, 2, torch.float32),
        (7, 9, 3, torch.float32),
        (1, 4, 2, torch.float32),  # a decode step of one sequence
        (10, 5, 2, torch.bfloat16),
    ]
    for num_tokens, num_experts, top_k, dtype in cases:
        case = (
            f"{str(dtype).removeprefix('torch.')} hidden ({num_tokens}, {_HIDDEN}), {num_experts} experts of "
            f"intermediate size {_INTERMEDIATE}, top_k={top_k}"
        )
        inputs = _experts_case(generator, num_tokens, num_experts, top_k, dtype)
        before = [t.clone() for t in inputs]
        with _CountProducts() as products:
            got = call_learner(fn, "moe_experts", *inputs, case=case)
        _unchanged("moe_experts", case, before, list(inputs))
        hidden, topk_weights, topk_ids, w_gate_up, w_down = inputs
        got = expect_tensor(got, f"{case}: the result", hidden.shape, dtype)
        want = moe_experts(*inputs)
        if not _close(got, want):
            _diagnose_experts(got, want, inputs, case)
        picks = num_tokens * top_k
        if picks > 3 * num_experts and products.count > 3 * num_experts:
            raise ExerciseFailure(
                f"{case}: right, but your moe_experts ran {products.count} matrix products for {picks} (token, "
                f"expert) pairs: that is token by token. Group the work by expert: gather each expert's tokens "
                f"(torch.where(topk_ids == e)), run them through it in one gate_up and one down product (at most "
                f"{3 * num_experts} products for {num_experts} experts), and index_add_ the results back"
            )
    if engine:
        check_generation({"moe_experts": fn}, model=tiny_moe_model())


def _diagnose_experts(got: torch.Tensor, want: torch.Tensor, inputs: tuple, case: str) -> None:
    hidden, topk_weights, topk_ids, w_gate_up, w_down = inputs
    if _close(got, moe_experts(hidden, torch.ones_like(topk_weights), topk_ids, w_gate_up, w_down)):
        raise ExerciseFailure(
            f"{case}: your rows are the plain sum of each token's experts: scale expert topk_ids[n, k]'s output by "
            "the router's weight topk_weights[n, k] before adding it to row n"
        )
    swapped = torch.cat(w_gate_up.chunk(2, dim=1)[::-1], dim=1)  # (E, 2 I, hidden): [up | gate]
    if _close(got, moe_experts(hidden, topk_weights, topk_ids, swapped, w_down)):
        raise ExerciseFailure(
            f"{case}: gate and up are swapped: the first I rows of w_gate_up[e] are the gate (silu applies to it), "
            "the last I rows are up; silu_and_mul(x @ w_gate_up[e].T) takes them in that order"
        )
    scaled_inputs = torch.zeros_like(want, dtype=torch.float32)  # (N, hidden): the weights applied to the input
    for k in range(topk_ids.shape[1]):
        scaled = hidden.float() * topk_weights.float()[:, k : k + 1]  # (N, hidden)
        scaled_inputs += _expert_outputs(scaled, topk_ids[:, k : k + 1], w_gate_up.float(), w_down.float())[:, 0]
    if _close(got, scaled_inputs.to(got.dtype)):
        raise ExerciseFailure(
            f"{case}: your router weights scale the experts' input; they scale each expert's output (y * "
            "topk_weights[rows, slots, None] after the down projection): the expert's MLP is not linear"
        )
    outputs = _expert_outputs(hidden.float(), topk_ids, w_gate_up.float(), w_down.float())  # (N, K, hidden)
    weighted = outputs * topk_weights.float().unsqueeze(-1)  # (N, K, hidden)
    atol, rtol = _TOLERANCE[got.dtype]
    single = torch.isclose(got.float().unsqueeze(1), weighted, atol=atol, rtol=rtol).all(dim=-1).any(dim=1)  # (N,)
    if topk_ids.shape[1] > 1 and bool(single.all()):
        raise ExerciseFailure(
            f"{case}: each row holds only one of its token's {topk_ids.shape[1]} weighted expert outputs: a token's "
            "experts must accumulate in its row. out[rows] = y overwrites, and out[rows] += y keeps only one write "
            "when rows repeats a token; use out.index_add_(0, rows, y), which adds every row of y into out"
        )
    for expert in topk_ids.unique().tolist():
        skipped = moe_experts(hidden, topk_weights.masked_fill(topk_ids == expert, 0), topk_ids, w_gate_up, w_down)
        if _close(got, skipped):
            raise ExerciseFailure(
                f"{case}: expert {expert} adds nothing to the rows of the tokens that picked it: run every expert, "
                f"range(E) with E = w_gate_up.shape[0] = {w_gate_up.shape[0]} (an expert no token picked has no rows)"
            )
    row = first_bad_row(got, want, atol, rtol)
    experts = topk_ids[row].tolist()
    weights = [round(w, 4) for w in topk_weights[row].float().tolist()]
    raise ExerciseFailure(
        f"{case}: row {row} is {describe_row(got, want, row)}. That token picked experts {experts} with weights "
        f"{weights}: row {row} = sum over k of topk_weights[{row}, k] * (w_down[e] @ silu_and_mul(w_gate_up[e] @ "
        f"hidden[{row}])) with e = topk_ids[{row}, k]"
    )
