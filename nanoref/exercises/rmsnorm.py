"""Checks for notebook 02's exercises: `rms_norm` and the fused `add_rms_norm`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoref.exercises.common import ExerciseFailure, call_learner, check_generation
from nanoref.exercises.tensors import check_rounding, describe_row, expect_tensor, first_bad_row, ulps_apart
from nanoref.layers.layernorm import add_rms_norm, rms_norm

# (atol, rtol) per dtype: one rounding of the output, twice over
_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
_EPS = 1e-6


def _inputs(generator: torch.Generator, rows: int, hidden: int, scale: float, dtype: torch.dtype):
    x = scale * torch.randn(rows, hidden, generator=generator)  # (T, hidden)
    weight = 1 + 0.1 * torch.randn(hidden, generator=generator)  # (hidden,): a learned weight, not ones
    return x.to(dtype), weight.to(dtype)


def _compare(got: torch.Tensor, want: torch.Tensor, what: str, case: str, hint: str) -> None:
    atol, rtol = _TOLERANCE[want.dtype]
    row = first_bad_row(got, want, atol, rtol)
    if row is not None:
        raise ExerciseFailure(f"{case}: row {row} of {what} is {describe_row(got, want, row)}. {hint}")


def _upcast_hint(got: torch.Tensor) -> str:
    if got.isinf().any() or got.isnan().any() or (got == 0).all():
        return (
            "Your output holds inf, NaN or only zeros: in float16, squares of |x| > 256 overflow. Compute the "
            "mean of squares in float32 (x.float()) and cast back to the input dtype before the weight multiply."
        )
    return "Compute the statistic in float32 (x.float()), cast back to x's dtype, then multiply by the weight."


# the precision rules nanoref states and implements (layers/layernorm.py), each in one sentence
WEIGHT_RULE = "RMSNorm must multiply by the weight after casting back to the input dtype: weight * normed.to(x.dtype)"
NORM_RULE = "RMSNorm must normalise in float32, cast back to the input dtype, then multiply by the weight"
ADD_RULE = "add_rms_norm must add x + residual in float32 and normalise that float32 sum, not the sum in x's dtype"


def _weight_in_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The usual slip: the weight multiply done in float32 too, one rounding instead of two."""
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def _rule_broken(got: torch.Tensor, want: torch.Tensor, suspects: dict[str, torch.Tensor], default: str) -> str:
    """The rule of the suspect `got` rounds closest to, when it is closer to it than to nanoref's; else `default`."""
    distance = {rule: int((ulps_apart(got, result) > 0).sum()) for rule, result in suspects.items()}
    rule = min(distance, key=distance.get)
    return rule if distance[rule] < int((ulps_apart(got, want) > 0).sum()) else default


def _check_norm_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, want: torch.Tensor, case: str):
    suspects = {WEIGHT_RULE: _weight_in_float32(x, weight, _EPS)}
    check_rounding(got, want, case, _rule_broken(got, want, suspects, NORM_RULE))


# eps passed in by the eps case, on rows whose mean square is about as large: there eps moves every value by tens of
# percent, where with the usual 1e-6 on unit-scale rows it moves them by less than the tolerance (an answer that
# drops eps, adds it outside the square root or hard-codes 1e-6 passes those)
_SMALL_EPS = 1e-4


def _eps_inputs(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x (6, 96) with rows of RMS 0.003 to 0.04 (mean squares about 1e-5 to 2e-3, around _SMALL_EPS), and a
    weight."""
    sizes = torch.tensor([0.3, 0.5, 1.0, 1.0, 2.0, 4.0])[:, None]  # (6, 1): eps counts most in the smallest rows
    x = 1e-2 * sizes * torch.randn(6, 96, generator=generator)  # (6, 96)
    weight = 1 + 0.1 * torch.randn(96, generator=generator)  # (96,)
    return x, weight


def _eps_hint(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> str:
    """What the learner did with eps, from which slip `got` matches (x: the float32 rows that were normalised)."""
    mean_square = x.pow(2).mean(dim=-1, keepdim=True)  # (T, 1)
    slips = {
        "eps is missing: RMSNorm divides by sqrt(mean(x**2) + eps), and eps keeps a row of (near) zeros finite":
        x * torch.rsqrt(mean_square) * weight,
        "eps belongs inside the square root: x / sqrt(mean(x**2) + eps), not x / (sqrt(mean(x**2)) + eps)":
        x / (mean_square.sqrt() + _SMALL_EPS) * weight,
    }  # fmt: skip
    for fixed in (1e-6, 1e-5):
        slips[f"use the eps passed in (here {_SMALL_EPS:g}), not a fixed {fixed:g}"] = (
            x * torch.rsqrt(mean_square + fixed) * weight
        )
    for rule, result in slips.items():
        if torch.allclose(got, result, atol=1e-6, rtol=1e-4):
            return rule
    return f"divide by sqrt(mean(x**2) over the last axis + eps), with the eps passed in (here {_SMALL_EPS:g})"


def _check_eps(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, what: str, case: str):
    """The eps case: the rule broken first (the first line), then the row that shows it."""
    row = first_bad_row(got, want, *_TOLERANCE[want.dtype])
    if row is not None:
        raise ExerciseFailure(
            f"{_eps_hint(got, x, weight)}\n{case}: row {row} of {what} is {describe_row(got, want, row)}"
        )


def check_rms_norm(fn: Callable, *, seed: int = 0, engine: bool = True) -> None:
    """`fn(x, weight, eps) -> (..., hidden)` against nanoref's `rms_norm`, then inside the engine."""
    generator = torch.Generator().manual_seed(seed)
    x, weight = _inputs(generator, 6, 96, 1.0, torch.float32)
    x_before = x.clone()
    got = expect_tensor(
        call_learner(fn, "rms_norm", x, weight, _EPS), "rms_norm(x, weight, eps) on float32 x (6, 96)", x.shape, x.dtype
    )
    if not torch.equal(x, x_before):
        # x.float() of a float32 x is x itself, so `xf = x.float(); xf *= ...` writes into the caller's tensor: in
        # the engine that is the residual stream, which the layer adds back afterwards
        raise ExerciseFailure(
            "float32: your rms_norm changed x in place; return a new tensor (x.float() of a float32 x is x itself, "
            "so `xf *= ...` or `xf.mul_(...)` writes into the caller's x)"
        )
    variance = x.var(dim=-1, unbiased=False, keepdim=True)  # (T, 1): LayerNorm's statistic
    centred = x - x.mean(dim=-1, keepdim=True)  # (T, hidden)
    if any(torch.allclose(got, top * torch.rsqrt(variance + _EPS) * weight, atol=1e-5) for top in (x, centred)):
        raise ExerciseFailure(
            "float32: you normalised by the standard deviation (x.var() or x.std(), which subtract the mean "
            "first): RMSNorm divides by the root mean square, sqrt(mean(x**2) + eps), and subtracts nothing"
        )
    unit = (got.double() / weight.double()).pow(2).mean(-1).sqrt()  # (T,): each row's RMS before the weight
    if not torch.allclose(unit, torch.ones_like(unit), atol=1e-3):
        row = int((~torch.isclose(unit, torch.ones_like(unit), atol=1e-3)).nonzero()[0])
        raise ExerciseFailure(
            f"float32: after dividing out the weight, row {row} of your output has RMS {unit[row].item():.4f}, "
            "expected 1: divide x by sqrt(mean(x**2) over the last axis + eps), and multiply by the weight once"
        )
    _compare(got, rms_norm(x, weight, _EPS), "rms_norm(x)", "float32", "Mean over the last axis; eps inside the sqrt.")
    x3 = torch.randn(2, 3, 40, generator=generator)  # (B, T, hidden): any leading axes
    w3 = 1 + 0.1 * torch.randn(40, generator=generator)
    got = expect_tensor(
        call_learner(fn, "rms_norm", x3, w3, _EPS), "rms_norm on a (2, 3, 40) input", x3.shape, x3.dtype
    )
    hint = "Normalise over the last axis only (dim=-1, keepdim=True), whatever the leading axes."
    _compare(got.flatten(0, 1), rms_norm(x3, w3, _EPS).flatten(0, 1), "the (6, 40) rows", "a 3-D input", hint)
    xe, we = _eps_inputs(generator)
    case = f"float32 rows of RMS 0.003 to 0.04 with eps={_SMALL_EPS:g}"
    got = expect_tensor(call_learner(fn, "rms_norm", xe, we, _SMALL_EPS, case=case), case, xe.shape, xe.dtype)
    _check_eps(got, rms_norm(xe, we, _SMALL_EPS), xe, we, "rms_norm(x)", case)
    x16, w16 = _inputs(generator, 4, 96, 300.0, torch.float16)
    got = expect_tensor(
        call_learner(fn, "rms_norm", x16, w16, _EPS), "rms_norm on float16 x of magnitude ~300", x16.shape, x16.dtype
    )
    _compare(got, rms_norm(x16, w16, _EPS), "rms_norm(x)", "float16, |x| ~ 300", _upcast_hint(got))
    _check_norm_rounding(got, x16, w16, rms_norm(x16, w16, _EPS), "float16, |x| ~ 300")
    xb, wb = _inputs(generator, 8, 96, 3.0, torch.bfloat16)
    got = expect_tensor(call_learner(fn, "rms_norm", xb, wb, _EPS), "rms_norm on bfloat16 x", xb.shape, xb.dtype)
    _compare(got, rms_norm(xb, wb, _EPS), "rms_norm(x)", "bfloat16", _upcast_hint(got))
    _check_norm_rounding(got, xb, wb, rms_norm(xb, wb, _EPS), "bfloat16")
    if engine:
        check_generation({"rms_norm": fn})


def check_add_rms_norm(fn: Callable, *, seed: int = 0, engine: bool = True) -> None:
    """`fn(x, residual, weight, eps) -> (normed, new residual)` against nanoref's, then inside the engine."""
    generator = torch.Generator().manual_seed(seed)
    for dtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 3.0), (torch.float16, 200.0)):
        case = f"{str(dtype).removeprefix('torch.')} inputs"
        x, weight = _inputs(generator, 6, 96, scale, dtype)
        residual = (scale * torch.randn(6, 96, generator=generator)).to(dtype)
        x_before, residual_before = x.clone(), residual.clone()
        result = call_learner(fn, "add_rms_norm", x, residual, weight, _EPS, case=case)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ExerciseFailure(
                f"add_rms_norm should return a tuple (normed, new_residual), got {type(result).__name__}"
            )
        if not (torch.equal(x, x_before) and torch.equal(residual, residual_before)):
            raise ExerciseFailure(f"{case}: your function changed x or residual in place; return new tensors instead")
        normed = expect_tensor(result[0], f"{case}: the first result (normed)", x.shape, dtype)
        new_residual = expect_tensor(result[1], f"{case}: the second result (new residual)", x.shape, dtype)
        want_normed, want_residual = add_rms_norm(x, residual, weight, _EPS)
        if torch.allclose(normed.double(), want_residual.double()) and not torch.allclose(
            new_residual.double(), want_residual.double()
        ):
            raise ExerciseFailure(f"{case}: the results come in the wrong order: return (normed, new_residual)")
        hint = "The new residual is x + residual (add in float32, hand it back in the input dtype)."
        _compare(new_residual, want_residual, "the new residual", case, hint)
        hint = "normed is rms_norm(x + residual) of the float32 sum; " + (
            _upcast_hint(normed)
            if dtype != torch.float32  # float32 inputs: no upcast to get wrong, so the formula is
            else "divide it by sqrt(mean(sum**2) over the last axis + eps), a mean of squares (not the variance, "
            "which subtracts the mean first), and multiply by the weight once"
        )
        _compare(normed, want_normed, "normed", case, hint)
        summed = (x + residual).to(dtype)  # (T, hidden): the sum rounded to the input dtype
        suspects = {
            ADD_RULE: rms_norm(summed, weight, _EPS),
            WEIGHT_RULE: _weight_in_float32(x.float() + residual.float(), weight, _EPS).to(dtype),
        }
        check_rounding(normed, want_normed, f"{case}, normed", _rule_broken(normed, want_normed, suspects, NORM_RULE))
    x, weight = _eps_inputs(generator)
    residual = torch.randn(x.shape, generator=generator) * x.std()  # the sum stays as small as x
    case = f"float32 rows of RMS about 0.003 to 0.06 with eps={_SMALL_EPS:g}"
    result = call_learner(fn, "add_rms_norm", x, residual, weight, _SMALL_EPS, case=case)
    normed = expect_tensor(result[0], f"{case}: the first result (normed)", x.shape, x.dtype)
    _check_eps(normed, add_rms_norm(x, residual, weight, _SMALL_EPS)[0], x + residual, weight, "normed", case)
    if engine:
        check_generation({"add_rms_norm": fn})
