"""Turns a scheduled batch of sequences into flat tensors plus metadata, runs the model, samples.

Prefill: every scheduled sequence contributes the tokens it has not computed yet (its chunk), all
concatenated into `input_ids (N,)` and `positions (N,)`; `cu_seqlens_q` marks where each one starts.
Decode: every sequence contributes its last token, so N == num_seqs, and `context_lens` +
`block_tables` tell attention where each history lies in the paged cache. (The arrays themselves are built by the
pure functions of engine/step_inputs.py.)

This is the plain path, run eagerly on one device. What runs it faster, on several devices or with more per-row
state is given from outside (nanoref/llm.py): `RunnerHooks` (engine/hooks.py), or a subclass.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from nanoref.config import EngineConfig
from nanoref.engine.block_tables import BlockTables
from nanoref.engine.hooks import NO_RUNNER_HOOKS, RunnerHooks
from nanoref.engine.kv_budget import cpu_memory_available, kv_blocks_from_memory
from nanoref.engine.sampling_inputs import asks_all_logits, attach_logprobs, sampling_batch, split_logits, step_logprobs
from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs, decode_arrays, prefill_arrays, prefill_metadata
from nanoref.layers.attention import Attention
from nanoref.layers.sampler import Sampler
from nanoref.models import build_model
from nanoref.ops.backends import resolve_backend, use_backend
from nanoref.utils.context import Context, reset_context, set_context, upload_arrays
from nanoref.utils.loader import load_weights
from nanoref.utils.seams import seam
from nanoref.utils.tracing import trace_inputs


class ModelRunner:
    rank, world_size = 0, 1  # one device (a subclass may run the same runner as one of several ranks)
    # the model's EOS ids, masked for a request still short of its min_tokens (set by the engine: the scheduler's)
    eos_token_ids: set[int] | frozenset[int] = frozenset()

    def __init__(self, config: EngineConfig, device: torch.device | None = None, hooks: RunnerHooks = NO_RUNNER_HOOKS):
        """config: resolved (`EngineConfig.resolved()`: a concrete backend and block size); hooks: see RunnerHooks."""
        self.device = device or config.device
        self.block_size = config.kvcache_block_size
        self.model = build_model(config.architecture, config.hf_config, self.device, config.dtype, config.max_model_len)
        load_weights(self.model, config.model_folder, show_progress=self.rank == 0)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        use_backend(self.model, self.backend)  # (attention and the element-wise layers run the backend's kernels)
        self.sampler = Sampler()
        # unseeded requests draw from this (seeded requests from their own): never from (or into) the global RNG.
        # LLM(seed=N) makes their draws repeat from one engine to the next; None: fresh entropy
        self.generator = torch.Generator(device=self.device)
        self.generator.seed() if config.seed is None else self.generator.manual_seed(config.seed)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)  # the decode block tables' width
        # every sequence's block table as a row of one array: the block manager's, set by the engine
        self.block_tables = BlockTables()
        self.config = config
        # what the first hooks allocate is measured as used: the KV cache, sized next, gets what they leave
        self.step_hooks = [hook for attach in hooks.attach_before_kv_cache if (hook := attach(self)) is not None]
        if config.num_kvcache_blocks is None:
            self.config = config.with_kv_blocks(self.count_kv_blocks())
        self.num_kvcache_blocks = self.config.num_kvcache_blocks
        self.allocate_kv_cache()
        self.step_hooks += [hook for attach in hooks.attach if (hook := attach(self)) is not None]
        self.decode_graphs: Any = hooks.decode_graphs(self) if hooks.decode_graphs else None  # (decode replayer)

    # -- the KV cache ---------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        c, kv_heads = self.config.hf_config, self.attention_layers[0].num_kv_heads  # (this rank's KV heads)
        return 2 * c.num_hidden_layers * kv_heads * c.head_dim * self.config.cache_dtype.itemsize

    def count_kv_blocks(self) -> int:
        return kv_blocks_from_memory(self)

    def allocate_kv_cache(self) -> None:
        c, kv_heads = self.config.hf_config, self.attention_layers[0].num_kv_heads
        shape = (2, c.num_hidden_layers, self.num_kvcache_blocks, self.block_size, kv_heads, c.head_dim)
        # an explicit num_kvcache_blocks may ask for more than there is: say so, rather than the allocator's bytes (or,
        # on a CPU, the kernel's OOM killer while torch.zeros writes pages the allocation only promised)
        needed = math.prod(shape) * self.config.cache_dtype.itemsize
        available = cpu_memory_available(fallback=None) if self.device.type == "cpu" else None  # (None: unknown)
        if available is not None and needed > available:
            raise ValueError(self._kv_cache_too_large(needed, f"{available / 2**30:.1f} GiB available"))
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.config.cache_dtype, device=self.device)  # (kv_cache_dtype)
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as error:
            if isinstance(error, RuntimeError) and "alloc" not in str(error).lower():
                raise
            raise ValueError(self._kv_cache_too_large(needed, "it could not be allocated")) from None
        for index, layer in enumerate(self.attention_layers):  # views, each (num_blocks, block_size, Hk, D)
            layer.k_cache, layer.v_cache = self.kv_cache[:, index]

    def _kv_cache_too_large(self, needed: int, why: str) -> str:
        return (
            f"num_kvcache_blocks={self.num_kvcache_blocks} needs {needed / 2**30:.1f} GiB for the KV cache on "
            f"{self.device}, but {why}: lower num_kvcache_blocks (None sizes it from memory)"
        )

    # -- flat inputs ----------------------------------------------------------------------------
    def prepare_prefill(self, seqs: list[Sequence]) -> StepInputs:
        arrays = prefill_arrays(
            seam("prefill_metadata", prefill_metadata)(
                [seq.token_ids for seq in seqs],
                [seq.num_computed_tokens for seq in seqs],  # earlier chunks and prefix-cache hits are already cached
                [seq.num_scheduled_tokens for seq in seqs],
                [seq.block_table for seq in seqs],
                self.block_size,
            )
        )
        if any(seq.num_computed_tokens for seq in seqs):  # history: attention reads its keys through the tables
            arrays["block_tables"] = self.block_tables.padded(seqs)
        max_q = max(seq.num_scheduled_tokens for seq in seqs)
        max_k = max(seq.num_computed_tokens + seq.num_scheduled_tokens for seq in seqs)
        # a sequence may ask for every position's logits (see asks_all_logits), not only its last one's
        return StepInputs(True, arrays, max_q, max_k, all_logits=any(map(asks_all_logits, seqs)))

    def prepare_decode(self, seqs: list[Sequence], ahead: bool = False, extra: list[list[int]] = ()) -> StepInputs:
        """ahead: the input tokens are not in seq.token_ids yet (a step launched before the previous one's tokens
        came back: they were sampled in the step still on the device), so each sequence is one token longer than
        the host sees. extra: tokens to check after each sequence's last one, as many for every sequence (a step
        with 1 + k queries per sequence). The padded block tables are rows of the block manager's persistent
        array, written only when a sequence gains blocks."""
        last = np.fromiter((len(seq.token_ids) - 1 for seq in seqs), dtype=np.int64, count=len(seqs)) + ahead
        if extra:  # (B, 1 + k)
            input_ids = np.asarray([[seq.token_ids[-1], *more] for seq, more in zip(seqs, extra)], dtype=np.int64)
        else:  # (B, 1)
            input_ids = np.fromiter((seq.token_ids[-1] for seq in seqs), dtype=np.int64, count=len(seqs))[:, None]
        arrays = decode_arrays(input_ids, last, self.block_tables.padded(seqs), self.block_size)
        return StepInputs(False, arrays, decode_query_len=input_ids.shape[1])

    def upload(self, step: StepInputs, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a step's arrays to the device in one copy, publish its Context -> (input_ids (N,), positions (N,)).

        input_ids: the step's input tokens when the device already holds them (see prepare_decode's `ahead`)."""
        t = upload_arrays(step.arrays, self.device)
        set_context(
            Context(
                is_prefill=step.is_prefill,
                cu_seqlens_q=t.get("cu_seqlens_q"),  # (num_seqs + 1,), prefill
                cu_seqlens_k=t.get("cu_seqlens_k"),  # (num_seqs + 1,), prefill
                max_seqlen_q=step.max_seqlen_q,
                max_seqlen_k=step.max_seqlen_k,
                slot_mapping=t["slot_mapping"].long(),  # (N,)
                context_lens=t.get("context_lens"),  # (num_seqs,), decode
                block_tables=t.get("block_tables"),  # (num_seqs, width)
                all_logits=step.all_logits,
                decode_query_len=step.decode_query_len,
            )
        )
        return (t["input_ids"].long() if input_ids is None else input_ids), t["positions"].long()

    # -- running ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One forward over the scheduled sequences -> one sampled token id per sequence."""
        return self.launch(seqs, is_prefill).tolist()  # the step's one host sync

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Queue one forward and its sampling on the device -> the sampled ids (num_seqs,), still on the device.

        Nothing here waits for the device, so the host may go on (and, say, schedule the next step).
        input_ids: a decode step's input tokens as the device already holds them (see prepare_decode's `ahead`).
        """
        ahead = input_ids is not None
        step = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs, ahead=ahead)
        logits = self.run_forward(seqs, step, input_ids, self.decode_graphs)  # (num_seqs, vocab)
        if step.all_logits:  # (N, vocab): the sequences keep the rows they asked for, the sampler gets each last one
            logits = split_logits(seqs, step, logits)
        # host work while the GPU runs the forward just launched
        vocab = self.config.hf_config.vocab_size
        batch = sampling_batch(seqs, is_prefill, int(ahead), self.device, self.generator, vocab, self.eos_token_ids)
        logprobs = step_logprobs(seqs, batch, logits)  # (the model's logits: before penalties, after a grammar)
        sampled = self.sampler(logits, batch=batch)  # (num_seqs,)
        if logprobs is not None:
            attach_logprobs(seqs, batch, logprobs, sampled)
        return sampled

    @torch.inference_mode()
    def run_forward(
        self, seqs: list[Sequence], step: StepInputs, input_ids: torch.Tensor | None = None, graphs: Any = None
    ) -> torch.Tensor:
        """Upload a step's inputs and run the model -> logits (rows, vocab): each sequence's last token's, or every
        token's where the step asks (`all_logits`, several queries per sequence). graphs: a replayer of decode
        steps of this step's shape, used where it covers the batch; input_ids: see upload."""
        try:
            input_ids, positions = self.upload(step, input_ids)
            trace_inputs(step.is_prefill, seqs, input_ids, positions)
            for hook in self.step_hooks:
                hook(seqs, step)
            if not step.is_prefill and graphs is not None and graphs.covers(len(step.arrays["context_lens"])):
                return graphs.run(input_ids, positions)
            return self.model.compute_logits(self.model(input_ids, positions))
        finally:
            reset_context()  # also when the step raises: the next step must not see this one's metadata

    def run_on_all_ranks(self, fn, *args) -> list:
        """fn(runner, *args) on every rank's model runner -> the results, by rank (here: the one)."""
        return [fn(self, *args)]

    def close(self) -> None:
        """Nothing to stop on one device (a runner of several ranks stops the others)."""
