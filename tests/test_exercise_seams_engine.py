"""Every exercise seam is consulted by the engine inside `use(...)`, and only there; each has its checker.

`test_the_engine_calls_a_seam_only_inside_use` covers each seam in `CASES`. Six seams are left to the test of
their notebook (`LEFT`), because this file's engine (the tiny dense Qwen3 on one rank) never reaches them:

- `vocab_parallel_embed`: only a tensor-parallel engine calls it (two ranks, a worker process each).
  test_exercises_tensor_parallel.py checks on its two-rank engine that every rank calls it inside `use(...)` with
  its own vocabulary range, that nanoref's own function there leaves the tokens as one rank's, and that one rank
  never calls it.
- `moe_route` and `moe_experts`: only a Qwen3-MoE checkpoint's sparse layers call them. test_exercises_moe.py
  makes this file's check on `tiny_moe_model()` (same output inside the block, no call after it), counting one
  call per sparse layer and step.
- `find_stop_string` and `stop_hold_back`: only stop strings call them, and stop strings need a tokenizer, which the
  tiny random Qwen3 lacks. test_exercises_serving.py makes this file's check on the built-in model.
- `apply_token_bitmask`: only requests with structured_outputs call it, and a grammar needs a tokenizer too.
  test_exercises_structured_output.py makes this file's check on the built-in model.

The Triton seams (`store_kvcache_kernel`, `merge_splits`) are covered here where Triton is installed (slow: the
interpreter on a CPU) and skipped elsewhere. `test_every_seam_is_covered_here_or_left_to_a_named_test` fails when
a seam is added to `nanoref.utils.seams.SEAMS` without a place in one of the two tables.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

import nanoref.exercises as exercises
from nanoref import LLM, SamplingParams
from nanoref.cuda_graphs import pad_decode_batch
from nanoref.engine.block_manager import find_cached_prefix
from nanoref.engine.scheduler import choose_preemption_victim
from nanoref.engine.step_inputs import prefill_metadata
from nanoref.exercises.common import random_prompts
from nanoref.layers.activation import silu_and_mul_cuda
from nanoref.layers.layernorm import add_rms_norm, rms_norm
from nanoref.layers.rotary import apply_rotary
from nanoref.layers.sampler import apply_top_k_top_p
from nanoref.ops import attention_torch
from nanoref.ops.lora import lora_delta
from nanoref.ops.triton_setup import triton_available
from nanoref.speculative.acceptance import accept_greedy, rejection_sample
from nanoref.testing import EVERY_STEP
from nanoref.utils import seams

from .helpers import Counting, assert_called_every_decode_step, enable_bucketed_decode

# a shared 70-token prefix (prefix-cache hits), and contexts past one 64-key tile (so decode can split)
PROMPTS = [list(range(5, 75)), list(range(5, 75)) + [3, 4, 5, 6, 7], [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=3)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, **EVERY_STEP, "prompt_lookup_max": 3}
REPEATING = [[7, 8, 9] * 5, [1, 2, 3, 4] * 3]  # text that repeats itself: the n-gram lookup proposes


def on_an_adapter(llm) -> None:
    """Every request this engine makes runs under one random LoRA adapter (a step of base-model rows alone skips the
    delta)."""
    from nanoref import LoRARequest
    from nanoref.exercises.common import scratch_folder
    from nanoref.testing import make_random_lora

    adapter = LoRARequest("a", 1, str(make_random_lora(scratch_folder("lora"), llm.config.model_folder, rank=4)))
    make_samples = llm.make_samples
    llm.make_samples = lambda prompt, params, *args, **options: make_samples(
        prompt, params, *args, **{**options, "lora_request": adapter}
    )


@dataclass(frozen=True)
class Case:
    """How the engine reaches one seam: nanoref's own function for it, and the settings that make a step call it."""

    default: Callable
    engine: dict = field(default_factory=dict)  # LLM(...) settings
    prepare: Callable[[LLM], None] | None = None  # run on the new engine before any generate
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    prompts: list[list[int]] = field(default_factory=lambda: PROMPTS)


def triton_case(name: str) -> Case:
    """A Triton seam: the engine runs where the kernels do, the GPU they compile for or the CPU under the
    interpreter (float32: the comparison with nanoref's own output is token-exact)."""
    if not triton_available():
        pytest.skip("Triton is not installed (Linux wheels only)")
    from nanoref.ops import attention_triton
    from nanoref.ops.store_kvcache_triton import store_kvcache_kernel
    from nanoref.ops.triton_setup import kernel_device

    triton = {"attention_backend": "triton", "device": str(kernel_device()), "dtype": "float32", "enforce_eager": True}
    default = {"store_kvcache_kernel": store_kvcache_kernel, "merge_splits": attention_triton.merge_splits}[name]
    return Case(default, triton)


CASES: dict[str, Callable[[], Case]] = {
    "prefill_metadata": lambda: Case(prefill_metadata),
    "rms_norm": lambda: Case(rms_norm),
    "add_rms_norm": lambda: Case(add_rms_norm),
    "store_kvcache_kernel": lambda: triton_case("store_kvcache_kernel"),
    "paged_decode_attention": lambda: Case(attention_torch.paged_decode_attention),
    "merge_splits": lambda: triton_case("merge_splits"),
    "find_cached_prefix": lambda: Case(find_cached_prefix, {"max_num_batched_tokens": 80}),
    # four requests growing in 5 blocks of 16: one must step back
    "choose_preemption_victim": lambda: Case(
        choose_preemption_victim,
        {"num_kvcache_blocks": 5},
        params=SamplingParams(temperature=0, max_tokens=12),
        prompts=random_prompts(seed=1234, lengths=[5, 23, 17, 40], vocab=256),
    ),
    "pad_decode_batch": lambda: Case(pad_decode_batch, prepare=enable_bucketed_decode),
    "apply_rotary": lambda: Case(apply_rotary),
    "silu_and_mul": lambda: Case(silu_and_mul_cuda),
    # seeded sampling through top-k and top-p: the same tokens on every call
    "apply_top_k_top_p": lambda: Case(
        apply_top_k_top_p, params=SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=5, max_tokens=3)
    ),
    # only a speculative engine's verify steps call the acceptance rules: greedy rows one, sampled rows the other
    "accept_greedy": lambda: Case(accept_greedy, {"speculative_config": NGRAM}, prompts=REPEATING),
    "rejection_sample": lambda: Case(
        rejection_sample,
        {"speculative_config": NGRAM},
        params=SamplingParams(temperature=1.0, seed=3, max_tokens=6),
        prompts=REPEATING,
    ),
    # every adapted projection of an engine with enable_lora calls it, in every step with an adapted row
    "lora_delta": lambda: Case(lora_delta, {"enable_lora": True}, prepare=on_an_adapter),
}

# seam -> (the test module and test that check it on an engine that reaches it, why not here)
LEFT: dict[str, tuple[str, str, str]] = {
    "vocab_parallel_embed": (
        "test_exercises_tensor_parallel",
        "test_every_rank_calls_the_seam_and_a_wrong_lookup_changes_the_tokens",
        "only a tensor-parallel engine calls it",
    ),
    "moe_route": (
        "test_exercises_moe",
        "test_the_engine_calls_each_moe_seam_only_inside_use",
        "only a Qwen3-MoE checkpoint calls it",
    ),
    "moe_experts": (
        "test_exercises_moe",
        "test_the_engine_calls_each_moe_seam_only_inside_use",
        "only a Qwen3-MoE checkpoint calls it",
    ),
    "find_stop_string": (
        "test_exercises_serving",
        "test_the_engine_calls_each_stop_seam_only_inside_use",
        "only stop strings call it, which need a tokenizer: the tiny random Qwen3 has none",
    ),
    "stop_hold_back": (
        "test_exercises_serving",
        "test_the_engine_calls_each_stop_seam_only_inside_use",
        "only stop strings call it, which need a tokenizer: the tiny random Qwen3 has none",
    ),
    "apply_token_bitmask": (
        "test_exercises_structured_output",
        "test_the_engine_calls_the_bitmask_seam_only_inside_use",
        "only structured_outputs call it, whose grammar needs a tokenizer: the tiny random Qwen3 has none",
    ),
}


def test_every_seam_is_covered_here_or_left_to_a_named_test():
    assert not set(CASES) & set(LEFT), "a seam is both covered here and left to another test"
    assert set(CASES) | set(LEFT) == set(seams.SEAMS), "a seam is neither in CASES nor in LEFT"
    for name, (module, test, _why) in LEFT.items():
        found = getattr(importlib.import_module(f"{__package__}.{module}"), test, None)
        assert callable(found), f"seam {name!r} is left to {module}.{test}, which does not exist"


# the Triton seams run the interpreter on a CPU (~20 s each): slow. The quick loop still generates token-exact
# through both on Triton (test_exercises_kv_store.py, test_exercises_paged_decode.py's engine checks).
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[pytest.mark.slow] if name in seams.TRITON_SEAMS else []) for name in sorted(CASES)],
)
def test_the_engine_calls_a_seam_only_inside_use(tiny_model, name):
    case = CASES[name]()
    llm = LLM(tiny_model, **{"device": "cpu", "num_kvcache_blocks": 32, **case.engine})
    if case.prepare is not None:
        case.prepare(llm)
    reference = llm.generate(case.prompts, case.params, use_tqdm=False)
    counting = Counting(case.default)
    extra = {}
    if name == "merge_splits":  # splits only happen past one 64-key tile: force 2 per decode step
        from nanoref.ops import attention_triton

        extra["paged_decode_attention"] = functools.partial(attention_triton.paged_decode_attention, num_splits=2)
    with seams.use(**{name: counting}, **extra):
        replaced = llm.generate(case.prompts, case.params, use_tqdm=False)
    assert counting.calls, f"the engine never called seam {name!r}"
    if name == "pad_decode_batch":  # every decode step went through the graphs' padding
        assert_called_every_decode_step(llm, counting)
    assert replaced == reference, f"nanoref's own {name} through the seam changed the output"
    calls = counting.calls
    assert llm.generate(case.prompts, case.params, use_tqdm=False) == reference
    assert counting.calls == calls and not seams.active(), f"seam {name!r} was used outside the block"


def test_every_seam_has_a_checker():
    for name in seams.SEAMS:
        assert callable(getattr(exercises, f"check_{name}", None)), f"nanoref.exercises has no check_{name}"


def test_prefix_cache_is_not_shared_across_a_change_of_forward(tiny_model):
    """K/V cached by nanoref's forward must not serve a learner's forward (or the other way round): an idle engine
    forgets its cached prefixes when a `use(...)` block begins or ends."""

    def swapped_silu_and_mul(x):  # a plausible learner bug: gate and up swapped
        up, gate = x.chunk(2, dim=-1)
        return up * gate.sigmoid() * gate

    prompt = list(range(5, 75))  # 70 tokens: four full 16-token blocks the second call could hit
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(tiny_model, num_kvcache_blocks=32)
    plain = llm.generate([prompt], params, use_tqdm=False)
    with seams.use(silu_and_mul=swapped_silu_and_mul):
        fresh = LLM(tiny_model, num_kvcache_blocks=32).generate([prompt], params, use_tqdm=False)
        assert fresh != plain, "the swapped activation should change the tokens, or this test proves nothing"
        assert llm.generate([prompt], params, use_tqdm=False) == fresh, "K/V cached by the plain forward was reused"
    assert llm.generate([prompt], params, use_tqdm=False) == plain, "K/V cached inside use(...) was reused after it"
    llm.scheduler.block_manager.check_invariants()
