"""Checks for notebook 07's exercises: RoPE, SwiGLU's gate, and top-k / top-p masking.

Each check tests the learner's function alone on fresh random inputs against nanoref's own version, with a
message that says what differs and what to look at, then runs the real engine with it in place.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    check_generation,
    describe,
    generate_with,
    input_generator,
    random_prompts,
    tiny_model,
)
from nanoref.exercises.tensors import check_rounding, expect_tensor, worst_element
from nanoref.layers.activation import silu_and_mul
from nanoref.layers.rotary import RotaryEmbedding, apply_rotary
from nanoref.layers.sampler import apply_top_k_top_p

# -- RoPE -----------------------------------------------------------------------------------------
ROTARY_RULE = "RoPE must rotate in float32 (x.float() times the float32 cos and sin) and cast back to x's dtype once"


def _rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # the GPT-J layout (pairs 2i, 2i+1): a common mix-up with the neox halves that Qwen3 uses
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]  # (N, H, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def _rotary_shape_hint(x: torch.Tensor, cos: torch.Tensor) -> Callable[[Exception], str | None]:
    """The fix for the usual shape errors: (N, H, D/2) halves times (N, D/2) cos/sin, which cannot broadcast; or x
    split along its first axis (chunk's default), so that the halves have D values where cos has D/2."""

    def hint(error: Exception) -> str | None:
        if not (isinstance(error, RuntimeError) and "must match the size of tensor" in str(error)):
            return None
        head_dim = x.shape[-1]
        if re.search(rf"\({head_dim}\) must match the size of tensor b \({head_dim // 2}\)", str(error)):
            return (
                f"a half of x has {head_dim} values where cos has {head_dim // 2}: split the last axis, "
                "x.chunk(2, dim=-1) (chunk's default, dim=0, splits the tokens)"
            )
        return f"cos is (N, D/2) = {tuple(cos.shape)}, x {tuple(x.shape)}: add a head axis, cos[:, None, :]"

    return hint


def check_apply_rotary(fn: Callable, *, engine: bool = True) -> None:
    """`fn(x, cos, sin)` against nanoref's `apply_rotary`, then greedy generation with it against HF."""
    generator = input_generator()
    num_tokens, num_heads, head_dim = 11, 3, 16
    rope = RotaryEmbedding(head_dim, max_position=64, base=10_000.0)
    positions = torch.randint(0, 64, (num_tokens,), generator=generator)  # (N,): not 0..N-1 on purpose
    cos, sin = rope.cos_cache[positions], rope.sin_cache[positions]  # (N, D/2) each
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)  # (N, H, D)
        x_before = x.clone()
        want = apply_rotary(x, cos, sin)
        got = call_learner(fn, "apply_rotary", x, cos, sin, case=f"{dtype}", hint=_rotary_shape_hint(x, cos))
        expect_tensor(got, f"apply_rotary on a {dtype} input", want.shape, want.dtype)
        if not torch.equal(x, x_before):
            raise ExerciseFailure("apply_rotary changed its input x in place; return a new tensor instead")
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        if torch.allclose(got.float(), want.float(), **tolerance):
            check_rounding(got, want, f"apply_rotary on {dtype} x", ROTARY_RULE)
            continue
        if torch.allclose(got.float(), _rotary_interleaved(x, cos, sin).float(), **tolerance):
            raise ExerciseFailure(
                "apply_rotary rotates adjacent pairs (x[2i], x[2i+1]); Qwen3 uses the neox layout, which pairs "
                "x[i] with x[i + D/2]: split the last axis into two halves"
            )
        if torch.allclose(got.float(), apply_rotary(x, cos, -sin).float(), **tolerance):
            raise ExerciseFailure("apply_rotary rotates by -angle: check the signs (x1*cos - x2*sin, x2*cos + x1*sin)")
        x1, x2 = x.float().chunk(2, dim=-1)  # (N, H, D/2) each
        c, s = cos[:, None, :], sin[:, None, :]
        for first, second in ((x1 * c - x2 * s, x2 * c - x1 * s), (x1 * c + x2 * s, x2 * c + x1 * s)):
            if torch.allclose(got.float(), torch.cat((first, second), dim=-1).to(dtype).float(), **tolerance):
                raise ExerciseFailure(
                    "apply_rotary has one sign wrong: the first half is x1*cos - x2*sin, the second x2*cos + x1*sin "
                    "(a rotation: the sin terms have opposite signs)"
                )
        token, head, _ = worst_element(got, want)
        error = (got[token, head].double() - want[token, head].double()).abs().max().item()
        raise ExerciseFailure(
            f"apply_rotary({dtype}) differs from nanoref's at token {token}, head {head} (position "
            f"{int(positions[token])}): max error {error:.3g}. The result is [x1*cos - x2*sin, x2*cos + x1*sin], "
            "x1 and x2 the halves of the last axis, cos and sin (N, D/2) given a head axis (cos[:, None, :])"
        )
    if engine:
        check_generation({"apply_rotary": fn})


# -- SwiGLU -------------------------------------------------------------------------------------
def _silu_shape_hint(error: Exception) -> str | None:
    """The fix for x split along its rows (chunk's default axis) where gate and up are the halves of each row."""
    if isinstance(error, RuntimeError) and "must match the size of tensor" in str(error):
        return "gate and up are the two halves of each row: x.chunk(2, dim=-1) (chunk's default, dim=0, splits rows)"
    return None


def check_silu_and_mul(fn: Callable, *, engine: bool = True) -> None:
    """`fn(x)` with x = [gate | up] against nanoref's `silu_and_mul`, then generation with it against HF."""
    generator = input_generator()
    intermediate = 24
    for dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(7, 2 * intermediate, generator=generator)).to(dtype)  # (N, 2 I)
        want = silu_and_mul(x)
        got = call_learner(fn, "silu_and_mul", x, case=f"{dtype}", hint=_silu_shape_hint)
        expect_tensor(got, f"silu_and_mul on a {dtype} input of shape {tuple(x.shape)}", want.shape, want.dtype)
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        if torch.allclose(got.float(), want.float(), **tolerance):
            continue
        gate, up = x.chunk(2, dim=-1)
        if torch.allclose(got.float(), (F.silu(up) * gate).float(), **tolerance):
            raise ExerciseFailure("silu_and_mul applies silu to the second half; the first half of x is the gate")
        if torch.allclose(got.float(), (torch.sigmoid(gate) * up).float(), **tolerance):
            raise ExerciseFailure("silu_and_mul uses sigmoid(gate); silu(gate) is gate * sigmoid(gate)")
        row, col = worst_element(got, want)
        raise ExerciseFailure(
            f"silu_and_mul({dtype}) differs from silu(gate) * up at row {row}, column {col}: got "
            f"{got[row, col].item():.4g}, expected {want[row, col].item():.4g}"
        )
    if engine:
        check_generation({"silu_and_mul": fn})


# -- top-k / top-p --------------------------------------------------------------------------------
TOP_P_RULE = "keep a token while the top_k survivors ranked above it have probability < top_p, renormalised over them"
TOP_P_OFF = "top_p=1.0 means off: keep every token; a float32 cumsum can reach 1.0 before the last token"
TOP_K_TIES = (
    "a token whose logit equals the k-th largest stays: top_k keeps every logit >= the k-th largest (as HF's and "
    "vLLM's do), so a tie can keep more than k tokens; compare values, not ranks"
)


def _long_tail(generator: torch.Generator, vocab: int = 1024) -> torch.Tensor:
    """(V,) float32 logits of a language model's kind (a few likely tokens, a long tail) on which the float32
    cumsum of the sorted probabilities reaches 1.0 while at least 5% of the tokens are still to come (with logits
    this spread, about half of them are: the first draw nearly always serves)."""
    for _ in range(100):
        logits = 6 * torch.randn(vocab, generator=generator)  # (V,)
        mass = logits.sort(descending=True).values.softmax(-1).cumsum(-1)  # (V,): best first
        if int((mass >= 1.0).sum()) >= vocab // 20:
            break
    return logits


TOP_P_ON_WHOLE_ROW = (
    "top_p is measured over the top_k survivors, renormalised over them (each cut after the other, as HF's warpers "
    "and vLLM's sampler make them), not on the row's whole distribution"
)


def _top_p_on_whole_row(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """(V,) bool: the tokens kept by the slip of measuring top-p on the whole distribution, beside top-k, instead of
    on the top-k survivors renormalised."""
    vocab = row.shape[0]
    ranked, order = row.sort(descending=True)  # (V,)
    probs = ranked.softmax(-1)  # (V,): the whole distribution
    keep = (ranked >= ranked[min(k if k > 0 else vocab, vocab) - 1]) & ((probs.cumsum(-1) - probs < p) | (p >= 1.0))
    return torch.zeros(vocab, dtype=torch.bool).scatter(0, order, keep)


def _interacting_row(generator: torch.Generator, vocab: int = 50) -> torch.Tensor:
    """(1, V) logits on which top_k=2, top_p=0.5 keep one token, but top-p on the whole distribution keeps two:
    probabilities 0.30 and 0.25 for two random tokens, 0.45 spread over the rest. The second token's better ranked
    mass is 0.30 / 0.55 > 0.5 of the two survivors renormalised, but 0.30 < 0.5 of the whole distribution, so the
    slip fails this row on every run."""
    probs = torch.full((vocab,), 0.45 / (vocab - 2))  # (V,)
    best, second = torch.randperm(vocab, generator=generator)[:2].tolist()
    probs[best], probs[second] = 0.30, 0.25
    return probs.log()[None, :]


def _tied_row(generator: torch.Generator, vocab: int = 50) -> torch.Tensor:
    """(1, V) random logits whose 2nd and 3rd largest are equal: top_k=2 keeps three tokens (random logits never tie,
    so only this row catches top-k by rank on every run)."""
    logits = 2 * torch.randn(vocab, generator=generator)  # (V,)
    order = logits.argsort(descending=True)
    logits[order[2]] = logits[order[1]]
    return logits[None, :]


# float32 logits whose exp rounds to 1, 0.625, 0.25 and 0.125 exactly (each within 0.1 of a float32 step of its
# true exp, so any accurate exp rounds it there): they sum to 2, so the float32 softmax is exactly 0.5, 0.3125,
# 0.125, 0.0625 and its cumsum exact, and the better-ranked mass of the third token is exactly 0.8125. The true exps
# of the last three are a little low (the last two more so): in float64 that mass is just above 0.8125 (by 3.6e-10),
# so a right cut drops that token in either precision
_EXACT_LOGITS = (0.0, -0.4700036346912384, -1.3862943649291992, -2.079441547393799)
EXACT_TOP_P = 0.8125


def _exact_boundary_row(generator: torch.Generator, vocab: int = 50) -> torch.Tensor:
    """(1, V) logits on which the better-ranked probability of one token is exactly top_p=0.8125, with no tie: the
    four tokens of _EXACT_LOGITS at random places, the rest far below (probability 0 in float32, distinct logits).
    A cut that keeps a token while that mass is <= top_p (not <) keeps three tokens where two belong."""
    logits = -150.0 - torch.randperm(vocab, generator=generator).float()  # (V,): exp underflows to 0
    places = torch.randperm(vocab, generator=generator)[: len(_EXACT_LOGITS)]
    logits[places] = torch.tensor(_EXACT_LOGITS)
    return logits[None, :]


# float32's exp overflows to inf above this (exp(88.73) > 3.4e38)
EXP_OVERFLOW = 88.72
OVERFLOW_RULE = (
    "exp({top:.0f}) overflows float32 to inf: subtract each row's largest logit before exp, as softmax does\n(logits "
    "divided by a low temperature get this large; exp is inf above 88.7, and inf / inf is NaN)"
)


def _low_temperature_row(generator: torch.Generator, vocab: int = 50) -> torch.Tensor:
    """(1, V) logits of a request at a low temperature (a model's logits of 20 to 30 divided by 0.2): the best 150,
    the second 149.5 (so top_p=0.9 keeps those two), the rest 10 or more below. exp of them overflows float32, so a
    probability computed as exp(logit) / sum without subtracting the row's max is NaN, on every run."""
    logits = 140.0 - 40 * torch.rand(vocab, generator=generator)  # (V,): 100 .. 140
    best, second = torch.randperm(vocab, generator=generator)[:2].tolist()
    logits[best], logits[second] = 150.0, 149.5
    return logits[None, :]


def _masking_hint(row: torch.Tensor, k: int, p: float, kept_got: torch.Tensor, kept_want: torch.Tensor) -> str:
    """The rule a row's wrong mask broke, in one line."""
    if p < 1.0 and float(row.max()) > EXP_OVERFLOW:  # (only the low-temperature row: the others stay below)
        return OVERFLOW_RULE.format(top=float(row.max()))
    if k <= 0 and not kept_got.any():
        return "top_k=0 means off: it keeps every token (top-p, if on, then cuts), not none"
    order = row.argsort(descending=True)  # (V,): token ids best first
    if int(kept_got.sum()) == int(kept_want.sum()) and torch.equal(kept_got, kept_want[order]):
        return (
            "your mask is in rank order (position i masks the i-th largest logit): scatter it back to vocabulary "
            "order, out.scatter(-1, order, sorted_logits), so that position t masks token t"
        )
    if 0 < k < row.shape[0] and p < 1.0 and torch.equal(kept_got, _top_p_on_whole_row(row, k, p)):
        return TOP_P_ON_WHOLE_ROW
    if 0 < k and int(kept_want.sum()) > k and int(kept_got.sum()) == k:
        return TOP_K_TIES
    ranked_got, ranked_want = kept_got[order], kept_want[order]  # (V,) each, in rank order
    last = int(ranked_want.nonzero().max())  # the rank of the lowest-ranked token to keep
    missing, extra = ranked_want & ~ranked_got, ranked_got & ~ranked_want  # (V,) each
    if p >= 1.0 and not extra.any() and (k <= 0 or k > last + 1):
        return TOP_P_OFF
    if p < 1.0 and not extra.any() and missing.nonzero().flatten().tolist() == [last] and (k <= 0 or k > last):
        return f"you drop the token that crosses top_p: {TOP_P_RULE}"
    if p < 1.0 and not missing.any() and extra.nonzero().flatten().tolist() == [last + 1] and (k <= 0 or k > last + 1):
        probs = row.sort(descending=True).values.softmax(-1)  # (V,)
        if float(probs[: last + 1].sum()) == p:
            return (
                "you keep the token whose better-ranked survivors' probability equals top_p exactly: top_p is then "
                "reached without it; keep a token while that probability is < top_p, not <="
            )
        return f"you keep one token past the nucleus: {TOP_P_RULE}"
    return (
        "keep a token if its logit is >= the k-th largest (top_k 0 = all) and the top_k survivors ranked above it "
        "have probability < top_p, renormalised over them"
    )


def _top_k_range_hint(logits: torch.Tensor, top_k: torch.Tensor) -> Callable[[Exception], str | None]:
    """The fix for torch.topk given a k past the vocabulary (a request's top_k may exceed it)."""

    def hint(error: Exception) -> str | None:
        if not (isinstance(error, RuntimeError) and "out of range" in str(error)):
            return None
        vocab = logits.shape[1]
        past = [(row, int(k)) for row, k in enumerate(top_k.tolist()) if k > vocab]
        where = f" (row {past[0][0]}: top_k={past[0][1]} for {vocab} tokens)" if past else ""
        return f"a top_k at or past the vocabulary size keeps every token{where}: clamp k to V before torch.topk"

    return hint


def _check_masking(fn: Callable, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """The learner's masking of `logits` (B, V), row by row, against nanoref's; the rows that switch both off come
    last, so a wrong nucleus is named by a row that uses one."""
    inputs = logits.clone()
    # nanoref's own masking as the reference; top_p 1.0 means off, so those rows are masked by top-k alone
    want = apply_top_k_top_p(logits, top_k, torch.where(top_p < 1.0, top_p, 2.0))
    got = call_learner(fn, "apply_top_k_top_p", logits, top_k, top_p, hint=_top_k_range_hint(logits, top_k))
    expect_tensor(got, f"apply_top_k_top_p on logits of shape {tuple(logits.shape)}", want.shape, want.dtype)
    if not torch.equal(logits, inputs):
        raise ExerciseFailure("apply_top_k_top_p changed the logits in place; return a new tensor instead")
    vocab = logits.shape[1]
    off = [(int(k) <= 0 or int(k) >= vocab) and float(p) >= 1.0 for k, p in zip(top_k, top_p)]  # keep everything
    for row in sorted(range(len(top_k)), key=lambda r: off[r]):
        kept_want, kept_got = torch.isfinite(want[row]), torch.isfinite(got[row])  # (V,)
        k, p = int(top_k[row]), float(top_p[row])
        setting = f"row {row} (top_k={k}, top_p={round(p, 4)}, {vocab} tokens)"
        unchanged = got[row] == logits[row]  # (V,): the logits left as they were
        if torch.equal(unchanged, kept_want) and not torch.equal(kept_got, kept_want):
            # the right tokens kept, the others set to a finite stand-in (-1e9, finfo.min) instead of -inf
            value = float(got[row][~kept_want & kept_got][0])
            raise ExerciseFailure(
                f"{setting}: the right tokens are kept, but the masked ones hold {value:.4g}: mask them with "
                "float('-inf'), the only value that gives probability 0 at every temperature"
            )
        if not torch.equal(kept_got, kept_want):
            extra = (kept_got & ~kept_want).nonzero().flatten().tolist()
            missing = (kept_want & ~kept_got).nonzero().flatten().tolist()
            raise ExerciseFailure(
                f"{setting}: you keep {int(kept_got.sum())} tokens, expected {int(kept_want.sum())}: "
                + _masking_hint(logits[row], k, p, kept_got, kept_want)
                + (f"\nkept but should be masked: token ids {extra[:5]}" if extra else "")
                + (f"\nmasked but should be kept: token ids {missing[:5]}" if missing else "")
            )
        if not torch.equal(got[row][kept_want], want[row][kept_want]):
            raise ExerciseFailure(f"{setting}: the kept logits changed value; leave them exactly as they were")
        if not bool((got[row][~kept_want] == float("-inf")).all()):
            raise ExerciseFailure(f"{setting}: masked tokens must be -inf (so softmax gives them probability 0)")


def check_apply_top_k_top_p(fn: Callable, *, engine: bool = True) -> None:
    """`fn(logits, top_k, top_p)` against nanoref's masking on random logits, then the engine: greedy generation
    still equals HF's, and seeded sampling with top-k / top-p gives exactly the tokens nanoref's own masking gives.
    """
    generator = input_generator()
    vocab = 50
    # one row per case: off, top-k only, top-p only, both, k = 1, k >= vocab, a tiny and a near-full nucleus
    top_k = torch.tensor([0, 5, 0, 10, 1, 80, 0, 3], dtype=torch.int64)
    top_p = torch.tensor([1.0, 1.0, 0.7, 0.5, 1.0, 1.0, 0.05, 0.99], dtype=torch.float32)
    logits = 2 * torch.randn(len(top_k), vocab, generator=generator)  # (B, V) float32
    _check_masking(fn, logits, top_k, top_p)
    # both cuts on, where top-p on the whole distribution keeps more tokens than on the top-k survivors: the random
    # rows catch that only on some draws (when the nucleus ends inside the top k), this row on every run
    _check_masking(fn, _interacting_row(generator), torch.tensor([2]), torch.tensor([0.5]))
    # the better-ranked mass exactly top_p, without ties: that token goes (< top_p, not <=)
    _check_masking(fn, _exact_boundary_row(generator), torch.tensor([0]), torch.tensor([EXACT_TOP_P]))
    # a tie with the k-th largest logit, which stays
    _check_masking(fn, _tied_row(generator), torch.tensor([2]), torch.tensor([1.0]))
    # a low temperature's large logits, whose exp overflows float32: the probabilities need the row's max subtracted
    _check_masking(fn, _low_temperature_row(generator), torch.tensor([0]), torch.tensor([0.9]))
    # off on a long tail whose float32 cumsum reaches 1.0 before its last tokens: 1.0 must mean off, not a threshold
    tail = _long_tail(generator)[None, :]  # (1, V)
    _check_masking(fn, tail, torch.tensor([0]), torch.tensor([1.0]))
    if engine:
        check_generation({"apply_top_k_top_p": fn})  # greedy requests never reach the masking: still HF's tokens
        check_seeded_sampling({"apply_top_k_top_p": fn})


def check_seeded_sampling(functions: dict[str, Callable], *, max_tokens: int = 8) -> list[list[int]]:
    """Seeded sampling with top-k / top-p: the engine with the learner's `functions` must draw exactly the tokens
    it draws with nanoref's own (the seed fixes the noise, so only the masking can change the outcome)."""
    from nanoref import LLM, SamplingParams

    model = tiny_model()
    prompts = random_prompts(seed=4321, lengths=[6, 19, 11], vocab=256)
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=1, max_tokens=max_tokens),
        SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_tokens=max_tokens),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.6, seed=3, max_tokens=max_tokens),
    ]
    llm = LLM(model, num_kvcache_blocks=64)
    expected = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    names = describe(functions)
    got = generate_with(llm, functions, prompts, params)
    for index, (mine, reference) in enumerate(zip(got, expected)):
        if mine != reference:
            position = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), min(len(mine), 8))
            raise ExerciseFailure(
                f"with {names} in the engine, seeded request {index} ({params[index]}) samples "
                f"{mine[position : position + 1]} at output position {position} where nanoref samples "
                f"{reference[position : position + 1]}"
            )
    return got
