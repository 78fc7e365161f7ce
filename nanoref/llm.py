"""`LLM`: the user-facing entry point, with vLLM's argument names, and the one place features attach.

The core (`nanoref/engine/`) runs the plain offline path eagerly on one device. What makes it fast or wide is
attached here, from outside, once the config is resolved: decode CUDA graphs (`nanoref/cuda_graphs.py`) on
the model runner, tensor parallelism (`nanoref/parallel/`) as the runner's subclass, and the overlapped loop
(`nanoref/overlap.py`) or the speculative loop (`nanoref/speculative/`, with a draft model's runner beside the
target's) as the engine's step loop, LoRA adapters (`nanoref/lora/hooks.py`: slots on the runner's model, an
admission rule for the scheduler, each request's adapter as its sequences' cache salt), and structured output
(`nanoref/structured_output.py`: each constrained sample's grammar matcher as its output's constraint); with
enable_prefix_caching=False each sequence's own cache salt, and with enable_chunked_prefill=False an admission rule
that starts a prompt only where the step has room for all of it.
`torch.compile` applies itself: the element-wise layers compile on their first CUDA call (`nanoref/utils/compile.py`).
On CUDA the prefill's kernels are compiled while the engine is built (`nanoref/warmup.py`), not by its first requests.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

from nanoref.cascade import CASCADE_MIN_SEQS, reads_shared_prefixes
from nanoref.cascade import attach as attach_cascade
from nanoref.config import VLLM_ALIASES, EngineConfig
from nanoref.cuda_graphs import DecodeGraphs
from nanoref.engine.chat import chat_prompt, check_chat_template, check_content_format
from nanoref.engine.hooks import EngineHooks, RunnerHooks
from nanoref.engine.kv_budget import release_freed_gpu_memory
from nanoref.engine.llm_engine import LLMEngine, PlainLoop
from nanoref.engine.model_runner import ModelRunner
from nanoref.engine.output_processor import GenerateOutput
from nanoref.engine.prefix_cache import check_reset_options, reset_prefix_cache, warn_blocks_held
from nanoref.engine.requests import check_generate_options, check_priority, prompt_list
from nanoref.engine.streaming import RequestStream
from nanoref.lora.adapters import load_adapter
from nanoref.lora.hooks import LoRAHooks, check_lora_request, lora_request_list  # (re-exported: the server)
from nanoref.lora.request import LoRARequest
from nanoref.overlap import OverlappedLoop
from nanoref.parallel.runner import TensorParallelRunner
from nanoref.parallel.state import ParallelState, end_follower_process
from nanoref.sampling_params import SamplingParams
from nanoref.speculative.loop import SpeculativeLoop
from nanoref.speculative.runner import SpeculativeRunner, unpaid_draft
from nanoref.speculative.vocabulary import check_draft_tokenizer
from nanoref.structured_output import Grammars
from nanoref.utils.progress import tqdm
from nanoref.warmup import warm_up_prefill

DEFAULT_MODEL = Path(__file__).parent / "default_model"


def grammars_for(tokenizer: Any, config: EngineConfig, eos_token_ids: Iterable[int]) -> Grammars:
    """The structured-output grammar compiler for a model's tokenizer: its stop tokens are the EOS ids in the
    vocabulary. (The server's engine-process form makes one too, on its side, to check a request's grammar.)"""
    vocab = config.hf_config.vocab_size
    return Grammars(tokenizer, vocab, sorted(t for t in eos_token_ids if t < vocab))


# what vLLM's LLM says when its pooling methods are called on a generative model (its reward goes through encode)
POOLING_REFUSALS = {
    "encode": "LLM.encode() is only supported for pooling models.",
    "embed": "Embedding API is not supported by this model.",
    "classify": "Classification API is not supported by this model.",
    "score": "LLM.score() is only supported for pooling models.",
    "reward": "LLM.encode() is only supported for pooling models.",
}


def pooling_only(name: str) -> Callable[..., Any]:
    """vLLM's LLM.<name>() for pooling models (embeddings, classification, scores, rewards): a ValueError in vLLM's
    words, where a missing method would be an AttributeError that says nothing of why."""

    def method(self: LLM, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"{POOLING_REFUSALS[name]} (LLM.{name}() is for pooling models; nanoref runs generative models only: it "
            "has no pooling runner; use generate or chat)"
        )

    method.__name__ = method.__qualname__ = name
    return method


class LLM(LLMEngine):
    """A paged, continuously batched Qwen3 engine.

        llm = LLM("path/to/Qwen3-0.6B")
        llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=32))

    device: "cuda" when available, else "cpu" (the environment variable NANOREF_DEVICE, e.g. "cpu", overrides
        that default); "auto" (vLLM's default) is that platform choice whatever the environment says. dtype "auto"
        (default): on CUDA the checkpoint's float16 or bfloat16 (config.json's dtype), else bfloat16, and float16 on
        a GPU without bfloat16 (compute capability below 8.0); float32 on a CPU.
    max_num_seqs, max_num_batched_tokens: sequences per step, and tokens per prefill step (longer prompts are
        prefilled in chunks); default 512 and 16,384 on CUDA (what a GPU needs to be busy), 64 and 4,096 on a CPU.
    max_model_len: prompt + generated tokens per sequence; default the model's limit, capped at 4096.
    num_kvcache_blocks: an explicit count overrides the one derived from memory.
    gpu_memory_utilization: CUDA: the share of the whole GPU's memory in use once the KV cache is made, what other
        processes hold included (default 0.9, vLLM's name); a CPU ignores it.
    kv_cache_dtype: "auto" (the model's dtype), "fp8" (= "fp8_e4m3") or "fp8_e5m2": K/V stored as 8-bit floats.
    attention_backend: "torch" (reference), "triton" (GPU; CPU through the interpreter), "cpp" (CPU: nanoref's
        C++ kernels, built on first use; needs a C++ compiler and ninja), "flash_attn" (CUDA,
        when installed), "flash_attn+triton" (flash-attn's prefill, nanoref's Triton decode) or "auto"
        (flash_attn+triton where flash-attn serves, else Triton on CUDA; on CPU cpp where it builds, else torch).
    kvcache_block_size: tokens per KV block; default 16, or 256 when flash-attn serves.
    enforce_eager: on CUDA, skip capturing decode CUDA graphs.
    disable_cascade_attn: read a prefix that many sequences share (a system prompt) once per sequence. By default
        Triton's decode reads it once for up to 64 query rows where 48+ sequences share 256+ tokens (vLLM's name).
    tensor_parallel_timeout: seconds rank 0 waits for the other ranks to join a collective before it stops them
        and raises (a hung worker; one that dies is reported within seconds anyway).
    overlap_scheduling: schedule and launch each decode step while the device still runs the one before.
        None (default): on for CUDA, off on a CPU (where nothing can overlap and the plain loop is simpler).
    speculative_config: speculative decoding (nanoref/speculative/), as in vLLM: {"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 3} proposes the tokens that followed the sequence's
        last n tokens earlier in it; {"model": DRAFT_FOLDER, "num_speculative_tokens": 4} has a smaller model with
        the same vocabulary propose them. The target checks the k proposals of every sequence in one forward;
        the output's distribution is the target's (greedy output is the same tokens). A draft too large to ever
        pay for its k forwards (nanoref/speculative/policy.py) is not loaded, with a warning. None (default): off.
    seed: seeds the generator that requests without their own `SamplingParams.seed` draw from, so the same seed
        and the same requests give the same tokens (a request's own seed still wins); None (default): fresh
        entropy, so runs differ. Either way the global RNGs (torch, random, numpy) are left alone.
    enable_lora: serve LoRA adapters (PEFT folders) per request, as vLLM: `generate(..., lora_request=
        LoRARequest(name, int_id, path))`; max_loras: adapters one batch mixes (the device slots; default 1),
        max_lora_rank: the largest rank r they take (default 16), max_cpu_loras: adapters kept read on the host
        (default max_loras). One device only (not with tensor_parallel_size > 1); with speculative decoding the
        target verifies under each request's adapter and a draft model proposes without one.
    vLLM's engine arguments, under vLLM's names (docs/usage.md lists what each does here): block_size,
        num_gpu_blocks_override and async_scheduling are kvcache_block_size, num_kvcache_blocks and
        overlap_scheduling; enable_prefix_caching=False: no request reads K/V another computed (nor do a request's
        n samples share their prompt's); enable_chunked_prefill=False: every prompt is prefilled whole, in one
        step; max_logprobs: the most logprobs a request may ask for; tokenizer: a tokenizer folder other than the
        model's; tokenizer_mode: "auto"/"hf" or "slow"; skip_tokenizer_init=True: no tokenizer (prompts and
        outputs are token ids); generation_config: "auto" (the folder's generation_config.json: the sampling
        defaults of a request that names none, and its extra EOS ids), "vllm" (SamplingParams' own) or a folder
        whose file serves instead, override_generation_config a dict laid over it. trust_remote_code, download_dir,
        disable_log_stats, swap_space, max_seq_len_to_capture, served_model_name and load_format ("auto" or
        "safetensors") change nothing here; revision, tokenizer_revision, quantization and compilation_config are
        refused (ValueError).
    """

    def __init__(self, model: str | Path = DEFAULT_MODEL, **settings) -> None:
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            raise TypeError(
                f"LLM() got an unexpected keyword argument {unknown[0]!r}; its settings: {sorted(SETTINGS)}"
            )
        config = EngineConfig(model, **settings).resolved()
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and not config.skip_tokenizer_init:  # (before building)
            check_draft_tokenizer(spec.model_folder, config.tokenizer_folder)
        unpaid = unpaid_draft(config)
        if unpaid is not None:  # (engine_hooks and build_runner then leave the draft out)
            warnings.warn(unpaid, RuntimeWarning, stacklevel=2)
        self.lora = LoRAHooks(config) if config.enable_lora else None  # (nanoref/lora/hooks.py)
        super().__init__(config, partial(build_runner, lora=self.lora), engine_hooks(config, self.lora))
        self.overlapped_loop = self.step_loop if isinstance(self.step_loop, OverlappedLoop) else None
        self.speculative_loop = self.step_loop if isinstance(self.step_loop, SpeculativeLoop) else None
        self.grammars: Grammars | None = None  # made on the first request with structured_outputs

    encode, embed, classify, score, reward = map(pooling_only, POOLING_REFUSALS)

    @property
    def broken(self) -> str | None:
        """Why this engine can run no more steps, else None: a tensor-parallel rank failed or was stopped, or the
        engine was closed (one device: always None). A server's engine loop then ends, and the server reports its
        engine dead (/health: 503), as vLLM's does."""
        followers = getattr(self.model_runner, "followers", None)
        return None if followers is None else followers.broken

    def get_tokenizer(self) -> Any:
        """The model folder's tokenizer, as vLLM's LLM.get_tokenizer: a ValueError where the engine has none (a folder
        without one, or skip_tokenizer_init); `llm.tokenizer` is None there."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.no_tokenizer}: there is no tokenizer to get")
        return self.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empty the prefix cache, as vLLM's LLM.reset_prefix_cache: no later request reads K/V an earlier one
        computed. False (and a RuntimeWarning), with nothing changed, while a request holds KV blocks (one added
        with `add_request` that has run a step and is not finished). Between steps: it waits for one in flight.
        vLLM's two options are not taken (True is a ValueError naming it): nanoref preempts no running request to
        reset, and has no KV connector."""
        check_reset_options(reset_running_requests, reset_connector)
        num_blocks_held = self.clear_prefix_cache()
        if num_blocks_held:
            warn_blocks_held(num_blocks_held)
        return not num_blocks_held

    def clear_prefix_cache(self) -> int:
        """reset_prefix_cache without its warning -> 0 once emptied, else the KV blocks unfinished requests hold
        (nothing changed): for a caller that reports a refusal its own way (AsyncLLM's engine loop)."""
        with self._lock:
            return reset_prefix_cache(self.scheduler.block_manager)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a call that gives none, as vLLM's: the model's generation_config.json sampling
        settings (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
        SamplingParams' defaults; SamplingParams() with generation_config="vllm" (models/generation_config.py)."""
        return self.config.generation_defaults.sampling_params()

    def constrain(self, params: SamplingParams) -> Callable[[list], None]:
        """Check a request's structured_outputs and compile its grammar (cached) before anything is made ->
        what gives its samples their matchers (ValueError naming the problem: nothing is queued)."""
        if params.structured_outputs is None:
            return lambda samples: None
        params.structured_outputs.validate()
        if self.tokenizer is None:
            raise ValueError(f"{self.config.no_tokenizer}: structured_outputs needs one")
        if self.grammars is None:  # (two threads may both make one: either serves)
            self.grammars = grammars_for(self.tokenizer, self.config, self.scheduler.eos_token_ids)
        compiled = self.grammars.compile(params.structured_outputs)
        self.grammars.check_allowed_token_ids(compiled, params.allowed_token_ids)

        def attach(samples: list) -> None:
            for seq in samples:
                seq.output.constraint = self.grammars.constraint(compiled)

        return attach

    def make_samples(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None = None,
        stream: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list:
        """LLMEngine.make_samples, under the request's LoRA adapter (None: the base model), and with its
        structured_outputs' grammar compiled (a matcher per sample). The adapter is read and checked last
        (LoRAAdapterError names the folder and the problem): a request refused for anything else reads none. It
        enters the host cache only when the request is queued (enqueue_samples), so a request that never is takes no
        other adapter's place there."""
        lora_request = check_lora_request(lora_request, self.lora is not None)
        constrain = self.constrain(params) if isinstance(params, SamplingParams) else lambda samples: None
        samples = super().make_samples(prompt, params, request_id, stream)
        if not self.config.enable_prefix_caching:  # a salt no other sequence has: its blocks are its own
            for seq in samples:
                seq.cache_salt = ("no prefix caching", seq.seq_id, seq.cache_salt)
        if lora_request is not None:
            self.lora.bind(samples, lora_request)
        constrain(samples)
        return samples

    def enqueue_samples(self, samples: list) -> None:
        """LLMEngine.enqueue_samples; a request under an adapter puts it into the host cache and counts in
        `lora.num_requests` once it is queued."""
        with self._lock:
            if self.lora is not None:
                self.lora.commit(samples)
            super().enqueue_samples(samples)  # (without prefix caching, each sample's own salt: none is held)
            if self.lora is not None:
                self.lora.count(samples[0])

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        return_metrics: bool = False,
        priority: list[int] | None = None,
    ) -> list[GenerateOutput]:
        """LLMEngine.generate, with vLLM's lora_request: one adapter for every prompt, or a list with one per
        prompt (None entries run on the base model); needs enable_lora. A call that fails leaves none of the
        adapters it loaded behind. priority: vLLM's, one integer per prompt; requests are served first come, first
        served (vLLM's default policy), so each must be 0 (else a ValueError in vLLM's words)."""
        check_generate_options(use_tqdm, return_metrics)
        prompts = prompt_list(prompts)
        check_priority(priority, len(prompts))
        loras = lora_request_list(lora_request, len(prompts), self.lora is not None)
        if not any(loras):
            return super().generate(prompts, sampling_params, use_tqdm, return_metrics)
        before = set(self.lora.manager.host)
        try:
            outputs = super().generate(
                prompts, sampling_params, use_tqdm, return_metrics, [{"lora_request": r} for r in loras]
            )
            for output, lora_request in zip(outputs, loras):  # (vLLM's RequestOutput.lora_request, and each sample's)
                output.lora_request = lora_request
                for completion in output.outputs:
                    completion.lora_request = lora_request
            return outputs
        except BaseException:  # (its requests are aborted: finished, so no longer in flight)
            loaded = (set(self.lora.manager.host) - before) & {r.lora_int_id for r in loras if r is not None}
            for lora_int_id in loaded - self.lora.in_flight():  # (another thread's requests may run on one)
                self.lora.unload(lora_int_id)
            raise

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """LLMEngine.stream, under the request's LoRA adapter (None: the base model)."""
        return self._stream(self.make_samples(prompt, params, request_id, stream=True, lora_request=lora_request))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[GenerateOutput]:
        """Generate the assistant's reply to one conversation ([{"role", "content"}, ...]) or to each of a list of
        them (an empty list: none, so no outputs), through the model folder's chat template; returns what `generate`
        returns, one dict per conversation.
        lora_request: as generate's, per conversation. As vLLM's LLM.chat: add_generation_prompt opens the
        assistant's turn; continue_final_message (with add_generation_prompt=False) continues the last, assistant,
        message instead; chat_template_kwargs are the template's own variables (Qwen3's `enable_thinking`).
        tools: the functions the model may call, OpenAI's `[{"type": "function", "function": {...}}]`, laid out by
        the template (as vLLM's LLM.chat: the reply is text; the server's `tool_choice` parses and constrains calls).
        chat_template: a Jinja template's text in place of the folder's (vLLM's; a base model has none);
        chat_template_content_format: "auto" or "string", vLLM's names for what nanoref does (a message's text parts
        reach the template as one string). Messages as `nanoref/engine/chat.py` takes them.
        """
        check_content_format(chat_template_content_format)
        if self.tokenizer is None:  # (its folder has none, or skip_tokenizer_init)
            raise ValueError(f"{self.config.no_tokenizer}: chat needs one, with a chat template")
        if chat_template is not None:  # (once for every conversation)
            check_chat_template(chat_template)
        # a list of conversations, as vLLM tells them apart (an empty list is none: no outputs, as generate([]))
        many = isinstance(messages, list) and (not messages or isinstance(messages[0], list))
        conversations = messages if many else [messages]
        prompts = []
        for index, conversation in enumerate(conversations):
            try:
                prompts.append(
                    chat_prompt(
                        self.tokenizer,
                        conversation,
                        self.config.tokenizer_folder,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        chat_template_kwargs=chat_template_kwargs,
                        tools=tools,
                        chat_template=chat_template,
                    )
                )
            except (ValueError, TypeError) as error:
                raise type(error)(f"conversation {index}: {error}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


# every setting: EngineConfig's fields, and vLLM's other names for some of them (VLLM_ALIASES)
SETTINGS = {f.name for f in fields(EngineConfig) if f.init and f.name != "model"} | set(VLLM_ALIASES)
# help(LLM) and inspect.signature(LLM) list every setting, with EngineConfig's defaults
LLM.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=DEFAULT_MODEL)]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(EngineConfig)
        if f.name in SETTINGS
    ]
    + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in VLLM_ALIASES]
)


def check_lora_adapter(config: EngineConfig, lora_request: LoRARequest) -> None:
    """Read and check a LoRA adapter's folder against the model of `config` (LoRAAdapterError, a ValueError, naming
    the problem): what a server does before it lists an adapter."""
    r = lora_request
    load_adapter(r.lora_path, r.lora_name, r.lora_int_id, config.hf_config, config.max_lora_rank)


def engine_hooks(config: EngineConfig, lora: LoRAHooks | None = None) -> EngineHooks:
    """The engine's hooks for a config: its step loop, the lookahead a verify step needs, and with LoRA adapters
    the rule that keeps a batch's adapters to max_loras."""
    rules = [rule for rule in (lora and lora.can_admit, whole_prompts(config)) if rule]
    admission = {"can_admit": lambda *seqs: all(rule(*seqs) for rule in rules)} if rules else {}
    spec = config.speculative_config
    if spec is None:
        return EngineHooks(make_step_loop=OverlappedLoop if config.overlap_scheduling else PlainLoop, **admission)
    # a verify step writes K/V for k slots past the last token; on CUDA it replays graphs of its own shape too
    # its plain decode steps (where speculation would not pay) overlap with the host's work on CUDA, as without it
    plain = OverlappedLoop if config.device.type == "cuda" else PlainLoop
    if unpaid_draft(config) is not None:  # a draft that could never pay is not loaded: no speculation at all
        return EngineHooks(make_step_loop=plain, **admission)
    loop = partial(SpeculativeLoop, make_verify_graphs=DecodeGraphs, make_plain_loop=plain)
    return EngineHooks(make_step_loop=loop, num_lookahead_tokens=spec.num_speculative_tokens, **admission)


def whole_prompts(config: EngineConfig) -> Callable | None:
    """With enable_chunked_prefill=False (else None): EngineHooks.can_admit that starts a prompt only where what is
    left of the step's token budget holds all of it, as vLLM's scheduler does without chunked prefill (a prompt
    that does not fit waits, and the next in line may go). A prompt alone in a step always fits
    (max_num_batched_tokens >= max_model_len). Counted before the prefix cache's hits, which vLLM counts first."""
    if config.enable_chunked_prefill is not False:
        return None
    budget = config.max_num_batched_tokens

    def can_admit(seq: Any, running: Iterable, scheduled: list) -> bool:
        used = sum(other.num_scheduled_tokens for other in scheduled[:-1])  # (seq is last)
        return seq.num_tokens - seq.num_computed_tokens <= budget - used

    return can_admit


def decode_graphs(runner: ModelRunner, lora: LoRAHooks | None = None) -> DecodeGraphs | None:
    """CUDA graphs of the runner's decode steps, where they apply: on CUDA unless enforce_eager, and not for a model
    whose forward has data-dependent shapes (Qwen3-MoE's expert loop runs decode eagerly). With adapters: recorded
    with and without their delta, for steps with and without adapted rows."""
    config = runner.config
    if config.device.type != "cuda" or config.enforce_eager or not getattr(runner.model, "supports_cuda_graphs", True):
        return None
    # steps over a prefix many sequences share (cascade attention) replay graphs of their own
    min_seqs = CASCADE_MIN_SEQS if reads_shared_prefixes(runner) else None
    if lora is not None:
        return lora.decode_graphs(runner, lambda: DecodeGraphs(runner, shared_prefix_min_seqs=min_seqs))
    return DecodeGraphs(runner, shared_prefix_min_seqs=min_seqs)


def warm_up_draft(runner: SpeculativeRunner) -> None:
    """The prefill warm-up on a draft model's runner (its cache exists once the target's does)."""
    warm_up_prefill(runner.draft)


def build_runner(
    config: EngineConfig, parallel: ParallelState | None = None, lora: LoRAHooks | None = None
) -> ModelRunner:
    """The model runner with its features attached; each tensor-parallel rank makes its own with this. lora: the
    adapters' hooks (their slots go on the target model; a draft model runs without them).

    On the followers of a torchrun launch (ranks 1..N-1) this never returns: they follow rank 0's steps until it
    closes, then their process ends."""
    spec = config.speculative_config
    draft = spec is not None and spec.method == "draft_model" and unpaid_draft(config) is None
    # (LoRA's slots exist before the decode graphs are recorded: the graphs read each row's slot as an input)
    # (the prefill warm-up runs once the cache exists, through the adapters' delta where there are adapters; one device
    # only: ranks would have to warm up in step)
    warm_up = (warm_up_prefill,) if config.device.type == "cuda" and config.tensor_parallel_size == 1 else ()
    if warm_up and draft:  # a draft's shapes compile kernels of their own
        warm_up = (warm_up_prefill, warm_up_draft)
    hooks = RunnerHooks(
        # (LoRA's slots before the KV cache is sized, as vLLM sets LoRA up before it measures the memory left for the
        # cache: the slots count as used, and the cache gets the rest; the warm-up needs the cache)
        attach_before_kv_cache=(lora.attach,) if lora is not None else (),
        attach=(*warm_up, attach_cascade),
        decode_graphs=partial(decode_graphs, lora=lora),
    )
    if config.device.type == "cuda":
        release_freed_gpu_memory()
    if draft:
        runner = SpeculativeRunner(config, hooks)  # (speculative decoding runs on one device)
    elif config.tensor_parallel_size == 1:
        runner = ModelRunner(config, hooks=hooks)
    else:  # (a rank that fails to capture its graphs stops the others: they wait in a capture it left)
        runner = TensorParallelRunner(config, parallel, build=build_runner, hooks=hooks)
    if parallel is None and runner.rank > 0:  # torchrun: every rank but 0 follows rank 0, then its process ends
        runner.serve()
        end_follower_process(0)  # (without the interpreter's teardown: see there why)
    return runner
