"""Small helpers the exercise checks share: comparing a learner's tensor with the reference, in words."""

from __future__ import annotations

import torch

from nanoref.exercises.common import ExerciseFailure


def expect_tensor(got: object, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`got` must be a tensor of this shape and dtype; otherwise say which of the three is off."""
    if not isinstance(got, torch.Tensor):
        raise ExerciseFailure(f"{what} should be a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        raise ExerciseFailure(f"{what} has shape {tuple(got.shape)}, expected {tuple(shape)}")
    if got.dtype != dtype:
        raise ExerciseFailure(f"{what} has dtype {got.dtype}, expected {dtype} (the input's dtype)")
    refuse_nan(got, what)
    return got


def refuse_nan(got: torch.Tensor, what: str) -> None:
    """No answer of these exercises holds NaN: name how many and the first, before any comparison (which would only
    see values that differ, and NaN compares unequal to everything)."""
    if not got.is_floating_point():
        return
    nan = got.isnan()
    if nan.any():
        first = tuple(int(i) for i in nan.nonzero()[0])
        raise ExerciseFailure(
            f"{what} holds NaN in {int(nan.sum())} of {nan.numel()} entries (the first at index {first}): NaN comes "
            "from 0/0, inf - inf, inf * 0 or the square root of a negative number, or from an uninitialised tensor "
            "(torch.empty)"
        )


def worst_element(got: torch.Tensor, want: torch.Tensor) -> tuple[int, ...]:
    """Index of the largest |got - want|; a NaN or inf difference counts as the largest."""
    error = (got.double() - want.double()).abs().nan_to_num(nan=torch.inf)
    return tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))


def first_bad_row(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> int | None:
    """Index along the first axis of the first row where got and want differ beyond tolerance, else None."""
    g, w = got.double(), want.double()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol)  # NaN vs a number counts as bad
    bad |= g.isnan() & ~w.isnan()
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()
    return int(rows[0]) if rows.numel() else None


def describe_row(got: torch.Tensor, want: torch.Tensor, row: int, count: int = 4) -> str:
    """'[0.12, -1.3, ...] where the reference has [0.12, -1.1, ...]' for row `row`."""

    def head(t: torch.Tensor) -> str:
        values = t[row].reshape(-1)[:count].double().tolist()
        return "[" + ", ".join(f"{v:.4g}" for v in values) + ", ...]"

    return f"{head(got)} where the reference has {head(want)}"
