"""Checks for notebook 13's exercise: a grammar's packed bitmask on the constrained rows of one step's logits.

`apply_token_bitmask(logits, rows, bitmask)` -> (B, V), a new tensor: row rows[a] keeps the logits of the tokens
bitmask[a] allows (token t is bit t % 32 of int32 word t // 32, bit 0 the least significant, bit 31 the sign bit)
and gets -inf on every other token; the rows not in `rows` come back as they were; no input is changed. The check
runs worked cases first (each usual mistake fails one of them on every run), then fresh random ones, against
nanoref's own; then the built-in model runs with it in place on a batch that mixes requests constrained by a JSON
schema, a regex and a choice with an unconstrained one: every token must be the one nanoref's own mask gives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanoref.exercises.common import ExerciseFailure, call_learner, describe, input_generator, run_with
from nanoref.exercises.tensors import expect_tensor
from nanoref.layers.logits_processors import apply_token_bitmask


def _int32(word: int) -> int:
    """A 32-bit pattern (0 .. 2**32 - 1) as the int32 that holds it: bit 31 set is a negative number."""
    return word - 2**32 if word >= 2**31 else word


def _words(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[_int32(word) for word in row] for row in rows], dtype=torch.int32)  # (A, W)


def _cases(generator: torch.Generator) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(description, logits (B, V) float32, rows (A,) int64, bitmask (A, ceil(V / 32)) int32): the situations that
    trip answers up, then random ones."""
    worked = [  # (description, B, V, rows, the words of each constrained row as 32-bit patterns)
        ("bit 0 of every word set: tokens 0, 32 and 64 allowed", 2, 96, [0], [[1, 1, 1]]),
        ("only bit 31 of word 0 set (its sign bit: the word is negative): token 31 alone", 2, 64, [1], [[1 << 31, 0]]),
        # the last word holds tokens 64..69 in its bits 0..5 (64, 66 and 69 allowed); its bits 6..31 stand for no token
        (
            "a vocabulary of 70 tokens, not a multiple of 32: 3 words, the last one's bits 6..31 padding (set here)",
            2, 70, [0], [[0x0000_FFFF, 0xFFFF_0000, 0xFFFF_FFC0 | 0b10_0101]],
        ),
        (
            "rows = [3, 0, 2], out of order, with unconstrained rows 1 and 4 between them",
            5, 64, [3, 0, 2], [[0x0000_000F, 0], [0, 0xF000_0000], [0x00FF_00FF, 0x1234_5678]],
        ),
        ("a word of all ones (-1: each of its tokens allowed) beside a word of none", 3, 64, [1], [[0xFFFF_FFFF, 0]]),
    ]  # fmt: skip
    for description, num_rows, vocab, rows, words in worked:
        logits = torch.randn(num_rows, vocab, generator=generator) * 3  # logits on both sides of 0
        yield description, logits, torch.tensor(rows), _words(words)
    for num_rows, vocab, num_constrained in [(4, 1000, 2), (3, 33, 3), (6, 256, 1), (2, 31, 1), (8, 1024, 5)]:
        logits = torch.randn(num_rows, vocab, generator=generator) * 3
        rows = torch.randperm(num_rows, generator=generator)[:num_constrained]
        width = -(-vocab // 32)
        halves = [torch.randint(-(2**31), 2**31, (num_constrained, width), generator=generator) for _ in range(2)]
        bitmask = (halves[0] & halves[1]).to(torch.int32)  # about a quarter of the tokens allowed, bit 31 included
        yield f"random: {num_rows} rows, vocabulary {vocab}, rows {rows.tolist()} constrained", logits, rows, bitmask


# the usual mistakes, each as the mask it leaves (kept: (A, V) bool, True where a token keeps its logit)
def _bit(bitmask: torch.Tensor, vocab: int, bit_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    tokens = torch.arange(vocab)
    return ((bitmask[:, tokens // 32].long() >> bit_of(tokens)) & 1).bool()  # (A, V)


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    return _bit(bitmask, vocab, lambda t: t % 32)


def _reversed_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    return _bit(bitmask, vocab, lambda t: 31 - t % 32)


def _reversed_bits_in_bytes(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:  # (numpy's unpackbits, bitorder "big")
    return _bit(bitmask, vocab, lambda t: t % 32 // 8 * 8 + 7 - t % 8)


def _error_hint(error: Exception) -> str | None:
    """The fix for an exception a usual mistake raises."""
    text = str(error)
    if "must match the size" in text or "shape mismatch" in text or "invalid for input of size" in text:
        return (
            "the W = ceil(V / 32) words hold 32 * W bits, more than the V tokens when V is not a multiple of 32: "
            "unpack every word, then keep the first V bits (logits.shape[1])"
        )
    if "overflow" in text:
        return (
            "1 << 31 does not fit an int32 (whose largest value is 2**31 - 1): shift the word instead, "
            "(word >> i) & 1, with i an int32 tensor of 0..31"
        )
    return None


def _diagnose(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, got: torch.Tensor, case: str) -> str:
    """What to fix, from how `got` differs from nanoref's answer (the first line), then where (the lines after)."""
    vocab = logits.shape[1]
    constrained = rows.tolist()
    free = [row for row in range(logits.shape[0]) if row not in constrained]
    if len(rows) < logits.shape[0] and torch.equal(got, apply_token_bitmask(logits, torch.arange(len(rows)), bitmask)):
        return (
            f"bitmask row a is the mask of logits row rows[a] (here rows = {constrained}): your answer masked row a "
            f"instead\n(on {case})"
        )
    ordered = rows.sort().values  # (A,)
    if not torch.equal(ordered, rows) and torch.equal(got, apply_token_bitmask(logits, ordered, bitmask)):
        return (
            f"bitmask row a is the mask of logits row rows[a], in the order of rows (here {constrained}): your answer "
            f"paired the masks with the rows sorted ({ordered.tolist()})\n(on {case})"
        )
    changed = [row for row in free if not torch.equal(got[row], logits[row])]
    if changed:
        return (
            f"row {changed[0]} is not in rows (its request has no grammar): return it exactly as it was; only the "
            f"rows in `rows` are masked\n(on {case}: rows {constrained}, your row {changed[0]} changed)"
        )
    if torch.equal(got, logits) and not bool(_allowed(bitmask, vocab).all()):
        return (
            "your answer masked nothing: every logit came back as it was. Indexing with a tensor of rows makes a copy: "
            "out[rows].masked_fill_(...) or out[rows][mask] = ... changes that copy, not out; assign the rows instead, "
            f"out[rows] = torch.where(allowed, logits[rows], -inf)\n(on {case})"
        )
    mine, theirs = got[rows], logits[rows]  # (A, V)
    filled = (mine != theirs) & (mine != float("-inf"))
    if filled.any():
        a, token = (int(i) for i in filled.nonzero()[0])
        value = float(mine[a, token])
        where = f"row {constrained[a]}, token {token}: {float(theirs[a, token]):.4g} became {value:.4g} (on {case})"
        if not _allowed(bitmask, vocab)[a, token]:
            if value == 0:
                return (
                    "a token the bitmask does not allow must get -inf, not 0: 0 is a logit like any other, above "
                    f"every negative one, so the sampler may still pick it\n{where}"
                )
            return (
                f"a token the bitmask does not allow must get -inf, not a finite {value:.4g}: only -inf leaves it "
                f"probability 0 at every temperature (and the sampler's top-k/top-p treat -inf as masked)\n{where}"
            )
        return f"a token the bitmask allows keeps its logit exactly as it was\n{where}"
    kept = mine != float("-inf")  # (A, V): every entry is now either the logit or -inf
    allowed = _allowed(bitmask, vocab)
    if torch.equal(kept, _reversed_bits(bitmask, vocab)) or torch.equal(kept, _reversed_bits_in_bytes(bitmask, vocab)):
        return (
            "bit order: token 32 * w + i is bit i of word w counted from the least significant bit, (word >> i) & 1; "
            f"your answer read the bits from the other end of the word (or of each byte)\n(on {case})"
        )
    wrong = (kept != allowed).nonzero()
    a, token = (int(i) for i in wrong[0])
    word = int(bitmask[a, token // 32]) & 0xFFFF_FFFF
    where = (
        f"row {constrained[a]}, token {token}: bit {token % 32} of word {token // 32} (0x{word:08X}) is "
        f"{int(allowed[a, token])}, yet your answer {'kept' if kept[a, token] else 'masked'} it (on {case})"
    )
    tokens = wrong[:, 1]
    if bool((tokens % 32 == 31).all()):
        return (
            "bit 31 of an int32 word is its sign bit: a word with token 32 * w + 31 allowed is negative, and "
            f"(word >> 31) & 1 is 1 for it (the shift is arithmetic); a test like word > 0 misses it\n{where}"
        )
    if vocab % 32 and bool((tokens >= vocab // 32 * 32).all()):
        return (
            f"the vocabulary ({vocab} tokens) ends inside word {vocab // 32}, which holds tokens "
            f"{vocab // 32 * 32}..{vocab - 1}: use all ceil(V / 32) words, and the first V bits of them\n{where}"
        )
    return f"row rows[a] keeps exactly the tokens whose bit is set in bitmask[a], and only those\n{where}"


def check_apply_token_bitmask(fn: Callable, *, seed: int | None = None, engine: bool = True) -> None:
    """`fn(logits, rows, bitmask)` against nanoref's on worked and fresh random cases, then the built-in model with
    it in place on constrained and unconstrained requests (`engine=False`: the first part only)."""
    generator = input_generator(seed)
    for case, logits, rows, bitmask in _cases(generator):
        given = logits.clone(), rows.clone(), bitmask.clone()
        got = call_learner(fn, "apply_token_bitmask", *given, case=case, hint=_error_hint)
        for name, before, after in zip(("logits", "rows", "bitmask"), (logits, rows, bitmask), given):
            if not torch.equal(before, after):
                raise ExerciseFailure(
                    f"your apply_token_bitmask changed {name} in place: return a new tensor and leave every input as "
                    "it was (the caller still holds the model's logits)\n"
                    f"(on {case})"
                )
        expect_tensor(got, f"apply_token_bitmask on {case}", tuple(logits.shape), logits.dtype)
        if not torch.equal(got, apply_token_bitmask(logits, rows, bitmask)):
            raise ExerciseFailure(_diagnose(logits, rows, bitmask, got, case))
    if engine:
        check_structured_generation({"apply_token_bitmask": fn})


# -- the engine run -----------------------------------------------------------------------------------------------
SCHEMA = {  # properties named in alphabetical order: the order the output writes them in
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["age", "name"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){2}"
CHOICES = ["Beautiful", "Explicit", "Simple", "Sparse"]


def structured_requests() -> list[tuple[str, str, dict]]:
    """(what, prompt, SamplingParams settings): a JSON schema greedy, an unconstrained request between the
    constrained ones, a regex and a choice sampled with seeds."""
    from nanoref import StructuredOutputsParams

    def constrained(**constraint: Any) -> StructuredOutputsParams:
        return StructuredOutputsParams(**constraint)

    return [
        ("a JSON schema, greedy", "Reply in JSON:", dict(temperature=0, max_tokens=48,
         structured_outputs=constrained(json=SCHEMA, disable_any_whitespace=True))),
        ("no constraint, greedy", "Beautiful is better than", dict(temperature=0, max_tokens=16)),
        ("a regex, sampled", "Flat is", dict(temperature=0.8, seed=3, max_tokens=24,
         structured_outputs=constrained(regex=REGEX))),
        ("a choice, sampled", "Errors should never", dict(temperature=1.0, seed=5, n=2, max_tokens=8,
         structured_outputs=constrained(choice=CHOICES))),
    ]  # fmt: skip


def _follows(what: str, text: str) -> bool:
    """Whether nanoref's own output follows its request's constraint (the check's own setup, not the learner's)."""
    if what.startswith("a JSON"):
        value = json.loads(text)
        return set(value) == {"age", "name"} and isinstance(value["age"], int) and isinstance(value["name"], str)
    if what.startswith("a regex"):
        return re.fullmatch(REGEX, text) is not None
    if what.startswith("a choice"):
        return text in CHOICES
    return True


# the built-in model's engine and nanoref's own outputs of structured_requests, made once per process (a list: no
# module name is rebound after import, see nanoref.exercises.integrity)
_BUILT_IN: list[tuple[Any, list, list[list[list[int]]]]] = []


def _samples(output: dict) -> list[dict]:
    return output["outputs"] if "outputs" in output else [output]


def _built_in() -> tuple[Any, list, list[list[list[int]]]]:
    from nanoref import LLM, SamplingParams

    if not _BUILT_IN:
        llm = LLM(dtype="float32", num_kvcache_blocks=64, seed=0)  # (on a GPU the learner's function runs there)
        requests = structured_requests()
        outputs = llm.generate([p for _, p, _ in requests], [SamplingParams(**s) for *_, s in requests], use_tqdm=False)
        for (what, _, _), output in zip(requests, outputs):
            for sample in _samples(output):
                if not _follows(what, sample["text"]):
                    raise AssertionError(f"nanoref's own output for {what} breaks its constraint: {sample['text']!r}")
        reference = [[sample["token_ids"] for sample in _samples(output)] for output in outputs]
        _BUILT_IN.append((llm, requests, reference))
    return _BUILT_IN[0]


def check_structured_generation(functions: dict[str, Callable]) -> None:
    """The built-in model with the learner's `functions` in place on one batch of constrained requests (a JSON
    schema, a regex, a choice) and an unconstrained one: every sample's tokens must be those nanoref's own mask
    gives; apply_token_bitmask must have run."""
    from nanoref import SamplingParams

    llm, requests, reference = _built_in()
    names = describe(functions)
    calls = [0]
    mask = functions.get("apply_token_bitmask")
    if mask is not None:

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return mask(*args, **kwargs)

        functions = {**functions, "apply_token_bitmask": counted}
    params = [SamplingParams(**settings) for *_, settings in requests]
    outputs = run_with(llm, functions, [prompt for _, prompt, _ in requests], params)
    tokenizer = llm.tokenizer
    for (what, prompt, _), output, want in zip(requests, outputs, reference):
        for index, (sample, expected) in enumerate(zip(_samples(output), want)):
            got = sample["token_ids"]
            if got != expected:
                position = next(
                    (i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))
                )
                which = f" (sample {index})" if len(want) > 1 else ""
                theirs = tokenizer.decode(expected, skip_special_tokens=True)
                raise ExerciseFailure(
                    f"with {names} in the engine, {prompt!r} under {what}{which} writes {sample['text']!r} where "
                    f"nanoref's own mask writes {theirs!r}: they part at output position {position}"
                )
    if mask is not None and not calls[0]:
        raise AssertionError("the engine never called apply_token_bitmask: the check's setup is wrong, not yours")
