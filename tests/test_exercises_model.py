"""Notebook 07's exercise seams and checks: the engine really calls each seam, the checks accept nanoref's own
functions and reject typical wrong answers with a message that names the mistake."""

from __future__ import annotations

import linecache
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanoref import LLM, SamplingParams
from nanoref.exercises import (
    ExerciseFailure,
    check_apply_rotary,
    check_apply_top_k_top_p,
    check_silu_and_mul,
)
from nanoref.layers.activation import silu_and_mul
from nanoref.layers.rotary import apply_rotary
from nanoref.layers.sampler import apply_top_k_top_p
from nanoref.utils import seams

from .helpers import assert_readable_failure


def counting(function, calls):
    def wrapper(*args):
        calls.append(args[0].shape)
        return function(*args)

    return wrapper


@pytest.mark.parametrize(
    "name, default, params",
    [
        ("apply_rotary", apply_rotary, SamplingParams(temperature=0, max_tokens=3)),
        ("silu_and_mul", silu_and_mul, SamplingParams(temperature=0, max_tokens=3)),
        ("apply_top_k_top_p", apply_top_k_top_p, SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=3)),
    ],
)
def test_the_engine_calls_each_seam(tiny_model, name, default, params):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    reference = llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)
    calls = []
    with seams.use(**{name: counting(default, calls)}):
        replaced = llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)
    assert calls, f"the engine never called the {name} seam"
    assert replaced == reference


def test_a_wrong_rotary_changes_generation(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = [list(range(10, 40))]
    reference = llm.generate(prompts, params, use_tqdm=False)
    with seams.use(apply_rotary=lambda x, cos, sin: x):  # no rotation at all
        broken = llm.generate(prompts, params, use_tqdm=False)
    assert broken != reference


def test_checks_accept_nanorefs_own_functions():
    check_apply_rotary(apply_rotary)
    check_silu_and_mul(silu_and_mul)
    check_apply_top_k_top_p(apply_top_k_top_p)


def interleaved_rotary(x, cos, sin):
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def top_p_strict(logits, top_k, top_p):
    # the nucleus cut one token too early: drops the token that crosses top_p
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) > top_p[:, None]
    ranks = torch.arange(logits.shape[-1])[None, :]
    drop |= ranks >= torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def rotary_one_sign_wrong(x, cos, sin):  # x1*sin subtracted in the second half too: no longer a rotation
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1).to(x.dtype)


@pytest.mark.parametrize(
    "check, wrong, message",
    [
        (check_apply_rotary, interleaved_rotary, "adjacent pairs"),
        (check_apply_rotary, lambda x, cos, sin: apply_rotary(x, cos, -sin), "-angle"),
        (check_apply_rotary, lambda x, cos, sin: apply_rotary(x, cos, sin).float(), "dtype"),
        (check_apply_rotary, rotary_one_sign_wrong, "one sign wrong: the first half is x1\\*cos - x2\\*sin"),
        (check_silu_and_mul, lambda x: F.silu(x.chunk(2, -1)[1]) * x.chunk(2, -1)[0], "first half of x is the gate"),
        (check_silu_and_mul, lambda x: torch.sigmoid(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], "sigmoid"),
        (check_apply_top_k_top_p, lambda logits, k, p: logits, "row 1 \\(top_k=5"),
        (
            check_apply_top_k_top_p,
            top_p_strict,
            "top_p=0.7.*you drop the token that crosses top_p:\\skeep a token "
            "while the top_k survivors ranked above it have probability < top_p",
        ),
    ],
)
def test_checks_name_the_mistake(check, wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check(wrong, engine=False)
    assert_readable_failure(failure.value)


def rotary_in_bf16(x, cos, sin):
    # neox halves, right signs, but the products and sums in x's dtype (cos and sin cast down to it)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_a_rotary_computed_in_bf16_fails_naming_the_float32_rule():
    with pytest.raises(ExerciseFailure, match="RoPE must rotate in float32") as failure:
        check_apply_rotary(rotary_in_bf16, engine=False)
    assert_readable_failure(failure.value)


def rotary_without_head_axis(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)  # cos is (N, D/2): no head axis


def test_an_exception_in_the_learners_function_names_their_line_and_the_fix():
    with pytest.raises(ExerciseFailure) as failure:
        check_apply_rotary(rotary_without_head_axis, engine=False)
    message = str(failure.value)
    first = message.splitlines()[0]
    line = rotary_without_head_axis.__code__.co_firstlineno + 2
    assert f"raised RuntimeError at test_exercises_model.py:{line}, in rotary_without_head_axis" in first
    assert "add a head axis, cos[:, None, :]" in first
    assert "return torch.cat((x1 * cos - x2 * sin" in message  # the learner's source line
    assert "must match the size of tensor" in message  # torch's own words, after
    assert_readable_failure(failure.value)


def rotary_split_along_tokens(x, cos, sin):
    x1, x2 = x.float().chunk(2)  # chunk's default axis is 0: the tokens, not each head's D values
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def test_a_rotary_that_splits_the_tokens_is_told_to_split_the_last_axis_not_to_add_the_head_axis_it_has():
    with pytest.raises(ExerciseFailure) as failure:
        check_apply_rotary(rotary_split_along_tokens, engine=False)
    first = str(failure.value).replace("\n", " ")
    assert "split the last axis, x.chunk(2, dim=-1)" in first
    assert "add a head axis" not in first


def test_a_silu_and_mul_that_splits_the_rows_is_told_to_split_each_row():
    with pytest.raises(ExerciseFailure, match=r"x.chunk\(2, dim=-1\)"):
        check_silu_and_mul(lambda x: F.silu(x.chunk(2)[0]) * x.chunk(2)[1], engine=False)


CELL = """import torch

def rotary_without_head_axis(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
"""


def test_an_exception_in_a_notebook_cell_names_the_cells_line_not_its_temporary_file():
    filename = "/tmp/ipykernel_4242/2803216123.py"  # what ipykernel compiles a cell as
    linecache.cache[filename] = (len(CELL), None, CELL.splitlines(keepends=True), filename)  # as ipykernel does
    try:
        namespace: dict = {}
        exec(compile(CELL, filename, "exec"), namespace)
        with pytest.raises(ExerciseFailure) as failure:
            check_apply_rotary(namespace["rotary_without_head_axis"], engine=False)
    finally:
        del linecache.cache[filename]
    message = str(failure.value)
    assert "raised RuntimeError at your cell, line 5, in rotary_without_head_axis" in message.splitlines()[0]
    assert "ipykernel" not in message and "2803216123" not in message
    assert "return torch.cat((x1 * cos - x2 * sin" in message  # the cell's source line


def top_k_cut(sorted_logits, top_k):
    # (the reference's top-k on logits sorted best first: every logit >= the k-th largest)
    vocab = sorted_logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    return sorted_logits.masked_fill(sorted_logits < sorted_logits.gather(-1, k - 1), float("-inf"))


def top_p_without_off(logits, top_k, top_p):
    # the rule right (ties kept, top-p over the survivors), but top_p 1.0 used as a threshold too: a float32 cumsum
    # can reach 1.0 early
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = top_k_cut(sorted_logits, top_k)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def top_p_on_the_whole_row(logits, top_k, top_p):
    # each cut on the row's original distribution, side by side, instead of top-p over the top-k survivors
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = top_k_cut(sorted_logits, top_k).masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def top_k_by_rank(logits, top_k, top_p):
    # top-p right, but top-k keeps exactly k ranks: a token tied with the k-th largest logit is dropped
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= torch.where(top_k > 0, top_k, vocab)[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


@pytest.mark.parametrize("seed", range(4))
def test_top_p_on_the_whole_row_fails_on_every_draw(seed):
    # the random rows catch it only when their nucleus ends inside the top k; the worked row (top_k=2, top_p=0.5,
    # probabilities 0.30 and 0.25 first) on every run
    torch.manual_seed(seed)
    with pytest.raises(ExerciseFailure, match="not on the row's whole distribution") as failure:
        check_apply_top_k_top_p(top_p_on_the_whole_row, engine=False)
    assert_readable_failure(failure.value)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_by_rank_fails_on_every_draw_at_a_tie(seed):
    torch.manual_seed(seed)
    with pytest.raises(ExerciseFailure, match="(?s)top_k=2, top_p=1.0.*compare values, not ranks") as failure:
        check_apply_top_k_top_p(top_k_by_rank, engine=False)
    assert_readable_failure(failure.value)


def top_p_at_or_below(logits, top_k, top_p):
    # keeps a token while the better-ranked mass is <= top_p: one token too many where that mass equals top_p exactly
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = top_k_cut(sorted_logits, top_k)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs > top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


@pytest.mark.parametrize("seed", range(4))
def test_a_top_p_that_keeps_the_token_reaching_top_p_exactly_fails_on_every_draw(seed):
    # random rows never put the better-ranked mass exactly on top_p; the worked row does, without ties
    torch.manual_seed(seed)
    with pytest.raises(ExerciseFailure, match="(?s)top_p=0.8125.*equals top_p exactly.*< top_p, not <=") as failure:
        check_apply_top_k_top_p(top_p_at_or_below, engine=False)
    assert_readable_failure(failure.value)


def top_p_in_float64(logits, top_k, top_p):
    # right, with the probabilities in float64: the worked row's better-ranked mass is then just above top_p
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = top_k_cut(sorted_logits, top_k)
    probs = sorted_logits.double().softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None].double()) & (top_p[:, None] < 1.0)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def hfs_warpers(logits, top_k, top_p):
    # right: HF's TopKLogitsWarper, then TopPLogitsWarper (ascending cumsum, removing where it is <= 1 - top_p)
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    rows = []
    for row in range(logits.shape[0]):
        out = logits[row : row + 1]
        if 0 < top_k[row] < logits.shape[1]:
            out = TopKLogitsWarper(int(top_k[row]))(None, out)
        if top_p[row] < 1.0:
            out = TopPLogitsWarper(float(top_p[row]))(None, out)
        rows.append(out)
    return torch.cat(rows)


@pytest.mark.parametrize("right", [top_p_in_float64, hfs_warpers])
@pytest.mark.parametrize("seed", range(4))
def test_other_right_top_p_cuts_pass_the_exact_boundary_row(right, seed):
    torch.manual_seed(seed)
    check_apply_top_k_top_p(right, engine=False)


def test_nanorefs_top_k_and_top_p_are_hfs_warpers_on_fresh_logits():
    """The oracle: HF's TopKLogitsWarper, then TopPLogitsWarper, row by row, on fresh logits with ties."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    seed = torch.seed()
    logits = (torch.randn(24, 300) * 3).round(decimals=1)  # (B, V): rounded, so that ties occur
    top_k = torch.randint(0, 40, (24,))
    top_p = torch.where(torch.rand(24) < 0.3, 1.0, torch.rand(24).clamp(min=0.05))
    got = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(24):
        want = logits[row : row + 1]
        if top_k[row] > 0:
            want = TopKLogitsWarper(int(top_k[row]))(None, want)
        if top_p[row] < 1.0:
            want = TopPLogitsWarper(float(top_p[row]))(None, want)
        # (the kept logits as a sorted list: where tied logits straddle the nucleus's edge, which of them stays is
        # the sort's choice, in HF's code as in nanoref's)
        kept, wanted = (x[torch.isfinite(x)].sort().values for x in (got[row], want[0]))
        assert torch.equal(kept, wanted), f"seed {seed}, row {row}"


def test_a_top_p_that_treats_one_as_a_threshold_fails_on_a_long_tail():
    with pytest.raises(ExerciseFailure, match="top_k=0, top_p=1.0, 1024 tokens.*top_p=1.0 means off") as failure:
        check_apply_top_k_top_p(top_p_without_off, engine=False)
    assert_readable_failure(failure.value)


def test_seeded_check_catches_a_masking_that_only_differs_inside_the_engine():
    # right on the check's own rows, wrong in the engine: temperature-scaled logits get masked with k doubled
    def k_doubled(logits, top_k, top_p):
        return apply_top_k_top_p(logits, top_k * 2, top_p)

    with pytest.raises(ExerciseFailure, match="seeded request"):
        from nanoref.exercises import check_seeded_sampling

        check_seeded_sampling({"apply_top_k_top_p": k_doubled})


def test_checks_leave_no_model_folder_in_the_temp_dir(tmp_path):
    script = (
        "from nanoref.exercises import check_silu_and_mul, tiny_model, tiny_moe_model\n"
        "from nanoref.layers.activation import silu_and_mul\n"
        "check_silu_and_mul(silu_and_mul)\n"  # builds the tiny model, runs the engine and HF on it
        "assert tiny_model().is_dir() and tiny_moe_model().is_dir()\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # (torch may leave caches of its own there, e.g. torchinductor_<user>: not ours to remove)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("nanoref")] == []


def masked_with(value):
    # the right tokens kept, the others set to a finite stand-in for -inf
    def masking(logits, top_k, top_p):
        out = apply_top_k_top_p(logits, top_k, torch.where(top_p < 1.0, top_p, 2.0))
        return out.masked_fill(out == float("-inf"), value)

    return masking


@pytest.mark.parametrize("value", [-1e9, torch.finfo(torch.float32).min])
def test_a_finite_mask_value_is_named_not_taken_for_kept_tokens(value):
    # isfinite counts a -1e9 as kept: the message said "you keep 50 tokens, expected 5" and quoted the top-k rule
    with pytest.raises(ExerciseFailure, match="the right tokens are kept, but the masked ones hold .*-inf") as failure:
        check_apply_top_k_top_p(masked_with(value), engine=False)
    assert "you keep" not in str(failure.value)
    assert_readable_failure(failure.value)


def top_p_without_the_max_subtracted(logits, top_k, top_p):
    # right, but the probabilities as exp(logit) / sum: at a low temperature exp overflows float32 to inf, inf / inf
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = top_k_cut(sorted_logits, top_k)
    exps = sorted_logits.exp()
    probs = exps / exps.sum(dim=-1, keepdim=True)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


@pytest.mark.parametrize("seed", range(4))
def test_a_top_p_whose_exp_overflows_at_a_low_temperature_fails_on_every_draw(seed):
    # the random rows' logits stay below 88.7, where exp is finite: only the low-temperature row overflows
    torch.manual_seed(seed)
    with pytest.raises(
        ExerciseFailure, match="(?s)top_p=0.9.*exp\\(150\\) overflows float32.*subtract each row's largest"
    ) as failure:
        check_apply_top_k_top_p(top_p_without_the_max_subtracted, engine=False)
    assert_readable_failure(failure.value)


def top_k_by_torch_topk(logits, top_k, top_p, *, clamp=False):
    # torch.topk row by row: k past the vocabulary raises, unless clamped; and k = 0 keeps nothing
    out = torch.full_like(logits, float("-inf"))
    for row in range(logits.shape[0]):
        k = min(int(top_k[row]), logits.shape[1]) if clamp else int(top_k[row])
        values, ids = logits[row].topk(k)
        out[row, ids] = values
    return apply_top_k_top_p(out, torch.zeros_like(top_k), top_p)


def top_k_left_in_rank_order(logits, top_k, top_p):  # the sorted row masked, never scattered back
    return apply_top_k_top_p(logits.sort(dim=-1, descending=True).values, top_k, top_p)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (top_k_by_torch_topk, "raised RuntimeError.*top_k at or past the vocabulary size keeps every token.*clamp k"),
        (lambda *a: top_k_by_torch_topk(*a, clamp=True), "top_k=0, top_p=0.7.*top_k=0 means off: it keeps every token"),
        (top_k_left_in_rank_order, "your mask is in rank order.*scatter it back to vocabulary order"),
    ],
    ids=["k past the vocabulary", "k = 0 keeps none", "rank order"],
)
def test_a_top_k_mistake_is_named(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_apply_top_k_top_p(wrong, engine=False)
    assert_readable_failure(failure.value)
