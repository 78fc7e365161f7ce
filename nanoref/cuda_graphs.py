"""Decode CUDA graphs: one recorded decode forward per batch-size bucket, replayed with the step's inputs.

A decode step of a small model is bound by kernel launches, not by math (notebook 06). A CUDA graph records the
step's kernels once, on fixed addresses, and replays them with one launch. So the inputs live in static buffers
that each step fills in place, and a batch of B sequences runs in the smallest recorded bucket S >= B: rows
B..S-1 are padding that the kernels process harmlessly (slot -1 stores nothing, context length 0 reads nothing).

Attached by `nanoref/llm.py` as the model runner's `decode_graphs`; the runner asks `covers(batch)` and then
`run(...)`. Given `shared_prefix_min_seqs` (steps whose sequences read a prefix they share once: cascade attention,
`Context.shared_prefix_lens`, nanoref/cascade.py), a second graph records such a step's kernels, the prefix lengths
in one more static buffer (0 in padding rows), for every CASCADE_BUCKET_STEP-th bucket of at least that many
sequences (each graph is a capture while the engine is built; a batch pads up to the next of those); a step
replays the graph of its kind.
`DecodeGraphs(runner, record=False)` (`enable_bucketed_decode`) runs the same padded buckets eagerly,
on a machine without graphs (a CPU): for teaching and tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator

import torch

from nanoref.utils.context import Context, get_context, reset_context, set_context
from nanoref.utils.progress import tqdm
from nanoref.utils.seams import seam
from nanoref.utils.tracing import tracing_enabled

STATIC_INPUTS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")
CASCADE_BUCKET_STEP = 64  # graphs of steps over a shared prefix: for buckets of 64, 128, ... sequences (and the last)


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
    (A speculative verify step has Lq = k + 1 tokens per sequence: its token buffers and inputs have S * Lq and
    B * Lq rows, the sequences' tokens one after the other.)
    A padding row still runs through every kernel of the recorded graph: slot -1 makes the KV store skip it
    and context length 0 makes attention read nothing for it. Its token id and position only need to be
    valid (what an earlier step left there is).
    """
    batch, width = block_tables.shape
    tokens = input_ids.shape[0]  # B (or B * Lq)
    buffers["input_ids"][:tokens] = input_ids
    buffers["positions"][:tokens] = positions
    buffers["slot_mapping"][:tokens] = slot_mapping
    buffers["slot_mapping"][tokens:] = -1
    buffers["context_lens"][:batch] = context_lens
    buffers["context_lens"][batch:] = 0
    buffers["block_tables"][:batch, :width] = block_tables


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are recorded for: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self, runner, record: bool = True, query_len: int = 1, shared_prefix_min_seqs: int | None = None
    ) -> None:
        """runner: a model runner with its model and KV cache. record: capture the graphs (CUDA); False runs
        the padded buckets eagerly instead. query_len: tokens per sequence (k + 1 for a speculative verify step,
        nanoref/speculative/). shared_prefix_min_seqs: the fewest sequences a step over a shared prefix has (its
        graphs start there); None: no such steps."""
        self.model, device, config = runner.model, runner.device, runner.config
        self.buckets = batch_buckets(config.max_num_seqs)
        self.query_len = query_len
        rows, width = config.max_num_seqs, runner.max_blocks_per_seq
        tokens = rows * query_len
        # the buffers every replay reads: max_num_seqs rows (of query_len tokens) each; a bucket of size S uses the
        # first S (S * query_len tokens). Recorded, they are inference tensors, as every step's inputs are: a compiled
        # layer that saw a plain tensor in capture (positions) would recompile at the first real step
        with torch.inference_mode(record):
            self.buffers = self.make_buffers(tokens, rows, width, config, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # (bucket: steps over a shared prefix)
        self.cascade_buckets = [
            size
            for size in self.buckets
            if shared_prefix_min_seqs is not None
            and size >= shared_prefix_min_seqs
            and (size % CASCADE_BUCKET_STEP == 0 or size == self.buckets[-1])
        ]
        if record:
            self.capture(device)

    @staticmethod
    def make_buffers(tokens: int, rows: int, width: int, config, device: torch.device) -> dict[str, torch.Tensor]:
        return dict(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(tokens, dtype=torch.int64, device=device),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
            context_lens=torch.zeros(rows, dtype=torch.int32, device=device),
            block_tables=torch.zeros(rows, width, dtype=torch.int32, device=device),
            shared_prefix_lens=torch.zeros(rows, dtype=torch.int32, device=device),
            hidden=torch.zeros(tokens, config.hf_config.hidden_size, dtype=config.dtype, device=device),
        )

    @torch.inference_mode()
    def capture(self, device: torch.device) -> None:
        """Record one decode forward per bucket (and one over a shared prefix), the largest first (the others share
        its memory pool)."""
        b, pool = self.buffers, None
        # a bar on a terminal (as vLLM's "Capturing CUDA graphs"): with the warm-up compiles, seconds; off in logs
        bar = tqdm(reversed(self.buckets), desc="Capturing CUDA graphs (decode)", total=len(self.buckets), disable=None)
        with garbage_collected_first(), bar:
            for size in bar:
                kinds = [(self.graphs, None)]
                if size in self.cascade_buckets:
                    kinds.append((self.cascade_graphs, b["shared_prefix_lens"][:size]))
                for graphs, prefix_lens in kinds:
                    graphs[size] = graph = torch.cuda.CUDAGraph()
                    tokens = size * self.query_len
                    context = Context(
                        slot_mapping=b["slot_mapping"][:tokens],
                        context_lens=b["context_lens"][:size],
                        block_tables=b["block_tables"][:size],
                        shared_prefix_lens=prefix_lens,
                        decode_query_len=self.query_len,
                    )
                    ids, positions = b["input_ids"][:tokens], b["positions"][:tokens]
                    set_context(context)
                    b["hidden"][:tokens] = self.model(ids, positions)  # warm up outside capture
                    # a fresh Context for the capture: what the layers derive from it once per step (the decode
                    # schedule) is then recorded too, and recomputed at every replay
                    set_context(dataclasses.replace(context, scheduler_metadata=None))
                    with torch.cuda.graph(graph, pool):
                        b["hidden"][:tokens] = self.model(ids, positions)
                    pool = pool or graph.pool()
                    torch.cuda.synchronize(device)
                    reset_context()

    def covers(self, batch: int) -> bool:
        """Whether a decode batch of this many sequences runs here (a shape trace wants every layer run
        eagerly)."""
        return batch <= self.buckets[-1] and not tracing_enabled()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode step's (B,) inputs ((B * query_len,) for a verify step; its Context already published) ->
        logits (B, vocab) ((B * query_len, vocab))."""
        tokens, context = input_ids.shape[0], get_context()
        prefixes = context.shared_prefix_lens
        buckets = self.buckets if prefixes is None else self.cascade_buckets
        bucket = next((size for size in buckets if size * self.query_len >= tokens), None)
        if bucket is None:  # no graph of a step over a shared prefix this large: the plain step (the same result)
            bucket, prefixes = next(size for size in self.buckets if size * self.query_len >= tokens), None
        rows = {"context_lens": bucket, "block_tables": bucket}  # per sequence; the others per token
        static = {name: self.buffers[name][: rows.get(name, bucket * self.query_len)] for name in STATIC_INPUTS}
        seam("pad_decode_batch", pad_decode_batch)(
            static, input_ids, positions, context.slot_mapping, context.context_lens, context.block_tables
        )
        hidden = self.buffers["hidden"]
        if prefixes is not None:  # (only set where the runner reads shared prefixes, for enough sequences)
            static_prefixes = self.buffers["shared_prefix_lens"][:bucket]
            static_prefixes[: len(prefixes)] = prefixes
            static_prefixes[len(prefixes) :] = 0  # padding rows have no prefix
        if self.graphs:
            (self.graphs if prefixes is None else self.cascade_graphs)[bucket].replay()
        else:  # bucketed decode without graphs: the same padded batch, run eagerly
            width = context.block_tables.shape[1]
            set_context(
                Context(
                    slot_mapping=static["slot_mapping"],
                    context_lens=static["context_lens"],
                    block_tables=static["block_tables"][:, :width],
                    shared_prefix_lens=None if prefixes is None else static_prefixes,
                    decode_query_len=self.query_len,
                )
            )
            hidden[: bucket * self.query_len] = self.model(static["input_ids"], static["positions"])
        return self.model.compute_logits(hidden[:tokens])


@contextlib.contextmanager
def garbage_collected_first() -> Iterator[None]:
    """Collect garbage now, and none while the block runs: a CUDA graph freed during a capture (a dropped engine's,
    left in a reference cycle until the collector finds it) invalidates the capture ("operation not permitted when
    stream is capturing"), and torch.cuda.graph no longer collects before capturing. The collector's state is
    the caller's again afterwards."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def enable_bucketed_decode(runner) -> None:
    """Run decode the way graphs do, on a machine without them (a CPU; notebook 06): pad each batch to its
    bucket in the static buffers and run the model eagerly on them. Slower; for teaching and tests."""
    if runner.decode_graphs is None:
        runner.decode_graphs = DecodeGraphs(runner, record=False)
