"""Notebook 02's exercise checks: nanoref's own functions pass; plausible wrong answers fail with a useful message."""

from __future__ import annotations

import pytest
import torch

from nanoref.exercises import ExerciseFailure, check_add_rms_norm, check_rms_norm
from nanoref.layers.layernorm import add_rms_norm, rms_norm

from .helpers import assert_readable_failure


def test_nanorefs_own_functions_pass_with_the_engine():
    check_rms_norm(rms_norm)
    check_add_rms_norm(add_rms_norm)


def no_upcast(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def forgot_weight(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def wrong_axis(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(dim=0, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (no_upcast, "float16, |x| ~ 300.*inf, NaN or only zeros.*float32"),
        (forgot_weight, "RMS .*multiply by the weight"),
        (wrong_axis, "RMS .*expected 1"),
        (lambda x, weight, eps: rms_norm(x, weight, eps).float(), "dtype torch.float32, expected torch.float16"),
    ],
)
def test_wrong_rms_norm_fails_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_rms_norm(wrong, engine=False)
    assert_readable_failure(failure.value)


def without_eps(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True))).to(x.dtype)


def eps_outside_the_sqrt(x, weight, eps):
    xf = x.float()
    return weight * (xf / (xf.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def fixed_eps(x, weight, eps):
    return rms_norm(x, weight, 1e-6)


def normalised_in_place(x, weight, eps):
    xf = x.float()  # x itself when x is float32
    xf *= torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (without_eps, "^eps is missing"),
        (eps_outside_the_sqrt, "^eps belongs inside the square root"),
        (fixed_eps, "^use the eps passed in \\(here 0.0001\\), not a fixed 1e-06"),
        (normalised_in_place, "^float32: your rms_norm changed x in place"),
    ],
)
def test_an_rms_norm_that_mishandles_eps_or_its_input_fails_on_every_seed(wrong, message):
    # with eps=1e-6 on unit-scale rows these differ from nanoref's by less than the tolerance, and in the engine
    # too: the eps case (rows whose mean square is about eps) and the input comparison catch them
    for seed in (0, 3, 7):
        with pytest.raises(ExerciseFailure, match=message) as failure:
            check_rms_norm(wrong, seed=seed, engine=False)
        assert_readable_failure(failure.value)


def test_an_add_rms_norm_without_eps_fails_naming_it():
    def without_eps_fused(x, residual, weight, eps):
        summed = x.float() + residual.float()
        normed = summed * torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True))
        return weight * normed.to(x.dtype), summed.to(x.dtype)

    with pytest.raises(ExerciseFailure, match="^eps is missing") as failure:
        check_add_rms_norm(without_eps_fused, engine=False)
    assert_readable_failure(failure.value)


def swapped(x, residual, weight, eps):
    normed, new_residual = add_rms_norm(x, residual, weight, eps)
    return new_residual, normed


def residual_not_added(x, residual, weight, eps):
    normed, _ = add_rms_norm(x, residual, weight, eps)
    return normed, residual


def norm_of_x_only(x, residual, weight, eps):
    return rms_norm(x, weight, eps), x + residual


def in_place(x, residual, weight, eps):
    residual += x
    return rms_norm(residual, weight, eps), residual


@pytest.mark.parametrize(
    "wrong, message",
    [
        (swapped, "wrong order"),
        (residual_not_added, "row 0 of the new residual.*x \\+ residual"),
        (norm_of_x_only, "row 0 of normed.*rms_norm\\(x \\+ residual\\)"),
        (in_place, "in place"),
        (lambda x, residual, weight, eps: rms_norm(x + residual, weight, eps), "tuple"),
    ],
)
def test_wrong_add_rms_norm_fails_with_a_message(wrong, message):
    with pytest.raises(ExerciseFailure, match="(?s)" + message) as failure:
        check_add_rms_norm(wrong, engine=False)
    assert_readable_failure(failure.value)


def weight_in_float32(x, weight, eps):
    # normalised in float32, but the weight multiplied before the cast back: one rounding where nanoref has two
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def add_in_input_dtype(x, residual, weight, eps):
    # the sum rounded to bf16/fp16 before it is normalised
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


@pytest.mark.parametrize(
    "check, wrong, rule",
    [
        (
            check_rms_norm,
            weight_in_float32,
            "RMSNorm must multiply by the weight after casting back to the input dtype",
        ),
        (check_add_rms_norm, add_in_input_dtype, "add_rms_norm must add x \\+ residual in float32"),
    ],
)
def test_a_16_bit_norm_that_breaks_the_precision_rule_fails_naming_it(check, wrong, rule):
    with pytest.raises(ExerciseFailure, match=rule) as failure:
        check(wrong, engine=False)
    assert_readable_failure(failure.value)


def test_nanorefs_own_norms_pass_the_rounding_checks_on_other_draws():
    for seed in range(5):
        check_rms_norm(rms_norm, seed=seed, engine=False)
        check_add_rms_norm(add_rms_norm, seed=seed, engine=False)


def test_a_long_first_line_breaks_after_its_last_clause_that_fits():
    message = "case: " + "x" * 150 + ". the rule comes next, " + "y" * 100 + "\nvalues"
    lines = str(ExerciseFailure(message)).splitlines()
    assert lines == ["case: " + "x" * 150 + ".", "the rule comes next, " + "y" * 100, "values"]
    assert str(ExerciseFailure("short: as it is\nvalues")) == "short: as it is\nvalues"


def test_an_add_rms_norm_on_the_variance_is_not_told_to_upcast_float32_inputs():
    # it was told "Compute the statistic in float32 (x.float())" on float32 inputs, where it already did
    def variance_fused(x, residual, weight, eps):
        summed = x.float() + residual.float()
        normed = summed * torch.rsqrt(summed.var(dim=-1, keepdim=True, unbiased=False) + eps)  # LayerNorm's statistic
        return weight * normed.to(x.dtype), summed.to(x.dtype)

    with pytest.raises(ExerciseFailure, match=r"(?s)^float32 inputs: row 0 of normed.*not the variance") as failure:
        check_add_rms_norm(variance_fused, engine=False)
    assert "x.float()" not in str(failure.value)
    assert_readable_failure(failure.value)


def over_the_variance(x, weight, eps):  # x / sqrt(var(x) + eps): the statistic subtracts the mean
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.var(dim=-1, unbiased=False, keepdim=True) + eps)).to(x.dtype)


def layer_norm_without_bias(x, weight, eps):  # (x - mean) / sqrt(var + eps): LayerNorm's formula
    xf = x.float()
    centred = xf - xf.mean(dim=-1, keepdim=True)
    return weight * (centred * torch.rsqrt(xf.var(dim=-1, unbiased=False, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("seed", [0, 7, 1, 2])
@pytest.mark.parametrize("wrong", [over_the_variance, layer_norm_without_bias])
def test_an_rms_norm_over_the_variance_is_told_it_is_the_root_mean_square(wrong, seed):
    with pytest.raises(ExerciseFailure, match=r"normalised by the standard deviation .*root mean square") as failure:
        check_rms_norm(wrong, seed=seed, engine=False)
    assert_readable_failure(failure.value)
