"""Checks for notebook 14's exercise: the batched LoRA delta of a flat batch, each row under its own adapter slot.

`lora_delta(x, lora_a, lora_b, row_slots, scalings)` -> (N, out): row i gets s (x_i A^T) B^T with the A, B and s
of slot row_slots[i], and nothing where the slot is -1 (a base-model row). The check runs the learner's function
on fresh random flat batches against `lora_delta_reference` (the per-adapter loop), naming the usual mistakes,
then runs the engine with it in place on a batch of two adapters and a base-model row, token for token against HF
transformers + peft.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from nanoref.exercises.common import (
    ExerciseFailure,
    call_learner,
    describe,
    describe_error,
    input_generator,
    limited_steps,
    random_prompts,
    scratch_folder,
    step_budget,
    tiny_model,
)
from nanoref.exercises.tensors import expect_tensor, worst_element
from nanoref.ops.lora import lora_delta_reference
from nanoref.utils.seams import use

_ADAPTERS: dict[str, Path] = {}
_PEFT_OUTPUTS: dict[tuple, list[int]] = {}


def _case(generator: torch.Generator, num_rows: int, num_slots: int, rank: int, dtype: torch.dtype) -> tuple:
    """A flat batch: x (N, in), slots of A (S, R, in) and B (S, R, out) (each adapter zero past its own rank, as the
    engine pads them), row slots in [-1, S) with a base row and a row under every slot, scalings (S,)."""
    size_in, size_out = 24, 40
    x = torch.randn(num_rows, size_in, generator=generator).to(dtype)
    lora_a = (torch.randn(num_slots, rank, size_in, generator=generator) / size_in**0.5).to(dtype)  # x A^T: O(1)
    lora_b = (torch.randn(num_slots, rank, size_out, generator=generator) / rank**0.5).to(dtype)
    lora_b[0, rank // 2 :] = 0  # slot 0 holds an adapter of half the slots' rank
    row_slots = torch.randint(-1, num_slots, (num_rows,), generator=generator)
    row_slots[0] = -1
    row_slots[1 : 1 + num_slots] = torch.randperm(num_slots, generator=generator)
    scalings = 0.5 + 2 * torch.rand(num_slots, generator=generator)  # float32, as the engine keeps them
    return x, lora_a, lora_b, row_slots, scalings


def _hint(x, lora_a, lora_b, row_slots, scalings, got: torch.Tensor) -> str | None:
    """The usual mistake behind a wrong answer, when it is one of them."""
    base = row_slots < 0
    if got[base].abs().sum() > 0:
        return "a base-model row (slot -1) got a delta: rows of slot -1 must get zeros (W alone serves them)"
    unscaled = lora_delta_reference(x, lora_a, lora_b, row_slots, torch.ones_like(scalings))
    if torch.allclose(got.float(), unscaled.float(), rtol=1e-3, atol=1e-3):
        return "every row's delta is off by its adapter's scaling: multiply by scalings[slot] (lora_alpha / r)"
    first_scaling = lora_delta_reference(x, lora_a, lora_b, row_slots, scalings[:1].expand_as(scalings))
    if len(scalings) > 1 and torch.allclose(got.float(), first_scaling.float(), rtol=1e-3, atol=1e-3):
        return (
            "every row was scaled by scalings[0]: each row must use its own adapter's scaling, scalings[row_slots[i]] "
            "(adapters differ in lora_alpha / r)"
        )
    zero = row_slots.clamp(min=0)
    every_slot_zero = lora_delta_reference(x, lora_a, lora_b, torch.where(base, -1, zero * 0), scalings)
    if len(scalings) > 1 and torch.allclose(got.float(), every_slot_zero.float(), rtol=1e-3, atol=1e-3):
        return "every row used slot 0's adapter: each row must use its own slot, row_slots[i]"
    want = lora_delta_reference(x, lora_a, lora_b, row_slots, scalings).float()
    return _factor_hint(got.float(), want, row_slots, scalings, lora_a.shape[1]) or _slot_hint(
        x, lora_a, lora_b, row_slots, scalings, got.float(), want
    )


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=2e-2, atol=2e-2 * max(float(want.abs().max()) if want.numel() else 0, 1e-6))


def _factor_hint(got, want, row_slots, scalings, rank: int) -> str | None:
    """Each slot's rows right up to one factor per slot (the scaling applied wrongly): which factor, in words."""
    factors = []  # (slot, got / want on its rows)
    for slot in row_slots[row_slots >= 0].unique().tolist():
        mine, theirs = got[row_slots == slot].flatten(), want[row_slots == slot].flatten()
        if float(theirs @ theirs) == 0:
            continue
        factor = float(mine @ theirs / (theirs @ theirs))
        if not _close(mine, factor * theirs):
            return None
        factors.append((slot, factor))
    if not factors or all(abs(factor - 1) < 1e-2 for _, factor in factors):
        return None

    def each(expected: Callable[[int], float]) -> bool:
        return all(abs(factor - expected(slot)) <= 1e-2 * abs(expected(slot)) for slot, factor in factors)

    rule = (
        "the delta is scalings[slot] * (x A^T) B^T with scalings[slot] applied once, as given: it already is "
        "lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)"
    )
    if each(lambda slot: float(scalings[slot])):
        return f"every row's delta was scaled twice (by scalings[slot] squared): {rule}"
    if each(lambda slot: rank):
        return f"every row's delta is R = {rank} times too large (lora_alpha where lora_alpha / r belongs): {rule}"
    if each(lambda slot: 1 / rank):
        return f"every row's delta is divided by R = {rank} once too often: {rule}"
    shown = ", ".join(f"slot {slot}: {factor:.3g}" for slot, factor in factors)
    return f"each slot's delta is the expected one times a factor ({shown}): {rule}"


def _slot_hint(x, lora_a, lora_b, row_slots, scalings, got, want) -> str | None:
    """A row of slot k that got exactly another slot's delta (or none): the slot index taken wrongly."""
    for row in range(len(row_slots)):
        slot = int(row_slots[row])
        if slot < 0 or _close(got[row], want[row]):
            continue
        if float(got[row].abs().max()) == 0:
            return (
                f"row {row} (slot {slot}) got no delta: only row_slots -1 is the base model; slots count from 0, "
                f"and a row of slot {slot} gets lora_a[{slot}], lora_b[{slot}] and scalings[{slot}]"
            )
        for other in range(len(scalings)):
            one = torch.tensor([other])
            theirs = lora_delta_reference(x[row : row + 1], lora_a, lora_b, one, scalings).float()[0]
            if other != slot and _close(got[row], theirs):
                return (
                    f"row {row} (slot {slot}) got slot {other}'s delta: a row uses its own slot, lora_a[row_slots[i]], "
                    "lora_b[row_slots[i]] and scalings[row_slots[i]] (slots count from 0, -1 is the base model)"
                )
        return None
    return None


_INPUTS = ("x", "lora_a", "lora_b", "row_slots", "scalings")


def _shape_hint(error: Exception) -> str | None:
    """The fix for a product of the wrong shapes: A or B taken the other way round."""
    if isinstance(error, RuntimeError) and "cannot be multiplied" in str(error):
        return (
            "lora_a[s] is (R, in): x @ lora_a[s].T is (n, R); lora_b[s] is (R, out), B stored transposed already: "
            "(x @ lora_a[s].T) @ lora_b[s] is (n, out)"
        )
    return None


def _unchanged(given: list[torch.Tensor], originals: tuple[torch.Tensor, ...], case: str) -> None:
    """The learner's function must leave its inputs as they were: in the engine every adapted projection of every
    layer reads the same row_slots and scalings, so a row_slots.clamp_(min=0) (to index with it) serves slot 0's
    adapter to the base-model rows of every later projection, and the generation goes wrong far from the cause."""
    for name, after, before in zip(_INPUTS, given, originals):
        if not torch.equal(after, before):
            why = (
                "the same row_slots serve every adapted projection of the step: index with row_slots.clamp(min=0), "
                "a new tensor, not clamp_"
                if name == "row_slots"
                else "the engine still reads it after the call"
            )
            raise ExerciseFailure(
                f"your lora_delta changed {name} in place: compute new tensors and leave every input as it was ({why})"
                f"\n(on {case})"
            )


def check_lora_delta(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn` against the per-adapter loop on random flat batches, then in the engine against HF + peft."""
    generator = input_generator(seed)
    shapes = [(9, 3, 4), (1, 1, 8), (16, 4, 2), (5, 2, 6)]  # (rows, slots, rank)
    for dtype in (torch.float32, torch.bfloat16):
        for num_rows, num_slots, rank in shapes:
            x, lora_a, lora_b, row_slots, scalings = _case(generator, num_rows, num_slots, rank, dtype)
            case = f"{num_rows} rows, {num_slots} slots of rank {rank}, {dtype}; row_slots {row_slots.tolist()}"
            given = [t.clone() for t in (x, lora_a, lora_b, row_slots, scalings)]
            got = call_learner(fn, "lora_delta", *given, case=case, hint=_shape_hint)
            _unchanged(given, (x, lora_a, lora_b, row_slots, scalings), case)
            want = lora_delta_reference(x, lora_a, lora_b, row_slots, scalings)
            expect_tensor(got, f"lora_delta on {case}", want.shape, want.dtype)
            # bfloat16 keeps 8 bits: x A^T rounded before B (as the engine does) moves a value by about 1% of the
            # largest in its product, so compare against the scale of the answer
            scale = float(want.abs().max()) if want.numel() else 1.0
            tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
            if torch.allclose(got.float(), want.float(), **tolerance):
                continue
            hint = _hint(x, lora_a, lora_b, row_slots, scalings, got)
            row, col = worst_element(got, want)
            raise ExerciseFailure(
                (f"{hint}; " if hint else "")
                + f"lora_delta differs at row {row} (slot {int(row_slots[row])}), column {col}: got "
                f"{got[row, col].item():.4g}, expected {want[row, col].item():.4g} (on {case})"
            )
    if engine:
        check_lora_generation({"lora_delta": fn})


def _adapters(model: Path) -> dict[str, Path]:
    """Two random PEFT adapters for the tiny model (made once per process): rank 8 on every projection, and rank 4
    on attention's q and v with rsLoRA."""
    from nanoref.testing import make_random_lora

    if not _ADAPTERS:
        _ADAPTERS["all-r8"] = make_random_lora(scratch_folder("all-r8"), model, rank=8, seed=1)
        _ADAPTERS["qv-r4"] = make_random_lora(
            scratch_folder("qv-r4"), model, rank=4, targets=("q_proj", "v_proj"), seed=2, use_rslora=True
        )
    return _ADAPTERS


def _peft_greedy(model: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    key = (str(model), str(adapter), tuple(prompt), max_tokens)
    if key not in _PEFT_OUTPUTS:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # (peft on a newer transformers: nothing to act on)
                hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
                if adapter is not None:
                    from peft import PeftModel

                    hf = PeftModel.from_pretrained(hf, str(adapter))
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.eval().generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens
            )
        _PEFT_OUTPUTS[key] = out[0, len(prompt) :].tolist()
    return _PEFT_OUTPUTS[key]


def check_lora_generation(functions: dict[str, Callable], max_tokens: int = 8) -> list[list[int]]:
    """Greedy generation of one batch (two adapters and a base-model row) with the learner's `functions` in place,
    token for token against HF transformers + peft; returns the generated ids."""
    from nanoref import LLM, LoRARequest, SamplingParams

    model = tiny_model()
    adapters = _adapters(model)
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    prompts = random_prompts(seed=1234, lengths=[5, 23, 17], vocab=256)
    loras = [requests[0], None, requests[1]]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    names = describe(functions)
    llm = LLM(model, device="cpu", dtype="float32", enable_lora=True, max_loras=2, num_kvcache_blocks=64)
    try:
        with use(**functions), limited_steps(llm, step_budget(prompts, params), names):
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    except ExerciseFailure:
        raise
    except Exception as error:
        summary, details = describe_error(error).split("\n", 1)
        raise ExerciseFailure(f"the engine failed while running {names}: {summary}\n{details}") from error
    got = [out["token_ids"] for out in outputs]
    for index, (mine, lora, prompt) in enumerate(zip(got, loras, prompts)):
        under = "the base model" if lora is None else f"adapter {lora.lora_name!r}"
        reference = _peft_greedy(model, None if lora is None else adapters[lora.lora_name], prompt, max_tokens)
        if mine != reference:
            position = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), len(reference))
            raise ExerciseFailure(
                f"with {names} in the engine, prompt {index} (under {under}) generates {mine} where HF + peft "
                f"generates {reference}: they part at output position {position}"
            )
    return got
