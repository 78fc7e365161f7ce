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


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| counted in steps of a 16-bit float's grid (0: bit-identical; 1: adjacent values), elementwise.

    Both tensors are float16 or bfloat16 of the same dtype. Reading the bits in sign-magnitude order makes
    consecutive representable values consecutive integers (and +0 and -0 the same)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(got) - ordered(want)).abs()


def check_rounding(got: torch.Tensor, want: torch.Tensor, case: str, rule: str, *, share: float = 0.02) -> None:
    """A 16-bit result must round like the reference, which computes in float32 and casts once: a different but
    equally careful formula may land one step away on a few elements, never more. A result that is further off, or
    a step away on more than `share` of its elements, broke the precision `rule` (one short sentence)."""
    if got.dtype not in (torch.float16, torch.bfloat16):
        return
    apart = ulps_apart(got, want)
    off = apart > 0
    if int(apart.max()) > 1 or float(off.float().mean()) > share:
        index = tuple(int(i) for i in torch.unravel_index(apart.argmax(), apart.shape))
        raise ExerciseFailure(
            f"{case}: {rule}\n{int(off.sum())} of {off.numel()} values round differently from nanoref's (up to "
            f"{int(apart.max())} steps of {str(got.dtype).removeprefix('torch.')}); at index {index} you have "
            f"{got[index].item():.6g}, nanoref {want[index].item():.6g}"
        )
