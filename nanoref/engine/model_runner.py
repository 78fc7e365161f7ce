"""Turns a scheduled batch of sequences into flat tensors plus metadata, runs the model, samples.

Prefill: every scheduled sequence contributes the tokens it has not computed yet (its chunk), all
concatenated into `input_ids (N,)` and `positions (N,)`; `cu_seqlens_q` marks where each one starts.
Decode: every sequence contributes its last token, so N == num_seqs, and `context_lens` +
`block_tables` tell attention where each history lies in the paged cache.
"""

from __future__ import annotations

import pickle
import traceback
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from nanoref.config import EngineConfig
from nanoref.engine.block_manager import BlockTables
from nanoref.engine.sequence import Sequence
from nanoref.engine.tensor_parallel import (
    CLOSED,
    Followers,
    TensorParallelError,
    rank_device,
    receive,
    receive_next_ids,
    start_tensor_parallel,
)
from nanoref.layers.attention import Attention
from nanoref.layers.sampler import Sampler, SamplingBatch
from nanoref.models import build_model
from nanoref.ops.backends import FLASH_ATTN_BACKENDS, choose_backend, resolve_backend
from nanoref.utils.context import Context, get_context, reset_context, set_context
from nanoref.utils.loader import load_weights
from nanoref.utils.parallel import ParallelState, tensor_parallel
from nanoref.utils.seams import TRITON_SEAMS, replace_active, seam
from nanoref.utils.tracing import trace_step, tracing_enabled


def _cpu_memory_available() -> int:
    """Bytes of memory available to new allocations (Linux), else a conservative 4 GiB."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def pad_decode_batch(
    buffers: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Copy a decode batch of B sequences into the first B rows of a graph bucket's static input buffers and
    make the other rows harmless padding, in place.

    buffers: the bucket's S >= B rows of each static input: "input_ids" (S,) int64, "positions" (S,) int64,
        "slot_mapping" (S,) int64, "context_lens" (S,) int32, "block_tables" (S, max_blocks) int32.
    input_ids, positions, slot_mapping: (B,) int64; context_lens: (B,) int32;
    block_tables: (B, W) int32 with W <= max_blocks.
    A padding row still runs through every kernel of the recorded graph: slot -1 makes the KV store skip it
    and context length 0 makes attention read nothing for it. Its token id and position only need to be
    valid (what an earlier step left there is).
    """
    batch, width = block_tables.shape
    buffers["input_ids"][:batch] = input_ids
    buffers["positions"][:batch] = positions
    buffers["slot_mapping"][:batch] = slot_mapping
    buffers["slot_mapping"][batch:] = -1
    buffers["context_lens"][:batch] = context_lens
    buffers["context_lens"][batch:] = 0
    buffers["block_tables"][:batch, :width] = block_tables


STATIC_INPUTS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")


class PrefillMetadata(NamedTuple):
    """A prefill step's flat inputs, as Python lists (the model runner makes them tensors)."""

    input_ids: list[int]  # (N,): every sequence's new tokens, one after the other
    positions: list[int]  # (N,): each token's position inside its own sequence
    cu_seqlens_q: list[int]  # (num_seqs + 1,): where each sequence's new tokens start in the flat stream
    cu_seqlens_k: list[int]  # (num_seqs + 1,): the same for its keys, cached history included
    slot_mapping: list[int]  # (N,): the cache slot each new token's K/V goes to


def prefill_metadata(
    token_ids: list[list[int]],
    num_cached: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> PrefillMetadata:
    """The flat inputs of a prefill step over sequences b = 0, 1, ...

    Sequence b has token_ids[b]; its first num_cached[b] tokens already have K/V in the cache (prefix-cache
    hits, earlier chunks), and this step computes the next num_new[b]. Token t of sequence b lives in cache
    slot block_tables[b][t // block_size] * block_size + t % block_size.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    for tokens, start, count, table in zip(token_ids, num_cached, num_new, block_tables):
        end = start + count
        input_ids.extend(tokens[start:end])
        positions.extend(range(start, end))
        slot_mapping.extend(table[t // block_size] * block_size + t % block_size for t in range(start, end))
        cu_seqlens_q.append(cu_seqlens_q[-1] + count)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)  # keys: the history plus this chunk
    return PrefillMetadata(input_ids, positions, cu_seqlens_q, cu_seqlens_k, slot_mapping)


@dataclass
class StepInputs:
    """One step's flat inputs on the host: everything a rank needs to run the forward. Rank 0 builds it from
    its sequences; under tensor parallelism the other ranks receive a copy (they hold no sequences)."""

    is_prefill: bool
    num_seqs: int
    # decode: one int32 array [input_ids | positions | slots | context_lens | block_tables], a single copy
    packed: np.ndarray | None = None
    # prefill: the flat lists, their longest query and key, and the block tables when some history is cached
    prefill: PrefillMetadata | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_tables: np.ndarray | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState | None = None) -> None:
        """parallel: this process's rank, for a tensor-parallel worker; None on rank 0 (it starts the others)."""
        self.config = config
        self.hf_config = config.hf_config
        # the backend is chosen here, not in the config: "auto" may run a tiny flash-attn kernel to probe the build
        config.attention_backend = choose_backend(
            config.attention_backend, config.device, config.dtype, config.kvcache_block_size, self.hf_config.head_dim
        )
        if config.kvcache_block_size is None:  # flash-attn's paged kernels want multiples of 256
            config.kvcache_block_size = 256 if config.attention_backend in FLASH_ATTN_BACKENDS else 16
        self.block_size = config.kvcache_block_size
        # tensor parallelism: rank 0 starts (or, under torchrun, joins) the other ranks before building its shard
        self.followers: Followers | None = None
        if parallel is None and config.tensor_parallel_size > 1:
            parallel, self.followers = start_tensor_parallel(config, ModelRunner)
            if self.followers is not None:  # an engine dropped without close(), or the end of the script
                weakref.finalize(self, self.followers.close)
        self.parallel = parallel or ParallelState()
        self.rank, self.world_size = self.parallel.rank, self.parallel.world_size
        self.device: torch.device = rank_device(config, self.rank)
        if self.rank > 0 and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a follower's process: its collectives run on its own GPU
        try:
            self._build(config)
        except BaseException:
            if self.followers is not None:  # they wait in a collective this rank will never join
                self.followers.shutdown("rank 0 failed while building the engine")
            raise

    def _build(self, config: EngineConfig) -> None:
        with tensor_parallel(self.parallel):
            self.model = build_model(
                config.architecture, self.hf_config, self.device, config.dtype, config.max_model_len
            )
        load_weights(self.model, config.model_folder)
        self.backend = resolve_backend(config.attention_backend, self.device)
        if self.followers is not None and "triton" not in self.backend.name:
            self.followers.unused_seams = TRITON_SEAMS  # (their functions need not, or cannot, travel)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend
        self.sampler = Sampler()
        # unseeded requests draw from this (seeded requests from their own): never from (or into) the global RNG.
        # LLM(seed=N) makes their draws repeat from one engine to the next; None: fresh entropy
        self.generator = torch.Generator(device=self.device)
        if config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(config.seed)
        # at most this many blocks per sequence: the width of the decode block tables
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        # every sequence's block table as a row of one array: the block manager's, attached by the engine
        self.block_tables = BlockTables()
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._blocks_from_memory()
        if self.world_size > 1:  # one block table serves every rank: each must hold the same count
            count = torch.tensor([self.num_kvcache_blocks])
            self.parallel.group.all_reduce(count, dist.ReduceOp.MIN)
            self.num_kvcache_blocks = int(count)
        self._allocate_kv_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_vars: dict[str, torch.Tensor] = {}  # the static inputs replay reads (see capture_cudagraphs)
        # a model whose forward has data-dependent shapes (Qwen3-MoE's expert loop) runs decode eagerly
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and getattr(self.model, "supports_cuda_graphs", True)
        ):
            self.capture_cudagraphs()

    # -- the KV cache ---------------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        """KV heads in this rank's cache: all of them on one device, a 1/N share (or one replica) under TP."""
        return self.attention_layers[0].num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.hf_config
        return 2 * c.num_hidden_layers * self.num_kv_heads * c.head_dim * self.config.dtype.itemsize

    def _blocks_from_memory(self) -> int:
        per_block = self.kv_bytes_per_token * self.block_size
        if self.device.type == "cuda":
            # Run the largest prefill once to learn the activations' peak, then give the KV cache
            # what remains of gpu_memory_utilization.
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._warmup()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            peak = torch.cuda.memory_stats(self.device)["allocated_bytes.all.peak"]
            current = torch.cuda.memory_stats(self.device)["allocated_bytes.all.current"]
            budget = int(total * self.config.gpu_memory_utilization) - used - (peak - current)
            num_blocks = budget // per_block
            if num_blocks <= 0:
                raise RuntimeError(
                    "no GPU memory left for the KV cache at "
                    f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
                )
            return num_blocks
        # CPU: enough for max_num_seqs full-length sequences, but never more than a quarter of free RAM
        wanted = self.config.max_num_seqs * self.max_blocks_per_seq
        return max(1, min(wanted, _cpu_memory_available() // 4 // per_block))

    def _allocate_kv_cache(self) -> None:
        c = self.hf_config
        shape = (2, c.num_hidden_layers, self.num_kvcache_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.config.dtype, device=self.device)
        for index, layer in enumerate(self.attention_layers):
            layer.k_cache = self.kv_cache[0, index]  # (num_blocks, block_size, Hk, D), a view
            layer.v_cache = self.kv_cache[1, index]

    @torch.inference_mode()
    def _warmup(self) -> None:
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.config.max_model_len)
        seq_len = min(self.config.max_model_len, num_tokens)
        num_seqs = max(1, num_tokens // seq_len)
        cu = torch.tensor([0] + [seq_len * (i + 1) for i in range(num_seqs)], dtype=torch.int32, device=self.device)
        set_context(
            Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len, max_seqlen_k=seq_len)
        )
        ids = torch.zeros(seq_len * num_seqs, dtype=torch.int64, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        self.model.compute_logits(self.model(ids, positions))
        reset_context()

    # -- flat inputs ----------------------------------------------------------------------------
    def _tensor(self, values: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A Python list or numpy array as a device tensor; on CUDA through pinned memory, so the copy does not
        block (the pinned staging copy is fresh each time: the caching host allocator reuses it only once the
        copy out of it has run)."""
        if isinstance(values, np.ndarray):
            host = torch.from_numpy(values).to(dtype)
            if self.device.type != "cuda":
                return host
            return host.pin_memory().to(self.device, non_blocking=True)
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.start_step(self.prefill_inputs(seqs))

    def prefill_inputs(self, seqs: list[Sequence]) -> StepInputs:
        flat = seam("prefill_metadata", prefill_metadata)(
            [seq.token_ids for seq in seqs],
            [seq.num_computed_tokens for seq in seqs],  # earlier chunks and prefix-cache hits are already cached
            [seq.num_scheduled_tokens for seq in seqs],
            [seq.block_table for seq in seqs],
            self.block_size,
        )
        return StepInputs(
            is_prefill=True,
            num_seqs=len(seqs),
            prefill=PrefillMetadata(*flat),
            max_seqlen_q=max(seq.num_scheduled_tokens for seq in seqs),
            max_seqlen_k=max(seq.num_computed_tokens + seq.num_scheduled_tokens for seq in seqs),
            # with history, attention must read keys from the paged cache, through the block tables
            block_tables=self.block_tables.padded(seqs) if any(seq.num_computed_tokens for seq in seqs) else None,
        )

    def prepare_decode(
        self, seqs: list[Sequence], next_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """next_ids: (num_seqs,) the input tokens, already on the device (the overlapped loop). They were sampled
        by the step still in flight and are not in seq.token_ids yet, so each sequence is one token longer than
        the host sees: its new token sits at position len(seq.token_ids), not len(seq.token_ids) - 1."""
        return self.start_step(self.decode_inputs(seqs, ahead=next_ids is not None), next_ids)

    def decode_inputs(self, seqs: list[Sequence], ahead: bool = False) -> StepInputs:
        # Vectorised over the batch, one host-to-device copy: in the plain loop this runs every decode step while the
        # GPU waits, so every Python call and copy here shows up in the step time. The padded block tables are rows
        # of the block manager's persistent array (written only when a sequence gains blocks), not rebuilt from lists.
        size = self.block_size
        num_seqs = len(seqs)
        context_lens = np.fromiter((len(seq.token_ids) for seq in seqs), dtype=np.int64, count=num_seqs) + ahead
        positions = context_lens - 1  # the new token's position
        tables = self.block_tables.padded(seqs)  # (num_seqs, width), -1 padded
        slots = tables[np.arange(num_seqs), positions // size] * size + positions % size  # (num_seqs,)
        input_ids = np.fromiter((seq.token_ids[-1] for seq in seqs), dtype=np.int64, count=num_seqs)
        packed = np.concatenate([input_ids, positions, slots, context_lens, tables.ravel()]).astype(np.int32)
        return StepInputs(is_prefill=False, num_seqs=num_seqs, packed=packed)

    def start_step(self, step: StepInputs, next_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Send the step to the other tensor-parallel ranks (if any), then upload it here."""
        if self.followers is not None:
            self.followers.send_step(step, next_ids)
        return self.upload(step, next_ids)

    def upload(self, step: StepInputs, next_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a step's host inputs to the device and publish its Context -> (input_ids (N,), positions (N,))."""
        if step.is_prefill:
            flat = step.prefill
            context = Context(
                is_prefill=True,
                cu_seqlens_q=self._tensor(flat.cu_seqlens_q, torch.int32),  # (num_seqs + 1,)
                cu_seqlens_k=self._tensor(flat.cu_seqlens_k, torch.int32),  # (num_seqs + 1,)
                max_seqlen_q=step.max_seqlen_q,
                max_seqlen_k=step.max_seqlen_k,
                slot_mapping=self._tensor(flat.slot_mapping, torch.int64),  # (N,)
                block_tables=None if step.block_tables is None else self._tensor(step.block_tables, torch.int32),
            )
            set_context(context)
            return self._tensor(flat.input_ids, torch.int64), self._tensor(flat.positions, torch.int64)  # (N,), (N,)
        num_seqs = step.num_seqs
        packed = self._tensor(step.packed, torch.int32)
        ids_positions_slots = packed[: 3 * num_seqs].view(3, num_seqs).long()  # (3, num_seqs)
        set_context(
            Context(
                is_prefill=False,
                slot_mapping=ids_positions_slots[2],  # (num_seqs,)
                context_lens=packed[3 * num_seqs : 4 * num_seqs],  # (num_seqs,)
                block_tables=packed[4 * num_seqs :].view(num_seqs, -1),  # (num_seqs, max_blocks)
            )
        )
        input_ids = ids_positions_slots[0] if next_ids is None else next_ids  # (ahead: the host's is a stale id)
        return input_ids, ids_positions_slots[1]  # (num_seqs,), (num_seqs,)

    def prepare_sample(self, seqs: list[Sequence], is_prefill: bool = False) -> SamplingBatch:
        """Each row's settings, plus the host facts (all greedy? any top-k/top-p? which rows seeded?)
        that let the sampler choose its path without reading the device.

        A prefill row that ends mid-prompt emits no token (Scheduler.postprocess drops it): it is sampled greedily,
        so it draws nothing from its request's generator, and a seeded request's draws are the same however its
        prompt was chunked (and when every row is greedy or mid-prompt, nothing is drawn from the engine's either).
        """
        params = [seq.sampling_params for seq in seqs]
        temperatures = [p.temperature for p in params]
        generators = [seq.generator for seq in seqs]
        if is_prefill:
            for row, seq in enumerate(seqs):
                if seq.num_computed_tokens + seq.num_scheduled_tokens < seq.num_tokens:
                    temperatures[row], generators[row] = 0.0, None
        return SamplingBatch.from_host(
            temperatures,
            [p.top_k for p in params],
            [p.top_p for p in params],
            generators,
            device=self.device,
            default_generator=self.generator,
        )

    # -- running ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool) -> torch.Tensor:
        batch = input_ids.shape[0]
        if is_prefill or tracing_enabled() or not self.graph_vars or batch > self.config.max_num_seqs:
            return self.model.compute_logits(self.model(input_ids, positions))
        return self._replay(input_ids, positions, batch)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One forward over the scheduled sequences -> one sampled token id per sequence."""
        return self.launch(seqs, is_prefill).tolist()  # the step's one host sync

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, next_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Queue one forward and its sampling on the device -> the sampled ids (num_seqs,), still on the device.

        Nothing here waits for the device, so the host may go on (the overlapped loop schedules the next step).
        next_ids: a decode step's input tokens as the device already holds them (see prepare_decode).
        """
        with self._collective():
            try:
                if is_prefill:
                    input_ids, positions = self.prepare_prefill(seqs)
                else:
                    input_ids, positions = self.prepare_decode(seqs, next_ids)
                return self._run(seqs, input_ids, positions, is_prefill)
            finally:
                reset_context()  # also when the step raises: the next step must not see this one's metadata

    # -- tensor parallelism: rank 0's side and the followers' loop ------------------------------
    def _collective(self) -> AbstractContextManager:
        """Around rank 0's part of anything every rank runs together (see Followers.guard)."""
        return self.followers.guard() if self.followers is not None else nullcontext()

    def serve(self) -> None:
        """A follower's life (ranks 1..N-1): run each step rank 0 sends, until it says exit; then meet rank 0 at
        the group's last barrier (no rank tears its connections down while another still uses them) and close
        this rank's groups."""
        group = self.parallel.group
        while True:
            message = receive(group)
            kind = message[0]
            if kind == "exit":
                group.barrier()
                group.close(CLOSED)
                return
            if kind == "step":
                _, step, num_next_ids = message
                next_ids = None if num_next_ids is None else receive_next_ids(group, num_next_ids, self.device)
                try:
                    input_ids, positions = self.upload(step, next_ids)
                    self.run_model(input_ids, positions, step.is_prefill)  # rank 0 alone gets the logits
                finally:
                    reset_context()
            elif kind == "call":
                self._call_here(partial(_run_call, self, message[1]))
            elif kind == "seams":  # rank 0 entered or left a `use(...)` block of exercise functions
                replace_active(pickle.loads(message[1]))

    def run_on_all_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(runner, *args) on every rank's model runner -> the results, by rank. fn and args travel by value
        (cloudpickle: a lambda or a notebook's function works); the results must pickle. One that cannot be sent is
        a TypeError before anything is sent; fn raising on any rank raises here (a follower's error as a
        TensorParallelError with its traceback), after every rank has finished: the engine keeps serving."""
        if self.world_size == 1:
            return [fn(self, *args)]
        with self._collective():
            if self.followers is not None:
                self.followers.call(fn, args)
            error, gathered = self._call_here(lambda: fn(self, *args))
        if error is not None:
            raise error
        for rank, (kind, value) in enumerate(gathered):
            if kind == "error":
                name = getattr(fn, "__qualname__", repr(fn))
                raise TensorParallelError(f"run_on_all_ranks({name}) raised on rank {rank}:\n{value}")
        return [value for _, value in gathered]

    def _call_here(self, run: Callable[[], Any]) -> tuple[Exception | None, list[tuple[str, Any]] | None]:
        """Run one call on this rank and gather every rank's outcome to rank 0: ("ok", result) or ("error", its
        traceback). An error is gathered like a result, so every rank still meets rank 0 and the ranks stay in
        step. Rank 0 keeps its own error (the exception itself) -> (it, the outcomes by rank); the others None."""
        error = None
        try:
            outcome: tuple[str, Any] = ("ok", run())
            payload = pickle.dumps(outcome) if self.rank > 0 else b""  # (rank 0's result stays here)
        except Exception as raised:
            error = raised if self.rank == 0 else None
            payload = pickle.dumps(("error", f"{type(raised).__name__}: {raised}\n{traceback.format_exc()}"))
            outcome = ("error", None)
        parts = self.parallel.group.gather_bytes(payload)
        if parts is None:
            return None, None
        return error, [outcome] + [pickle.loads(part) for part in parts[1:]]

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and close the engine's groups (nothing to do on one device)."""
        if self.followers is not None:
            self.followers.close()

    def _run(
        self, seqs: list[Sequence], input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool
    ) -> torch.Tensor:
        if tracing_enabled():
            c = get_context()
            trace_step(
                "prefill" if is_prefill else "decode",
                seq_ids=[seq.seq_id for seq in seqs],
                input_ids=input_ids,
                positions=positions,
                cu_seqlens_q=c.cu_seqlens_q,
                cu_seqlens_k=c.cu_seqlens_k,
                slot_mapping=c.slot_mapping,
                context_lens=c.context_lens,
                block_tables=c.block_tables,
            )
        logits = self.run_model(input_ids, positions, is_prefill)  # (num_seqs, vocab)
        sampling = self.prepare_sample(seqs, is_prefill)  # host work while the GPU runs the forward just launched
        return self.sampler(logits, batch=sampling)  # (num_seqs,)

    # -- CUDA graphs (decode only) --------------------------------------------------------------
    def _graph_batch_sizes(self) -> list[int]:
        top = self.config.max_num_seqs
        sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
        return sizes + [top]  # always include max_num_seqs itself, whatever it is

    def _allocate_static_inputs(self) -> None:
        """The buffers every replay reads: max_num_seqs rows each; a bucket of size S uses the first S."""
        max_bs, dev = self.config.max_num_seqs, self.device
        self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            hidden=torch.zeros(max_bs, self.hf_config.hidden_size, dtype=self.config.dtype, device=dev),
        )

    def enable_bucketed_decode(self) -> None:
        """Run decode the way graphs do, on a machine without them (a CPU; notebook 06): pad each batch to its
        bucket in the static buffers and run the model eagerly on them. Slower; for teaching and tests."""
        if not self.graph_vars:
            self._allocate_static_inputs()

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """Record one decode forward per batch-size bucket; replay pads a batch up to its bucket.

        Graphs replay fixed kernels on fixed addresses, so inputs live in static buffers that each
        step fills in place. Padding rows carry slot -1 (store nothing) and context length 0.
        """
        self._allocate_static_inputs()
        v = self.graph_vars
        pool = None
        for batch_size in reversed(self._graph_batch_sizes()):
            graph = torch.cuda.CUDAGraph()
            set_context(
                Context(
                    is_prefill=False,
                    slot_mapping=v["slot_mapping"][:batch_size],
                    context_lens=v["context_lens"][:batch_size],
                    block_tables=v["block_tables"][:batch_size],
                )
            )
            ids, positions = v["input_ids"][:batch_size], v["positions"][:batch_size]
            v["hidden"][:batch_size] = self.model(ids, positions)  # warm up outside capture
            with torch.cuda.graph(graph, pool):
                v["hidden"][:batch_size] = self.model(ids, positions)
            pool = pool or graph.pool()
            self.graphs[batch_size] = graph
            torch.cuda.synchronize(self.device)
            reset_context()

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: int) -> torch.Tensor:
        bucket = min(b for b in (self.graphs or self._graph_batch_sizes()) if b >= batch)
        context, v = get_context(), self.graph_vars
        static = {name: v[name][:bucket] for name in STATIC_INPUTS}
        seam("pad_decode_batch", pad_decode_batch)(
            static, input_ids, positions, context.slot_mapping, context.context_lens, context.block_tables
        )
        if self.graphs:
            self.graphs[bucket].replay()
        else:  # bucketed decode without graphs: the same padded batch, run eagerly
            width = context.block_tables.shape[1]
            bucket_context = Context(
                is_prefill=False,
                slot_mapping=static["slot_mapping"],
                context_lens=static["context_lens"],
                block_tables=static["block_tables"][:, :width],
            )
            set_context(bucket_context)
            v["hidden"][:bucket] = self.model(static["input_ids"], static["positions"])
        return self.model.compute_logits(v["hidden"][:batch])


def _run_call(runner: ModelRunner, payload: bytes) -> Any:
    """A follower's part of run_on_all_ranks: the function and its arguments as rank 0 pickled them."""
    fn, args = pickle.loads(payload)
    return fn(runner, *args)
