"""`LLM`: the user-facing entry point, with vLLM's argument names, and the one place features attach.

The core (`nanoref/engine/`) runs the plain offline path eagerly on one device. What makes it fast or wide is
attached here, from outside, once the config is resolved: decode CUDA graphs (`nanoref/fast/cuda_graphs.py`) on
the model runner, tensor parallelism (`nanoref/parallel/`) as the runner's subclass, and the overlapped loop
(`nanoref/fast/overlap.py`) or the speculative loop (`nanoref/spec/`, with a draft model's runner beside the
target's) as the engine's step loop. `torch.compile` applies itself: the element-wise
layers compile on their first CUDA call (`nanoref/utils/compile.py`).
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import fields
from functools import partial
from pathlib import Path

from nanoref.config import EngineConfig
from nanoref.engine.chat import chat_prompt
from nanoref.engine.hooks import EngineHooks, RunnerHooks
from nanoref.engine.llm_engine import LLMEngine, PlainLoop
from nanoref.engine.model_runner import ModelRunner
from nanoref.fast.cuda_graphs import DecodeGraphs
from nanoref.fast.overlap import OverlappedLoop
from nanoref.parallel.runner import TensorParallelRunner
from nanoref.sampling_params import SamplingParams
from nanoref.spec.loop import SpeculativeLoop
from nanoref.spec.runner import SpeculativeRunner
from nanoref.utils.parallel import ParallelState

DEFAULT_MODEL = Path(__file__).parent / "default_model"


class LLM(LLMEngine):
    """A paged, continuously batched Qwen3 engine.

        llm = LLM("path/to/Qwen3-0.6B")
        llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=32))

    device: "cuda" when available, else "cpu" (the environment variable NANOREF_DEVICE, e.g. "cpu", overrides
        that default). dtype: bfloat16 on CUDA, float32 on CPU.
    max_num_seqs, max_num_batched_tokens: sequences per step, and tokens per prefill step (longer prompts are
        prefilled in chunks); default 512 and 16,384 on CUDA (what a GPU needs to be busy), 64 and 4,096 on a CPU.
    num_kvcache_blocks: an explicit count overrides the one derived from memory.
    attention_backend: "torch" (reference), "triton" (GPU; CPU through the interpreter), "cpp" (CPU: nanoref's
        C++ decode kernel, built on first use; needs a C++ compiler and ninja), "flash_attn" (CUDA,
        when installed), "flash_attn+triton" (flash-attn's prefill, nanoref's Triton decode) or "auto"
        (flash_attn+triton where flash-attn serves, else Triton on CUDA; torch on CPU).
    kvcache_block_size: tokens per KV block; default 16, or 256 when flash-attn serves.
    enforce_eager: on CUDA, skip capturing decode CUDA graphs.
    tensor_parallel_timeout: seconds rank 0 waits for the other ranks to join a collective before it stops them
        and raises (a hung worker; one that dies is reported within seconds anyway).
    overlap_scheduling: schedule and launch each decode step while the device still runs the one before.
        None (default): on for CUDA, off on a CPU (where nothing can overlap and the plain loop is simpler).
    speculative_config: speculative decoding (nanoref/spec/), as in vLLM: {"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 3} proposes the tokens that followed the sequence's
        last n tokens earlier in it; {"model": DRAFT_FOLDER, "num_speculative_tokens": 4} has a smaller model with
        the same vocabulary propose them. The target checks the k proposals of every sequence in one forward;
        the output's distribution is the target's (greedy output is the same tokens). None (default): off.
    seed: seeds the generator that requests without their own `SamplingParams.seed` draw from, so the same seed
        and the same requests give the same tokens (a request's own seed still wins); None (default): fresh
        entropy, so runs differ. Either way the global RNGs (torch, random, numpy) are left alone.
    """

    def __init__(self, model: str | Path = DEFAULT_MODEL, **settings) -> None:
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            raise TypeError(
                f"LLM() got an unexpected keyword argument {unknown[0]!r}; its settings: {sorted(SETTINGS)}"
            )
        config = EngineConfig(model, **settings).resolved()
        super().__init__(config, build_runner, engine_hooks(config))
        self.overlapped_loop = self.step_loop if isinstance(self.step_loop, OverlappedLoop) else None
        self.speculative_loop = self.step_loop if isinstance(self.step_loop, SpeculativeLoop) else None

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[dict]:
        """Generate the assistant's reply to one conversation ([{"role", "content"}, ...]) or to each of a list of
        them, through the model folder's chat template; returns what `generate` returns, one dict per conversation.
        As vLLM's LLM.chat: add_generation_prompt opens the assistant's turn; continue_final_message (with
        add_generation_prompt=False) continues the last, assistant, message instead; chat_template_kwargs are the
        template's own variables (Qwen3's `enable_thinking`). Messages as `nanoref/engine/chat.py` takes them.
        """
        conversations = (
            messages if messages and isinstance(messages, list) and isinstance(messages[0], list) else [messages]
        )
        prompts = []
        for index, conversation in enumerate(conversations):
            try:
                prompts.append(
                    chat_prompt(
                        self.tokenizer,
                        conversation,
                        self.config.model_folder,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        chat_template_kwargs=chat_template_kwargs,
                    )
                )
            except (ValueError, TypeError) as error:
                raise type(error)(f"conversation {index}: {error}") from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


SETTINGS = {f.name for f in fields(EngineConfig) if f.init and f.name != "model"}
# help(LLM) and inspect.signature(LLM) list every setting, with EngineConfig's defaults
LLM.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=DEFAULT_MODEL)]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in fields(EngineConfig)
        if f.name in SETTINGS
    ]
)


def engine_hooks(config: EngineConfig) -> EngineHooks:
    """The engine's hooks for a config: its step loop, and the lookahead a verify step needs."""
    spec = config.speculative_config
    if spec is None:
        return EngineHooks(make_step_loop=OverlappedLoop if config.overlap_scheduling else PlainLoop)
    # a verify step writes K/V for k slots past the last token; on CUDA it replays graphs of its own shape too
    # its plain decode steps (where speculation would not pay) overlap with the host's work on CUDA, as without it
    plain = OverlappedLoop if config.device.type == "cuda" else PlainLoop
    loop = partial(SpeculativeLoop, make_verify_graphs=DecodeGraphs, make_plain_loop=plain)
    return EngineHooks(make_step_loop=loop, num_lookahead_tokens=spec.num_speculative_tokens)


def decode_graphs(runner: ModelRunner) -> DecodeGraphs | None:
    """CUDA graphs of the runner's decode steps, where they apply: on CUDA unless enforce_eager, and not for a model
    whose forward has data-dependent shapes (Qwen3-MoE's expert loop runs decode eagerly)."""
    config = runner.config
    if config.device.type != "cuda" or config.enforce_eager or not getattr(runner.model, "supports_cuda_graphs", True):
        return None
    return DecodeGraphs(runner)


def build_runner(config: EngineConfig, parallel: ParallelState | None = None) -> ModelRunner:
    """The model runner with its features attached; each tensor-parallel rank makes its own with this.

    On the followers of a torchrun launch (ranks 1..N-1) this never returns: they follow rank 0's steps until it
    closes, then their process ends."""
    spec = config.speculative_config
    hooks = RunnerHooks(decode_graphs=decode_graphs)
    if spec is not None and spec.method == "draft_model":
        runner = SpeculativeRunner(config, hooks)  # (speculative decoding runs on one device)
    elif config.tensor_parallel_size == 1:
        runner = ModelRunner(config, hooks=hooks)
    else:  # (a rank that fails to capture its graphs stops the others: they wait in a capture it left)
        runner = TensorParallelRunner(config, parallel, build=build_runner, hooks=hooks)
    if parallel is None and runner.rank > 0:  # torchrun: every rank but 0 follows rank 0, then its process ends
        runner.serve()
        # End here, without the interpreter's teardown: after a model has run, a torchrun follower that exits
        # normally aborts in C++ static destructors about one time in five (seen on this project's CPU machine,
        # torch 2.13), which torchrun reports as a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return runner
