"""A target model runner with a draft model beside it: one KV block count, two caches, the same block tables.

The draft's K/V for token t of sequence b sits in the slot the target's does (block_table[t // block_size]), in
the draft's own cache tensor, so the block manager, the prefix cache and preemption need not know the draft
exists. The block count is measured once for both: per block, the KV bytes of the target plus the draft's.
"""

from __future__ import annotations

import math
from pathlib import Path

from nanoref.config import EngineConfig
from nanoref.engine.hooks import NO_RUNNER_HOOKS, RunnerHooks
from nanoref.engine.model_runner import ModelRunner
from nanoref.speculative.policy import draft_cost
from nanoref.utils.loader import ModelFolderError, weight_files


def stored_parameters(folder: Path) -> int:
    """The weights a forward of the model in folder reads: its checkpoint tensors' elements (a tied embedding is
    stored once), from the safetensors headers alone."""
    from safetensors import safe_open

    total = 0
    for path in weight_files(Path(folder)):
        with safe_open(path, framework="pt") as tensors:
            total += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return total


def acceptance_bar(config: EngineConfig) -> float:
    """The tokens per sequence a verify step must gain to pay (policy.py): min_tokens_per_step, plus with a draft model
    its k forwards' cost, k x its weights' share of the target's (0 stays 0: the acceptance rule is off)."""
    spec = config.speculative_config
    bar = spec.min_tokens_per_step
    if spec.method == "draft_model" and bar > 0:
        draft, target = stored_parameters(spec.model_folder), stored_parameters(config.model_folder)
        bar += draft_cost(spec.num_speculative_tokens, draft, target)
    return bar


def unpaid_draft(config: EngineConfig) -> str | None:
    """Why config's draft model can never pay for its forwards (the bar above the k + 1 tokens a verify step can
    gain), or None. Such a draft is not loaded: the engine decodes as one without speculation."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model" or spec.min_tokens_per_step <= 0:
        return None
    try:
        bar = acceptance_bar(config)
    except Exception:  # a broken draft folder: its loading names the problem
        return None
    k = spec.num_speculative_tokens
    if bar <= k + 1:
        return None
    draft, target = stored_parameters(spec.model_folder), stored_parameters(config.model_folder)
    return (
        f"speculative_config: the draft model has {draft:,} parameters, the target {target:,}: with its {k} "
        f"forwards a verify step would have to gain {bar:.2f} tokens per sequence to pay, more than the {k + 1} it "
        "can, so the draft is not loaded and the engine decodes without speculation (a smaller draft pays; "
        "min_tokens_per_step=0 verifies every step anyway)"
    )


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft's settings: the target's device, dtype, lengths, block size and KV cache dtype, its own folder; one
    KV block until the target has measured the count they share (`SpeculativeRunner.allocate_kv_cache`)."""
    spec = config.speculative_config
    return EngineConfig(
        spec.model_folder,
        device=config.device,
        dtype=config.dtype,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        kvcache_block_size=config.kvcache_block_size,
        num_kvcache_blocks=1,
        attention_backend=config.attention_backend,
        kv_cache_dtype=config.kv_cache_dtype,
        overlap_scheduling=False,
        generation_config=config.generation_defaults,  # (requests take the target's; the draft's file is not read)
    ).resolved()


class SpeculativeRunner(ModelRunner):
    """The target's runner; `draft` is the draft's, whose cache is indexed by the same block tables."""

    def __init__(self, config: EngineConfig, hooks: RunnerHooks = NO_RUNNER_HOOKS) -> None:
        # the draft's weights first: on a GPU the target then measures the memory both leave for their caches
        try:  # (a checkpoint that does not load names the key it came from, as the config's checks do)
            self.draft = ModelRunner(draft_engine_config(config))
        except ModelFolderError as error:
            raise ModelFolderError(f'speculative_config "model": {error}') from None
        super().__init__(config, hooks=hooks)
        if hooks.decode_graphs is not None:  # the draft's k decode steps per verify step, once its cache is real
            self.draft.decode_graphs = hooks.decode_graphs(self.draft)

    @property
    def kv_bytes_per_token(self) -> int:
        return super().kv_bytes_per_token + self.draft.kv_bytes_per_token

    def allocate_kv_cache(self) -> None:
        super().allocate_kv_cache()
        draft = self.draft
        draft.config = draft.config.with_kv_blocks(self.num_kvcache_blocks)
        draft.num_kvcache_blocks = self.num_kvcache_blocks
        draft.allocate_kv_cache()
