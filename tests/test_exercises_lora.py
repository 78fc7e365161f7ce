"""Notebook 14's exercise check: nanoref's own batched delta passes, the usual mistakes fail with a hint that names
them, and a function wrong in the engine fails the generation against HF + peft."""

from __future__ import annotations

import pytest
import torch

from nanoref.exercises import ExerciseFailure, check_lora_delta
from nanoref.exercises.lora import check_lora_generation
from nanoref.ops.lora import lora_delta, lora_delta_reference

pytest.importorskip("peft", reason="peft is not installed (the LoRA oracle; pip install peft)")


def test_nanorefs_own_lora_delta_and_the_loop_pass():
    check_lora_delta(lora_delta)
    for seed in range(3):
        check_lora_delta(lora_delta_reference, seed=seed, engine=False)


def unscaled(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, row_slots, torch.ones_like(scalings))


def base_rows_on_slot_0(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, row_slots.clamp(min=0), scalings)


def every_row_on_slot_0(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, torch.where(row_slots < 0, row_slots, 0), scalings)


def slot_0_scaling_for_every_row(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, row_slots, torch.full_like(scalings, float(scalings[0])))


def in_float32(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x.float(), lora_a.float(), lora_b.float(), row_slots, scalings)


def slots_clamped_in_place(x, lora_a, lora_b, row_slots, scalings):
    # right for this call, but the engine's row_slots, shared by every adapted projection, loses its -1 rows
    base = row_slots < 0
    delta = lora_delta(x, lora_a, lora_b, row_slots.clamp_(min=0), scalings)
    delta[base] = 0
    return delta


def x_scaled_in_place(x, lora_a, lora_b, row_slots, scalings):
    delta = lora_delta(x, lora_a, lora_b, row_slots, scalings)
    x.mul_(2)
    return delta


def b_transposed_again(x, lora_a, lora_b, row_slots, scalings):
    delta = torch.zeros(x.shape[0], lora_b.shape[-1], dtype=x.dtype)
    for slot in range(lora_a.shape[0]):
        rows = row_slots == slot
        delta[rows] = scalings[slot] * (x[rows] @ lora_a[slot].T) @ lora_b[slot].T  # lora_b is (R, out) already
    return delta


def scaled_twice(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, row_slots, scalings * scalings)


def alpha_where_alpha_over_r_belongs(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, row_slots, scalings * lora_a.shape[1])


def divided_by_the_rank_again(x, lora_a, lora_b, row_slots, scalings):
    return lora_delta(x, lora_a, lora_b, row_slots, scalings / lora_a.shape[1])


def slots_counted_from_1(x, lora_a, lora_b, row_slots, scalings):  # slot s read as s - 1 (slot 0 as the base model)
    return lora_delta(x, lora_a, lora_b, torch.where(row_slots > 0, row_slots - 1, -1), scalings)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (b_transposed_again, r"lora_b\[s\] is \(R, out\), B stored transposed already"),
        (unscaled, "multiply by scalings"),
        (base_rows_on_slot_0, "a base-model row \\(slot -1\\) got a delta"),
        (every_row_on_slot_0, "each row must use its own slot"),
        (slot_0_scaling_for_every_row, "each row must use its own adapter's scaling, scalings\\[row_slots\\[i\\]\\]"),
        (in_float32, "dtype torch.float32, expected torch.bfloat16"),
        (scaled_twice, r"scaled twice \(by scalings\[slot\] squared\)"),
        (alpha_where_alpha_over_r_belongs, r"times too large \(lora_alpha where lora_alpha / r belongs\)"),
        (divided_by_the_rank_again, "divided by R = [0-9]+ once too often"),
        (slots_counted_from_1, r"(got slot [0-9]+'s delta|got no delta): .*slots count from 0"),
        (slots_clamped_in_place, "changed row_slots in place"),
        (x_scaled_in_place, "changed x in place"),
    ],
)
def test_a_wrong_lora_delta_fails_with_its_hint(wrong, hint):
    with pytest.raises(ExerciseFailure, match=hint):
        check_lora_delta(wrong, engine=False)


def test_a_wrong_lora_delta_fails_in_the_engine_too():
    with pytest.raises(ExerciseFailure, match="where HF \\+ peft generates"):
        check_lora_generation({"lora_delta": unscaled})
