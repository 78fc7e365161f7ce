"""What every exercise check shares: tiny models, HF's greedy reference, and the engine run with a seam in place."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import linecache
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nanoref.testing import make_tiny_qwen3
from nanoref.utils.seams import use


class ExerciseFailure(AssertionError):
    """An exercise's answer is wrong; the message says where and what to look at.

    Its first line names the rule that was broken and stays short (nbgrader's report keeps little more than
    it); values, shapes and the learner's source line follow on the next lines. A first line longer than
    FIRST_LINE is broken at its last clause that fits, so no message loses its point to a cut."""

    def __init__(self, message: str = "") -> None:
        super().__init__(fit_first_line(message))


FIRST_LINE = 200  # characters


def fit_first_line(message: str, width: int = FIRST_LINE) -> str:
    """`message` with its first line broken after the last '. ', '; ' or ': ' within `width` characters (else the
    last space), the rest moved to the next line; a message whose first line fits is returned as it is."""
    first, newline, rest = message.partition("\n")
    if len(first) <= width:
        return message
    cut = max(first.rfind(mark, 0, width) for mark in (". ", "; ", ": "))
    cut = cut + 1 if cut > 0 else first.rfind(" ", 0, width)
    if cut <= 0:
        return message
    return first[:cut] + "\n" + fit_first_line(first[cut:].lstrip() + newline + rest, width)


# where code that is not the learner's lives: nanoref, torch, the installed packages and the standard library
_NOT_LEARNERS = tuple(
    str(Path(root).resolve()) + "/"
    for root in {
        Path(__file__).parents[1],
        Path(torch.__file__).parent,
        *(Path(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
)


def learner_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of `error`'s traceback that runs the learner's code (a notebook cell, a test module),
    not nanoref's, torch's or the standard library's: the line to point the learner at."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_LEARNERS)]
    return mine[-1] if mine else None


def is_notebook_cell(filename: str) -> bool:
    """Whether `filename` is a Jupyter cell's code: ipykernel compiles each cell as a temporary file
    (`<tmp>/ipykernel_<pid>/<hash>.py`), older IPython as `<ipython-input-<n>-<hash>>`."""
    if filename.startswith("<ipython-input-"):
        return True
    path = Path(filename)
    return path.parent.name.startswith("ipykernel_") and path.suffix == ".py"


def describe_location(frame: traceback.FrameSummary) -> str:
    """'your cell, line 7, in apply_rotary' for a notebook cell (its temporary file's name means nothing to the
    learner, and the line counts from the cell's top); 'cell.py:7, in apply_rotary' for a file."""
    if is_notebook_cell(frame.filename):
        return f"your cell, line {frame.lineno}, in {frame.name}"
    return f"{Path(frame.filename).name}:{frame.lineno}, in {frame.name}"


def describe_error(error: BaseException) -> str:
    """'RuntimeError at cell.py:7, in apply_rotary' (in a notebook: 'at your cell, line 7, in apply_rotary') and, on
    the lines after, that source line and the message."""
    frame = learner_frame(error)
    name = type(error).__name__
    if frame is None:
        return f"{name}\n{name}: {error}"
    source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f"{name} at {describe_location(frame)}\n  {source}\n{name}: {error}"


def call_learner(
    fn: Callable,
    name: str,
    *args: Any,
    case: str = "",
    hint: Callable[[Exception], str | None] | None = None,
    **kwargs: Any,
) -> Any:
    """`fn(*args, **kwargs)`, the learner's function, as every check calls it: an exception it raises becomes an
    ExerciseFailure that names the learner's own line (file:line and its source) and, where `hint(error)` knows
    one, the fix (short: the first line stays readable); `case`, the inputs in words, comes after.
    NotImplementedError (an exercise not written yet: nbgrader's stub) passes through as it is. A function of
    nanoref's own, checked from a notebook, is a failure (`check_is_the_learners`)."""
    check_is_the_learners(fn, name)
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, ExerciseFailure):
        raise
    except Exception as error:
        advice = hint(error) if hint is not None else None
        summary, details = describe_error(error).split("\n", 1)
        raise ExerciseFailure(
            f"your {name} raised {summary}"
            + (f": {advice}" if advice else "")
            + f"\n{details}"
            + (f"\n(on {case})" if case else "")
        ) from error


# nanoref's own code, where a learner's answer never lives (the exercises' and the classroom's wrappers aside)
_NANOREF = Path(__file__).resolve().parents[1]
_WRAPPERS = (_NANOREF / "exercises", _NANOREF / "classroom")


def check_is_the_learners(fn: Callable, name: str) -> None:
    """A notebook imports nanoref's function under the exercise's name to teach with it, and the learner's answer
    cell then defines its own: where that cell failed, or was deleted or moved below its test, the name still holds
    nanoref's, which would pass every check. Checked from a notebook cell (a test of nanoref's may check nanoref's
    own), such a function is an ExerciseFailure saying so."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    source = Path(code.co_filename).resolve() if code is not None else None
    if source is None or not source.is_relative_to(_NANOREF) or any(map(source.is_relative_to, _WRAPPERS)):
        return
    frame = sys._getframe(1)
    while frame is not None and not is_notebook_cell(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is not None:
        raise ExerciseFailure(
            f"{name} here is nanoref's own ({fn.__module__}.{fn.__qualname__}), not your answer: run your {name} cell "
            "above this one, and fix what it raises (a cell that fails, or was deleted or moved below this one, "
            "leaves nanoref's function under that name)"
        )


_MODELS: dict[tuple, Path] = {}
_HF_OUTPUTS: dict[tuple, list[list[int]]] = {}


_INPUT_DRAWS = itertools.count(1)


def input_generator(seed: int | None = None) -> torch.Generator:
    """The generator of a check's random inputs. seed None: other inputs on every call, so an answer cannot be fitted
    to one fixed draw, yet the same ones for a notebook run top to bottom after its `torch.manual_seed` (they follow
    the initial seed and the count of earlier draws in this process). Reads torch's global RNG but never draws from
    it: a check leaves the learner's random state as it found it."""
    if seed is None:
        seed = (torch.initial_seed() + 1_000_003 * next(_INPUT_DRAWS)) % 2**63
    return torch.Generator().manual_seed(seed)


# this process's model folders (none, or one directory), removed when it exits; a list, so that no module name is
# ever rebound after import (nanoref.exercises.integrity verifies that)
_SCRATCH: list[tempfile.TemporaryDirectory] = []


def scratch_folder(name: str) -> Path:
    """A path `name` in a folder of its own, not yet created, under this process's temporary directory (made on
    first use). TemporaryDirectory's finalizer removes that directory when the process exits, so checks leave no
    model folders behind in the temp dir."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="nanoref-exercise-"))
    return Path(tempfile.mkdtemp(dir=_SCRATCH[0].name)) / name


def tiny_model(seed: int = 0, **overrides: Any) -> Path:
    """A random tiny Qwen3 folder (HF format), built once per process and settings."""
    key = (seed, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        folder = scratch_folder("tiny-qwen3")
        _MODELS[key] = make_tiny_qwen3(folder, seed=seed, **overrides)
    return _MODELS[key]


def hf_model(folder: Path) -> Any:
    """HF transformers' model of a folder, in float32 and eval mode, loaded without a progress bar."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in a notebook's output
    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (one at a time: no padding involved)."""
    key = (str(folder), tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_OUTPUTS:
        model = hf_model(folder)
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
                )
            outputs.append(out[0, len(prompt) :].tolist())
        _HF_OUTPUTS[key] = outputs
    return _HF_OUTPUTS[key]


def random_prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def describe(functions: dict[str, Callable]) -> str:
    return ", ".join(f"your `{name}`" for name in functions)


STEPS_PER_TOKEN = 4  # a step budget: steps a run may take per prompt and output token (a correct one takes <= 1)
SPARE_STEPS = 64  # and a few more, for preemptions and their recomputation


def step_budget(prompts: list, params: Any) -> int:
    """The most steps a run of `prompts` with `params` (one SamplingParams or one per prompt) may take: a correct
    engine adds at least one token to some sequence in every step, so it needs at most one per prompt and output
    token, plus recomputations after preemptions; a run past this many has stopped making progress."""
    prompts = list(prompts)
    each = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    # a text prompt's characters: at least its tokens
    tokens = sum(len(prompt) + one.max_tokens * one.n for prompt, one in zip(prompts, each))
    return STEPS_PER_TOKEN * tokens + SPARE_STEPS


@contextlib.contextmanager
def limited_steps(llm: Any, budget: int, names: str) -> Iterator[None]:
    """Inside: the engine's step() fails with an ExerciseFailure naming `names` once it has run `budget` times (a
    wrong answer can leave a sequence gaining no token: the run would never end). The engine aborts its requests
    then, as after any failed step; on leaving, `llm.step` is the engine's own again."""
    engine_step = llm.step
    steps = [0]

    def step() -> Any:
        steps[0] += 1
        if steps[0] > budget:
            raise ExerciseFailure(
                f"with {names} in the engine, the run stopped making progress: {budget} steps (more than "
                f"{STEPS_PER_TOKEN} per prompt and output token) and its requests had not finished: every step must "
                "add at least one token to each sequence it runs (a speculative step: the kept proposals and then "
                "the target's token, at the first disagreement or the bonus row)"
            )
        return engine_step()

    llm.step = step  # this engine object only: its class, and every other engine, are left as they are
    try:
        yield
    finally:
        del llm.step


def run_with(llm: Any, functions: dict[str, Callable], prompts: list, params: Any) -> list[dict]:
    """`llm.generate`'s outputs with the learner's `functions` in place, within a step budget (a run that stops
    making progress fails, naming them); an engine error becomes an ExerciseFailure that names them (the learner's
    code raised, or returned something the engine cannot use)."""
    names = describe(functions)
    try:
        with use(**functions), limited_steps(llm, step_budget(prompts, params), names):
            return llm.generate(prompts, params, use_tqdm=False)
    except ExerciseFailure:
        raise
    except Exception as error:
        summary, details = describe_error(error).split("\n", 1)
        raise ExerciseFailure(f"the engine failed while running {names}: {summary}\n{details}") from error


def stream_with(llm: Any, functions: dict[str, Callable], prompt: Any, params: Any) -> list[Any]:
    """`llm.stream`'s pieces of one request with the learner's `functions` in place, within a step budget and with
    an engine error named as in run_with."""
    names = describe(functions)
    try:
        with use(**functions), limited_steps(llm, step_budget([prompt], params), names):
            return list(llm.stream(prompt, params))
    except ExerciseFailure:
        raise
    except Exception as error:
        summary, details = describe_error(error).split("\n", 1)
        raise ExerciseFailure(f"the engine failed while running {names}: {summary}\n{details}") from error


def generate_with(llm: Any, functions: dict[str, Callable], prompts: list[list[int]], params: Any) -> list[list[int]]:
    """The engine's output ids with the learner's `functions` in place (see run_with)."""
    return [out["token_ids"] for out in run_with(llm, functions, prompts, params)]


def check_generation(
    functions: dict[str, Callable],
    *,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 8,
    model: Path | None = None,
    prepare: Callable[[Any], None] | None = None,
    **engine_kwargs: Any,
) -> list[list[int]]:
    """Generate greedily with the real engine running the learner's `functions` (seam name -> function) and
    compare every token with HF transformers. engine_kwargs go to `LLM` (e.g. num_kvcache_blocks,
    max_num_batched_tokens, attention_backend); `prepare(llm)`, when given, runs on the engine before it generates
    (e.g. to switch on a mode the seam lives in). Returns the generated ids; raises ExerciseFailure naming the
    first prompt and token that differ.
    """
    from nanoref import LLM, SamplingParams

    model = model or tiny_model()
    if prompts is None:
        prompts = random_prompts(seed=1234, lengths=[5, 23, 17, 40], vocab=256)
    expected = hf_greedy(model, prompts, max_tokens)
    engine_kwargs.setdefault("num_kvcache_blocks", 64)
    if engine_kwargs.get("attention_backend") == "triton":
        from nanoref.ops.triton_setup import kernel_device

        # where nanoref's Triton kernels run: the GPU they compile for, or the CPU under the interpreter
        engine_kwargs.setdefault("device", str(kernel_device()))
    # HF's reference runs in float32: so does the engine, also on a GPU (whose default, bfloat16, can flip a token)
    engine_kwargs.setdefault("dtype", "float32")
    # a CUDA graph replays the kernels recorded at capture, not the learner's function: run eagerly
    engine_kwargs.setdefault("enforce_eager", True)
    names = describe(functions)
    with LLM(model, **engine_kwargs) as llm:  # leaving the block stops tensor-parallel workers, if any
        if prepare is not None:
            prepare(llm)
        got = generate_with(llm, functions, prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    for index, (mine, reference) in enumerate(zip(got, expected)):
        for position, (a, b) in enumerate(zip(mine, reference)):
            if a != b:
                raise ExerciseFailure(
                    f"with {names} in the engine, prompt {index} ({len(prompts[index])} tokens) generates token "
                    f"{a} at output position {position} where HF transformers generates {b}"
                    + (" (the tokens before it matched)" if position else " (already the first token differs)")
                )
        if len(mine) != len(reference):
            raise ExerciseFailure(
                f"with {names} in the engine, prompt {index} generated {len(mine)} tokens, HF {len(reference)}"
            )
    return got
