"""Per-request sampling settings, checked when they are made (and again by the engine)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

_INT64_MAX = 2**63 - 1  # top_k travels to the sampler as an int64 tensor
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed
# positions and sequence lengths travel to the device as int32: no sequence can ever be longer, so a larger
# max_tokens is a mistake, not a wish (generation also stops at the engine's max_model_len, as in vLLM)
MAX_TOKENS_LIMIT = 2**31 - 1


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean "off"; seed makes one request reproducible.

    stop: strings that end the completion when its text contains one (finish_reason "stop"); the text is cut
    before it. include_stop_str_in_output: keep the matched stop string at the end of the text.
    n: how many completions to sample for the prompt (sample i of a seeded request uses seed + i).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the engine checks again: fields can be reassigned)."""
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens must be a positive integer of at most 2**31 - 1 = {MAX_TOKENS_LIMIT} (generation also "
                f"stops at the engine's max_model_len), got {self.max_tokens!r}"
            )
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT64_MAX:
            raise ValueError(f"top_k must be an integer in [0, 2**63) (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_seed(self.seed)
        stop_strings(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}"
            )
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (completions per prompt) must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 >= _SEED_LIMIT:
            raise ValueError(f"seed + n - 1 (the last sample's seed) must be below 2**64, got seed {self.seed!r}")

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (a single string is one stop string; None is none)."""
        return stop_strings(self.stop)


def stop_strings(stop: object) -> list[str]:
    """`SamplingParams.stop` as a list of strings; ValueError for anything else or an empty string."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
    if "" in items:
        raise ValueError("stop strings must be non-empty: an empty one would match before any text")
    return list(items)


def check_seed(seed: object) -> None:
    """Raise ValueError unless seed is None or a torch.Generator seed (a request's, or LLM(seed=...)'s)."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed < _SEED_LIMIT):
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")


def _is_int(value: object) -> bool:
    """Python or NumPy integers; not bools (True would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
