"""Per-request sampling settings, checked when they are made (and again by the engine)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from nanoref.utils.text import check_text

_INT64_MAX = 2**63 - 1  # top_k travels to the sampler as an int64 tensor
# torch.Generator.manual_seed's seeds: [-2**63, 2**64), a negative one taken as 2**64 + seed (its two's complement),
# as vLLM hands its seeds to torch
_SEED_MIN, _SEED_LIMIT = -(2**63), 2**64
# positions and sequence lengths travel to the device as int32: no sequence can ever be longer, so a larger
# max_tokens is a mistake, not a wish (generation also stops at the engine's max_model_len, as in vLLM)
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass
class StructuredOutputsParams:
    """What a request's output must be, as vLLM spells it: exactly one of

    json: a JSON schema (a dict, its JSON text, or a pydantic model class: its schema) the output is an instance of.
    regex: a regular expression the whole output matches.
    choice: a list of strings; the output is exactly one of them.
    grammar: an EBNF grammar (GBNF style, its start rule `root`) the output is a sentence of; or a Lark grammar (its
        start rule `start`), as vLLM reads one: a grammar none of whose lines defines a rule with `::=`.
    json_object: True: the output is any JSON object.

    disable_any_whitespace: JSON (json, json_object) with fixed separators (", ", ": ") and no other whitespace.
    The constraint is a mask on each step's logits (nanoref/structured_output.py): tokens that would leave the
    grammar get -inf, and the request ends ("stop") once the grammar is complete.
    """

    json: str | dict | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def validate(self) -> None:
        """Raise ValueError unless exactly one constraint is given, each of its type (whether the library accepts
        the schema, regex or grammar is checked when the request is made: `LLM.make_samples`)."""
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(CONSTRAINTS)}, got "
                f"{', '.join(given) if given else 'none'}"
            )
        value = getattr(self, given[0])
        if given[0] == "json" and not (
            isinstance(value, (str, dict)) or (isinstance(value, type) and hasattr(value, "model_json_schema"))
        ):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {value!r:.80}")
        if given[0] in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{given[0]} must be a non-empty string, got {value!r:.80}")
        if given[0] == "choice" and (
            not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {value!r:.80}")
        if given[0] == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got {value!r:.80}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"structured_outputs.disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}"
            )


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


# keyword-only: vLLM's first field is n, nanoref's temperature, so SamplingParams(2) would mean another thing here
@dataclass(kw_only=True)
class SamplingParams:
    """One request's sampling settings, spelled and meaning what they mean in vLLM.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling; at most 2 (vLLM's and OpenAI's
        range).
    max_tokens: the most completion tokens to generate ("length" when reached); None (vLLM's spelling): as many as
        the engine's max_model_len leaves room for (stored as MAX_TOKENS_LIMIT).
    ignore_eos: keep generating past EOS (stop_token_ids still stop).
    top_k: sample among the k most likely tokens only (a token tied with the k-th stays); 0 = off (-1, vLLM's old
        "off", is taken as 0).
    top_p: sample among the smallest set of tokens whose probability reaches top_p, over the tokens top_k keeps
        (renormalised over them, as vLLM and HF do); 1.0 = off.
    min_p: sample only among tokens at least min_p times as likely as the most likely one (after the temperature,
        before top_k and top_p, as in vLLM), in [0, 1]; 0 = off.
    seed: the request draws from its own generator, so its tokens do not depend on its batch; None (or -1, vLLM's
        spelling) = the engine's. A negative seed is torch's: -5 seeds as 2**64 - 5.
    stop_token_ids: generating one of these ends the request ("stop", with `stop_reason` = that id); it stays in
        token_ids, but its text (as EOS's) is left out of the text, special token or not, unless
        include_stop_str_in_output (vLLM's rule).
    min_tokens: EOS and stop_token_ids can neither be sampled nor end the request before this many tokens; a stop
        string counts only once the completion is longer (the token after them must complete it), as in vLLM.
    presence_penalty: subtracted from the logit of every token already in the completion, in [-2, 2]; 0 = off.
    frequency_penalty: subtracted once per occurrence of a token in the completion, in [-2, 2]; 0 = off.
    repetition_penalty: HF's, on every token in prompt or completion (> 0 logits divided, others multiplied); 1 = off.
    logprobs: return the log-probabilities of the top N tokens and of the chosen one per token, N in [0, 20] (True,
        as in vLLM: 1; -1, vLLM's, every token of the vocabulary: the engine refuses it, in vLLM's words, where the
        vocabulary is larger than its max_logprobs).
    prompt_logprobs: return, for every prompt token after the first, its log-probability given the tokens before
        it and the top N at its position, N in [0, 20] (True: 1; -1 as for logprobs; an evaluation harness's score
        of a text); the prefix cache does not serve such a request's prompt (each of its positions is computed).
    stop: strings that end the completion when its text contains one ("stop"); the text is cut before it.
    include_stop_str_in_output: keep the matched stop string (or the stop token's text) at the end of the text.
    n: how many completions to sample for the prompt (sample i of a seeded request uses seed + i); greedy
        sampling (temperature 0) takes only n=1, as in vLLM (its samples would all be the same).
    truncate_prompt_tokens: use only the prompt's last k tokens (left truncation); -1: as many as max_model_len
        leaves room for one generated token (vLLM's -1 keeps max_model_len, which leaves none); None = the whole
        prompt.
    bad_words: words the completion must not contain (vLLM's rule): each word's tokens (as the tokenizer encodes it
        without its leading blanks, and with one leading space where that gives as many tokens, the first another)
        are never completed: a word of one token is never sampled, a longer one's last token never follows the rest
        of it; None = off.
    allowed_token_ids: sample only among these token ids (every other token's logit is -inf, after the penalties
        and masks, as a grammar's mask; with structured_outputs both hold, and a request where none of these ids is
        a token its grammar allows first is a ValueError); None = off.
    logit_bias: {token id: bias} added to those tokens' logits before sampling (penalties and masks come after),
        each bias any number, as vLLM takes it (OpenAI's range is [-100, 100]: +100 makes a token all but certain,
        -100 all but impossible; -inf bans it); None = off.
    skip_special_tokens: leave the tokenizer's special tokens (EOS, ...) out of the text; False shows them, except
        the token that ended the completion (EOS, a stop_token_ids entry), as in vLLM.
    spaces_between_special_tokens: let the tokenizer's decoder put its spaces between added tokens that follow one
        another (vLLM's default); False writes such a run of added tokens as their bare text (it matters only for
        decoders that add spaces, e.g. WordPiece's; byte-level BPE's, Qwen's, adds none).
    structured_outputs: a StructuredOutputsParams the output must follow (JSON schema, regex, choice, grammar);
        None = free text.
    detokenize: False: make no text (every text is "", a logprob's decoded_token None), only token ids, as vLLM's
        (its throughput benchmarks' switch); stop strings need text, so stop with it is a ValueError.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:  # (vLLM's default spelling of "none")
            self.stop_token_ids = []
        if self.max_tokens is None:  # vLLM's "until max_model_len": generation stops there anyway
            self.max_tokens = MAX_TOKENS_LIMIT
        if self.top_k == -1 and _is_int(self.top_k):  # vLLM accepts -1 as "off" (its default once): nanoref's 0
            self.top_k = 0
        if self.seed == -1 and _is_int(self.seed):  # vLLM's "no seed of its own"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM reads True as 1
            if getattr(self, name) is True:
                setattr(self, name, 1)
        self.validate()

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on: the sampler then needs the request's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits need any work between model and sampler: penalties, masks, logprobs."""
        return (
            self.min_tokens > 0
            or self.logprobs is not None
            or self.has_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.structured_outputs is not None
        )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the engine checks again: fields can be reassigned)."""
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"max_tokens must be a positive integer of at most 2**31 - 1 = {MAX_TOKENS_LIMIT} (generation also "
                f"stops at the engine's max_model_len), got {self.max_tokens!r}"
            )
        if not _is_real(self.temperature) or not 0 <= self.temperature <= 2:  # also rejects NaN (vLLM's range)
            raise ValueError(f"temperature must be in [0, 2] (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        # (-1 passes too: a field reassigned after __post_init__; the sampler reads anything below 1 as off)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT64_MAX:
            raise ValueError(f"top_k must be an integer in [0, 2**63) (0 or -1 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        check_seed(self.seed)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integer token ids, got {ids!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            limit = "" if self.max_tokens == MAX_TOKENS_LIMIT else f" = {self.max_tokens}"
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens{limit}], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}"
            )
        check_num_logprobs("logprobs", self.logprobs, "the chosen token's only")
        check_num_logprobs("prompt_logprobs", self.prompt_logprobs, "each prompt token's own only")
        if stop_strings(self.stop) and self.detokenize is False:  # (vLLM's words)
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}"
            )
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (completions per prompt) must be an integer >= 1, got {self.n!r}")
        if self.n > 1 and self.temperature == 0:  # (vLLM's words: its greedy samples would all be the same)
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        check_logit_bias(self.logit_bias)
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an integer >= 1, got {k!r:.40}")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(word, str) and word.strip() for word in words)
        ):
            raise ValueError(f"bad_words must be None or a list of non-blank strings, got {words!r:.80}")
        for word in words or ():
            check_text(word, "a bad word")
        ids = self.allowed_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids)
        ):
            raise ValueError(
                f"allowed_token_ids must be None or a non-empty list of non-negative integer token ids, got {ids!r:.80}"
            )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    f"structured_outputs must be None or a StructuredOutputsParams, got {self.structured_outputs!r:.80}"
                )
            self.structured_outputs.validate()
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
    for item in items:  # (one could never match: generated text holds none)
        check_text(item, "a stop string")
    return list(items)


def check_logit_bias(logit_bias: object) -> None:
    """Raise ValueError unless logit_bias is None or {non-negative integer token id: a number, not NaN} (the
    vocabulary's bound is the engine's check: `check_request`). Any bias is taken as given, as vLLM's SamplingParams
    takes it (OpenAI's range is [-100, 100]; -inf, or any large negative bias, bans the token)."""
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be None or a dict {{token id: bias}}, got {logit_bias!r:.80}")
    for token_id, bias in logit_bias.items():
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"logit_bias: keys must be non-negative integer token ids, got {token_id!r:.40}")
        if not _is_real(bias) or math.isnan(bias):
            raise ValueError(f"logit_bias: the bias of token {token_id} must be a number (not NaN), got {bias!r:.40}")


def check_num_logprobs(name: str, value: object, zero: str) -> None:
    """Raise ValueError unless `name` (logprobs or prompt_logprobs) is None, an integer in [0, MAX_LOGPROBS] (zero:
    what 0 asks for) or -1, vLLM's "every token of the vocabulary", which vLLM's SamplingParams takes too: the engine
    checks it, as vLLM's does, against its max_logprobs (`check_request`)."""
    if value is not None and (not _is_int(value) or not -1 <= value <= MAX_LOGPROBS):
        raise ValueError(
            f"{name} must be None, an integer in [0, {MAX_LOGPROBS}] (0 = {zero}) or -1 (every token of the "
            f"vocabulary, within the engine's max_logprobs), got {value!r}"
        )


def check_seed(seed: object) -> None:
    """Raise ValueError unless seed is None or a torch.Generator seed (a request's, or LLM(seed=...)'s)."""
    if seed is not None and (not _is_int(seed) or not _SEED_MIN <= seed < _SEED_LIMIT):
        raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {seed!r}")


def _is_int(value: object) -> bool:
    """Python or NumPy integers; not bools (True would pass as 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
