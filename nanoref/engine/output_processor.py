"""The output stage: what a caller sees of the tokens the engine samples (as vLLM v1's output processor).

The core appends tokens and decides EOS, stop ids and lengths; everything else a caller reads is built here:
each sample's place among its request's n (`index`) and the caller's name for it (`request_id`), its text as it
grows (an `IncrementalDetokenizer`, only where something reads it as it grows: a stream, or stop strings), the
stop strings matched on that text, its logprobs and its prompt's, and the outputs themselves: `generate`'s dicts,
`stream`'s pieces, the engine loop's deltas, and the `RequestOutput`s AsyncLLM builds from them where its caller is
(`RequestOutputs`). Each sequence carries its `SampleOutput` as `seq.output`.

Prompt logprobs (`SamplingParams.prompt_logprobs`) score the tokens the model was given: prompt token t + 1 on the
logits of the row of token t, in every prefill chunk of the prompt (engine/sampling_inputs.py's `split_logits`).
A position the prefix cache serves is never computed, so it could not be scored: such a request's samples get a
`cache_salt` of their own (the cache then shares blocks only among them: its samples 1..n-1 reuse sample 0's
prompt, and sample 0 alone scores it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from nanoref.engine.detokenizer import IncrementalDetokenizer, add_many, decode, hidden_stop_tokens
from nanoref.engine.metrics import RequestMetrics
from nanoref.engine.requests import check_request_id, eos_token_ids
from nanoref.engine.sequence import Sequence
from nanoref.layers.logits_processors import StepLogprobs, TokenLogprobs
from nanoref.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoref.config import EngineConfig


class Logprob(NamedTuple):
    """vLLM's: one candidate token's log-probability, its rank (1: the most likely) and its text."""

    logprob: float
    rank: int | None
    decoded_token: str | None = None


def vllm_logprobs(entry: TokenLogprobs | None, token_text: Callable[[int], str | None]) -> dict[int, Logprob] | None:
    """One position's logprobs in vLLM's form: {token id: Logprob} for the chosen token, first, then the top N
    ranked 1..N (a chosen token among them keeps the first place, with its top-N rank), as vLLM builds it.
    token_text: a token's text (`token_texts`)."""
    if entry is None:
        return None
    found = {entry.token_id: Logprob(entry.logprob, entry.rank, token_text(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top.items(), start=1):
        found[token_id] = Logprob(
            logprob, rank, found[token_id].decoded_token if token_id in found else token_text(token_id)
        )
    return found


class VllmLogprobs:
    """vLLM's form of a list of TokenLogprobs, made on first read: made eagerly, decoding every listed token's text
    took 0.23 s beside a 1.0 s `generate` (32 requests x 128 tokens, logprobs=20, the built-in model on this CPU),
    which a caller who reads the dicts' own "logprobs" never needs. Pickled, the converted lists travel and the
    output stage's decoder stays behind."""

    token_text: Callable[[int], str | None] | None = None  # the output stage's `token_text`
    _converted: dict[str, list | None]

    def _vllm_form(self, key: str) -> list[dict[int, Logprob] | None] | None:
        converted = self.__dict__.setdefault("_converted", {})
        if key not in converted:
            entries = self.get(key)
            text = self.token_text or (lambda token_id: None)
            converted[key] = None if entries is None else [vllm_logprobs(entry, text) for entry in entries]
        return converted[key]

    def __getstate__(self) -> dict:
        for key in self._keys:
            self._vllm_form(key)
        return {name: value for name, value in self.__dict__.items() if name != "token_text"}


class CompletionOutput(VllmLogprobs, dict):
    """One sample of a finished request as `generate` returns it: a dict ("text", "token_ids", "finish_reason"; with
    stop strings "stop_reason", with logprobs "logprobs": a TokenLogprobs per token), which reads as vLLM's
    CompletionOutput too: `.index`, `.text`, `.token_ids`, `.finish_reason`, `.stop_reason` (the stop string or stop
    token id that ended it, else None), `.logprobs` (vLLM's form: per token, {token id: Logprob} of the chosen token
    and the top N; None where not asked for), `.cumulative_logprob`, `.finished()`."""

    stop_reason: int | str | None = None
    lora_request: Any = (
        None  # vLLM's: the LoRARequest the request ran under (LLM.generate sets it), None: the base model
    )
    _keys = ("logprobs",)

    @property
    def index(self) -> int:
        return self.get("index", 0)

    @property
    def text(self) -> str | None:
        return self["text"]

    @property
    def token_ids(self) -> list[int]:
        return self["token_ids"]

    @property
    def finish_reason(self) -> str | None:
        return self["finish_reason"]

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self._vllm_form("logprobs")

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' logprobs (vLLM's; None where logprobs were not asked for)."""
        entries = self.get("logprobs")
        return None if entries is None else sum(entry.logprob for entry in entries)

    def finished(self) -> bool:
        return self["finish_reason"] is not None


class GenerateOutput(VllmLogprobs, dict):
    """A finished request as `generate` returns it: a dict of its sample 0 (`CompletionOutput`'s keys; "outputs"
    with every sample's when n > 1; "prompt_logprobs" where asked for), which reads as vLLM's RequestOutput too, so
    code written for vLLM's `LLM.generate` runs: `.outputs` (every sample's CompletionOutput, n >= 1),
    `.request_id`, `.prompt` (the text, where the prompt was given as text, else None), `.prompt_token_ids`,
    `.prompt_logprobs` (vLLM's form: None for the first token, then {token id: Logprob}), `.finished`, `.metrics`,
    `.num_cached_tokens`, `.lora_request`."""

    outputs: list[CompletionOutput]
    request_id: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # its prompt tokens the prefix cache served (sample 0's, when first admitted: vLLM's)
    lora_request: Any = (
        None  # vLLM's: the LoRARequest the request ran under (LLM.generate sets it), None: the base model
    )
    finished = True
    _keys = ("prompt_logprobs",)

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        return self._vllm_form("prompt_logprobs")

    @property
    def metrics(self):
        return self.get("metrics")


@dataclass(eq=False)
class SampleOutput:
    """What the output stage keeps for one sample."""

    index: int = 0  # which of its request's n samples it is
    request_id: str | None = None  # the caller's name for the request (the server's id), if it gave one
    # its completion as text, kept up to date token by token where something reads it as it grows (None: offline
    # generate decodes each completion once, at the end)
    detokenizer: IncrementalDetokenizer | None = None
    # one entry per completion token where SamplingParams.logprobs asks for them; the step that sampled the next
    # token leaves its (step's logprobs, row index, N) in `pending_logprobs` for `on_token` to read
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    pending_logprobs: tuple[StepLogprobs, int, int] | None = None
    # where SamplingParams.prompt_logprobs asks (sample 0): the prompt positions scored so far (position 0 has no
    # tokens before it to be scored on) and each prefill chunk's scores, (the step's, its first row among them, rows)
    num_prompt_scored: int = 1
    prompt_scores: list[tuple[StepLogprobs, int, int]] = field(default_factory=list)
    # a constraint on which tokens may come next, given by whoever made the request (LLM: a grammar's matcher):
    # `allowed()` -> the tokens it allows next as a packed bitmask, (ceil(V / 32),) int32, read by the sampling
    # inputs; `accept(token_id)` -> whether the sample is complete after it, called here on every token
    constraint: Any = None
    # SamplingParams.bad_words as token ids (`bad_words_token_ids`), shared by the request's samples
    bad_words_ids: list[list[int]] = field(default_factory=list)


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's tokens as vLLM bans them: the word as written (its leading blanks stripped), and with one
    leading space where that begins with another token in as many tokens (the word in the middle of a text)."""
    banned = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        banned.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            banned.append(spaced)
    return banned


@dataclass
class StreamPiece:
    """What one step added to one sample of a streamed request (`LLMEngine.stream`)."""

    text: str  # the new text ("" while a character, or a possible stop string, is still incomplete)
    token_ids: list[int]  # the new tokens
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    index: int = 0  # which of the request's n samples


class OutputProcessor:
    def __init__(self, tokenizer, config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.no_tokenizer = config.no_tokenizer  # (the start of an error where a request needs one)
        # the samples 1..n-1 of a request with n > 1, by its sample 0, queued once sample 0's prompt is computed
        # (then its full prompt blocks are in the prefix cache, and they share them instead of prefilling again)
        self.held_samples: dict[Sequence, list[Sequence]] = {}
        # the EOS ids whose text a completion leaves out whatever skip_special_tokens says (`hidden_stop_tokens`): the
        # model config's and the tokenizer's (the scheduler stops on the same ones)
        self.eos_token_ids: set[int] = eos_token_ids(config, tokenizer)
        self.token_text = token_texts(tokenizer)  # a token's text alone (vLLM's Logprob.decoded_token)
        # None: a sample whose text `on_token` cannot make (a tokenizer that raises on decoding its tokens) fails the
        # step it is in. A dict (the server's engine loop sets one): such a sample ends there (finished, its blocks go
        # back with the step) and waits here, with the error, for the loop to fail its request alone
        self.output_errors: dict[Sequence, Exception] | None = None
        # the samples of streams closed inside an engine call on the engine's own thread (the garbage collector,
        # mid-step: engine/streaming.py), aborted once the step is done (`LLMEngine.queue_held_samples`)
        self.abandoned: list[Sequence] = []

    # -- n samples ------------------------------------------------------------------------------
    def hold(self, samples: list[Sequence]) -> list[Sequence]:
        """Hold a request's samples 1..n-1 until its sample 0 (queued now) has computed its prompt -> those not held:
        a sample whose cache salt differs from sample 0's could never read its blocks, so it waits for nothing."""
        first, rest = samples[0], samples[1:]
        held = [seq for seq in rest if seq.cache_salt == first.cache_salt]
        if held:
            self.held_samples[first] = held
        return [seq for seq in rest if seq.cache_salt != first.cache_salt]

    def ready_samples(self) -> list[Sequence]:
        """The held samples to queue now: those whose sample 0 has computed its prompt (or finished: then there is
        nothing to wait for)."""
        ready = [first for first in self.held_samples if first.num_completion_tokens or first.is_finished]
        return [seq for first in ready for seq in self.held_samples.pop(first)]

    def drop_held(self, seqs: list[Sequence] | None = None) -> list[Sequence]:
        """Drop these samples (None: all) from the held ones -> those that were held (never queued)."""
        dropped = []
        for first, held in list(self.held_samples.items()):
            dropped += [seq for seq in held if seqs is None or seq in seqs]
            held[:] = [seq for seq in held if seqs is not None and seq not in seqs]
            if not held:
                del self.held_samples[first]
        return dropped

    def attach(self, samples: list[Sequence], request_id: str | None, stream: bool) -> None:
        """Give a request's samples their outputs. stream: keep each one's text up to date after every step (for a
        caller that shows it as it grows); a request with stop strings gets that either way."""
        check_request_id(request_id)
        stop, bad_words = samples[0].sampling_params.stop_strings, samples[0].sampling_params.bad_words
        text = stream and samples[0].sampling_params.detokenize  # (detokenize=False streams token ids alone)
        if (text or stop or bad_words) and self.tokenizer is None:
            need = "a stream of text" if text else "stop strings" if stop else "bad_words"
            hint = " (token ids only: detokenize=False)" if text else ""  # (AsyncLLM's words: check_needs_no_tokenizer)
            raise ValueError(f"{self.no_tokenizer}: {need} needs one{hint}")
        banned = bad_words_token_ids(self.tokenizer, bad_words) if bad_words else []
        if samples[0].sampling_params.prompt_logprobs is not None:  # every prompt position computed (see above)
            salt = ("prompt_logprobs", samples[0].seq_id, samples[0].cache_salt)
            for seq in samples:
                seq.cache_salt = salt
        for index, seq in enumerate(samples):
            params = seq.sampling_params
            detokenizer = None
            if (stream or stop) and params.detokenize:  # (stop strings need text: never without detokenize)
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                    hidden_stop_tokens(params, self.eos_token_ids),
                )
            seq.output = SampleOutput(index, request_id, detokenizer, bad_words_ids=banned)

    def on_token(self, seq: Sequence) -> bool:
        """seq just appended a token: take its logprobs and text, advance its constraint -> whether a stop string ends
        it there (then its text is cut before it, and the string is `seq.stop_reason`) or its constraint is complete.
        Stop strings count once the completion is longer than min_tokens, as in vLLM: the token after the first
        min_tokens can complete one (it may begin in their text); find_stop looks only at the text this token brought
        (and the characters before it that a stop string could straddle)."""
        out = seq.output
        if out is None:
            return False
        if out.pending_logprobs is not None:
            step, index, num_top = out.pending_logprobs
            out.pending_logprobs = None
            out.logprobs.append(step.entry(index, num_top))
        complete = out.constraint is not None and out.constraint.accept(seq.last_token)
        if out.detokenizer is None:
            return complete
        try:
            out.detokenizer.add([seq.last_token])
            counts = seq.num_completion_tokens > seq.sampling_params.min_tokens
            stopped = counts and out.detokenizer.find_stop() is not None
        except Exception as error:
            if self.output_errors is None:
                raise
            self.output_errors[seq] = error
            return True
        if stopped:
            seq.stop_reason = out.detokenizer.stop_reason
            return True
        return complete

    @staticmethod
    def text_so_far(seq: Sequence) -> str:
        """A streamed sample's text so far (its final text once it finished: whatever was held back is released);
        "" for a request with detokenize=False."""
        detokenizer = seq.output.detokenizer
        if detokenizer is None:
            return ""
        if seq.is_finished:
            detokenizer.finish()  # (again, if it was already: nothing is held back any more)
        return detokenizer.text

    def decode(self, params, token_ids: list[int]) -> str:
        """A whole completion's text, decoded as its SamplingParams ask (skip_special_tokens, ...)."""
        hidden = hidden_stop_tokens(params, self.eos_token_ids)
        shown = [t for t in token_ids if t not in hidden] if hidden else token_ids
        return decode(self.tokenizer, shown, params.skip_special_tokens, params.spaces_between_special_tokens)

    def output(self, seq: Sequence, metrics=None, index: int | None = None) -> CompletionOutput:
        """A finished sample as `generate` returns it; metrics: its RequestMetrics, if asked for; index: its place
        among its request's samples, kept as the first key (generate's "outputs" entries have one)."""
        token_ids = seq.completion_token_ids
        if seq.output.detokenizer is not None:  # its text as it grew, so the stream and generate agree
            text = self.text_so_far(seq)  # (cut at its stop string, if one matched)
        elif not seq.sampling_params.detokenize:
            text = ""
        else:
            text = None if self.tokenizer is None else self.decode(seq.sampling_params, token_ids)
        output = CompletionOutput() if index is None else CompletionOutput(index=index)
        output.update(text=text, token_ids=token_ids, finish_reason=seq.finish_reason)
        if seq.sampling_params.stop is not None:
            output["stop_reason"] = seq.stop_reason
        if seq.sampling_params.logprobs is not None:
            output["logprobs"] = seq.output.logprobs  # one TokenLogprobs per completion token
        if metrics is not None:
            output["metrics"] = metrics
        output.stop_reason, output.token_text = seq.stop_reason, self.token_text_for(seq.sampling_params)
        return output

    def token_text_for(self, params: SamplingParams) -> Callable[[int], str | None]:
        """What gives a request's logprobs their decoded_token: `token_text`, or None for each with detokenize=False
        (vLLM's)."""
        return self.token_text if params.detokenize else lambda token_id: None

    @staticmethod
    def prompt_logprobs(seq: Sequence) -> list[TokenLogprobs | None] | None:
        """A request's prompt logprobs (seq: its sample 0), once its whole prompt is scored: None for the first
        token (nothing before it), then one TokenLogprobs per prompt token (its logprob and rank given the tokens
        before it, and the top N at its position). None where the request did not ask, for samples 1..n-1, and
        for a request that ended before its prompt was computed."""
        out = seq.output
        asked = seq.sampling_params.prompt_logprobs is not None and out.index == 0
        if not asked or out.num_prompt_scored < seq.num_prompt_tokens:
            return None
        num_top = seq.sampling_params.prompt_logprobs
        scores = [
            scores.entry(row, num_top)
            for scores, first, count in out.prompt_scores
            for row in range(first, first + count)
        ]
        return [None, *scores]

    def request_output(
        self, samples: list[Sequence], metrics: dict | None = None, prompt: str | None = None
    ) -> GenerateOutput:
        """A finished request as `generate` returns it: sample 0's output, with "outputs" when n > 1, and
        "prompt_logprobs" where SamplingParams.prompt_logprobs asks (see `prompt_logprobs`); it also reads as vLLM's
        RequestOutput (`GenerateOutput`). metrics: the engine's RequestMetrics by seq_id, to include them; prompt:
        the prompt's text, where it was given as text."""

        def one(seq: Sequence, index: int | None = None) -> CompletionOutput:
            return self.output(seq, None if metrics is None else metrics[seq.seq_id], index)

        first = samples[0]
        completions = [one(first)] if len(samples) == 1 else [one(seq, seq.output.index) for seq in samples]
        output = GenerateOutput({key: value for key, value in completions[0].items() if key != "index"})
        if first.sampling_params.prompt_logprobs is not None:
            output["prompt_logprobs"] = self.prompt_logprobs(first)
        if len(samples) > 1:
            output["outputs"] = completions
        output.outputs = completions
        output.request_id = first.output.request_id if first.output.request_id is not None else str(first.seq_id)
        output.prompt = prompt
        output.prompt_token_ids = first.token_ids[: first.num_prompt_tokens]
        output.num_cached_tokens = first.num_prefix_hit_tokens
        output.token_text = self.token_text_for(first.sampling_params)
        return output

    def pieces(self, sent: dict[Sequence, list[int]]) -> list[StreamPiece]:
        """What each streamed sample added since its last piece; sent: seq -> [tokens, characters] already given
        (updated here; a finished sample leaves it with its last piece)."""
        pieces = []
        for seq, counts in list(sent.items()):
            tokens = seq.token_ids[seq.num_prompt_tokens + counts[0] :]
            text = self.text_so_far(seq)[counts[1] :]
            if tokens or text or seq.is_finished:
                counts[0] += len(tokens)
                counts[1] += len(text)
                if seq.is_finished:
                    del sent[seq]
                pieces.append(StreamPiece(text, tokens, seq.is_finished, seq.finish_reason, seq.output.index))
        return pieces


# -- the engine loop's deltas, and the outputs its caller builds from them ----------------------------------
class SampleDelta(NamedTuple):
    """What one sample of a request made since its previous delta (a tuple: cheap to pickle, hundreds a step)."""

    key: int
    index: int  # which of the request's n samples
    token_ids: list[int]
    # with stop strings: the engine's new text ("" while a character or a possible stop string is held back);
    # None without: the receiver decodes token_ids itself
    text: str | None
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs]
    metrics: RequestMetrics | None  # on a served (not aborted) sample's last delta
    # where SamplingParams.prompt_logprobs asks: the request's, on sample 0's first delta (OutputProcessor's
    # prompt_logprobs: None for the first prompt token, then one entry per prompt token)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # the request's prompt tokens the prefix cache served (sample 0's first admission)


@dataclass
class RequestOutput:
    """What one sample of a request made since its previous output (the delta), and everything it made so far.

    A request with n > 1 streams its samples' outputs interleaved, each with its `index`; `finished` is that
    sample's, and the request is done when each of its n samples has sent a finished output."""

    request_id: str
    text: str  # new text since the previous output ("" while a character or a possible stop string is held back)
    token_ids: list[int]  # new token ids since the previous output
    cumulative_text: str
    cumulative_token_ids: list[int]
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    metrics: RequestMetrics | None = None  # on the last output of a request that was served (not aborted)
    index: int = 0  # which of the request's n samples
    # the stop string or stop_token_ids entry that ended it ("stop"); None for EOS, length and abort
    stop_reason: int | str | None = None
    # one entry per token of `token_ids` where SamplingParams.logprobs asked for them, else empty
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # the request's prompt (the same list in each of its outputs)
    # where SamplingParams.prompt_logprobs asked: the request's, on sample 0's first output (None for the first
    # prompt token, then each prompt token's TokenLogprobs, as `LLM.generate`'s "prompt_logprobs"); else None.
    # `prompt_logprobs` reads them in vLLM's form
    prompt_token_logprobs: list[TokenLogprobs | None] | None = None
    prompt: str | None = None  # the request's prompt, where it was given as text (vLLM's RequestOutput.prompt)
    # vLLM's: the request's prompt tokens the prefix cache served, fixed when it was first scheduled
    num_cached_tokens: int = 0
    lora_request: Any = None  # vLLM's: the LoRARequest it runs under (AsyncLLM.generate's), None: the base model
    # what `outputs` reads: the sample's logprobs so far (the first `num_logprobs_so_far` of a list that grows; None:
    # not asked for) and the tokens' texts (vLLM's decoded_token)
    logprobs_so_far: list[TokenLogprobs] | None = field(default=None, repr=False)
    num_logprobs_so_far: int = field(default=0, repr=False)
    token_text: Callable[[int], str | None] | None = field(default=None, repr=False, compare=False)

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's RequestOutput.prompt_logprobs: `prompt_token_logprobs` in vLLM's form, None for the first prompt
        token, then {token id: Logprob} of the prompt token and the top N (None where not asked for, and on every
        output but sample 0's first)."""
        if self.prompt_token_logprobs is None:
            return None
        text = self.token_text or (lambda token_id: None)
        return [vllm_logprobs(entry, text) for entry in self.prompt_token_logprobs]

    @property
    def outputs(self) -> list[CompletionOutput]:
        """This output as vLLM's AsyncLLM gives it by default (RequestOutputKind.CUMULATIVE): a list of this
        sample's CompletionOutput, its whole text, token ids and logprobs so far (`.outputs[0].text`), its
        finish_reason and stop_reason once it finished. (A request with n > 1 gives one sample's per output.)"""
        output = CompletionOutput(index=self.index, text=self.cumulative_text, token_ids=self.cumulative_token_ids)
        output["finish_reason"] = self.finish_reason
        if self.logprobs_so_far is not None:
            output["logprobs"] = self.logprobs_so_far[: self.num_logprobs_so_far]
        output.stop_reason, output.token_text = self.stop_reason, self.token_text
        output.lora_request = self.lora_request
        return [output]

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same sample as one (a consumer that fell behind reads both at once)."""
        # the later one's state (cumulative text, finish, metrics), with both deltas
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs,
            prompt_token_logprobs=self.prompt_token_logprobs or later.prompt_token_logprobs,
        )


class RequestOutputs:
    """One request's outputs where its caller reads them (AsyncLLM's receiving thread, which may be in another
    process than the engine): each sample's tokens and text so far, grown from the engine's deltas. A delta without
    text (a request without stop strings) is decoded here, in `delta_texts`: the engine's step never waits for it."""

    def __init__(
        self,
        request_id: str,
        num_samples: int,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: set[int],
        prompt_token_ids: list[int] | None = None,
        prompt: str | None = None,
        lora_request: Any = None,
    ) -> None:
        self.request_id, self.prompt_token_ids, self.prompt = request_id, prompt_token_ids, prompt
        self.lora_request = lora_request
        self.token_ids: list[list[int]] = [[] for _ in range(num_samples)]  # each sample's tokens so far
        self.texts = [""] * num_samples  # and its text
        # and its logprobs, where asked for (`RequestOutput.outputs` reads them)
        self.logprobs = None if params.logprobs is None else [[] for _ in range(num_samples)]
        self.token_text = token_texts(tokenizer) if params.detokenize else None
        hidden = hidden_stop_tokens(params, eos_token_ids)
        self.detokenizers = [
            IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                hidden=hidden,
            )
            for _ in range(num_samples if params.detokenize else 0)  # (without: every delta's text is "")
        ]

    def output(self, delta: SampleDelta, text: str) -> RequestOutput:
        """The sample's next output: the delta, its new text (see `delta_texts`) and, around them, everything the
        sample made so far."""
        tokens = self.token_ids[delta.index]
        tokens.extend(delta.token_ids)
        self.texts[delta.index] += text
        logprobs = None if self.logprobs is None else self.logprobs[delta.index]
        if logprobs is not None:
            logprobs.extend(delta.logprobs)
        return RequestOutput(
            request_id=self.request_id,
            text=text,
            token_ids=delta.token_ids,
            cumulative_text=self.texts[delta.index],
            cumulative_token_ids=list(tokens),
            num_prompt_tokens=delta.num_prompt_tokens,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            metrics=delta.metrics,
            index=delta.index,
            stop_reason=delta.stop_reason,
            logprobs=delta.logprobs,
            prompt_token_ids=self.prompt_token_ids,
            prompt_token_logprobs=delta.prompt_logprobs,
            prompt=self.prompt,
            num_cached_tokens=delta.num_cached_tokens,
            lora_request=self.lora_request,
            logprobs_so_far=logprobs,
            num_logprobs_so_far=0 if logprobs is None else len(logprobs),
            token_text=self.token_text,
        )


def token_texts(tokenizer: Any) -> Callable[[int], str | None]:
    """A token's text alone (vLLM's `Logprob.decoded_token`), decoded once per id; None without a tokenizer."""
    if tokenizer is None:
        return lambda token_id: None
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = tokenizer.decode([token_id])
        return texts[token_id]

    return text


def delta_texts(live: list[tuple[RequestOutputs, SampleDelta]]) -> list[str | Exception]:
    """Each delta's new text: the engine's (a request with stop strings), else decoded here, every stream's new
    tokens in one batched decode (`add_many`: a Rust call that lets the event loop run meanwhile). Where the
    tokenizer cannot decode a request's tokens, that delta's entry is the error: the batch is decoded again one
    delta at a time (a failed `add_many` changed nothing), so only the request at fault fails."""
    texts: list[str | Exception | None] = [delta.text for _, delta in live]
    undecoded = [i for i, text in enumerate(texts) if text is None]
    detokenizers = [live[i][0].detokenizers[live[i][1].index] for i in undecoded]
    token_lists = [live[i][1].token_ids for i in undecoded]
    try:
        pieces: list[str | Exception] = add_many(detokenizers, token_lists)
    except Exception:
        pieces = [_or_error(_add_one, detokenizer, ids) for detokenizer, ids in zip(detokenizers, token_lists)]
    for i, detokenizer, piece in zip(undecoded, detokenizers, pieces):
        if live[i][1].finished and not isinstance(piece, Exception):  # (finish: the held-back rest)
            rest = _or_error(detokenizer.finish)
            piece = rest if isinstance(rest, Exception) else piece + rest
        texts[i] = piece
    return texts


def _add_one(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> str:
    return add_many([detokenizer], [token_ids])[0]  # (unlike `add`, it changes nothing when the decode raises)


def _or_error(fn: Callable, *args: Any) -> Any:
    """fn(*args), or the Exception it raised."""
    try:
        return fn(*args)
    except Exception as error:
        return error
