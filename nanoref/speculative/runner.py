"""A target model runner with a draft model beside it: one KV block count, two caches, the same block tables.

The draft's K/V for token t of sequence b sits in the slot the target's does (block_table[t // block_size]), in
the draft's own cache tensor, so the block manager, the prefix cache and preemption need not know the draft
exists. The block count is measured once for both: per block, the KV bytes of the target plus the draft's.
"""

from __future__ import annotations

from nanoref.config import EngineConfig
from nanoref.engine.hooks import NO_RUNNER_HOOKS, RunnerHooks
from nanoref.engine.model_runner import ModelRunner


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft's settings: the target's device, dtype, lengths and block size, its own folder; one KV block
    until the target has measured the count they share (`SpeculativeRunner.allocate_kv_cache`)."""
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
        overlap_scheduling=False,
    ).resolved()


class SpeculativeRunner(ModelRunner):
    """The target's runner; `draft` is the draft's, whose cache is indexed by the same block tables."""

    def __init__(self, config: EngineConfig, hooks: RunnerHooks = NO_RUNNER_HOOKS) -> None:
        # the draft's weights first: on a GPU the target then measures the memory both leave for their caches
        self.draft = ModelRunner(draft_engine_config(config))
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
