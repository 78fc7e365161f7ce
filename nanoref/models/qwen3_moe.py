"""Qwen3-MoE in the flat layout: dense Qwen3 with a sparse mixture-of-experts block in place of some MLPs.

Attention, norms, the decoder layer and the model around them are the dense Qwen3's (imported, not
copied). What changes is the feed-forward block of the "sparse" layers: a router scores every token
against `num_experts` small SwiGLU MLPs (the experts), each token keeps its `num_experts_per_tok` best,
and its output is the router-weighted sum of those experts' outputs. The flat `(N, hidden)` layout suits
this well: routing is per token, so a token's row is simply gathered for each expert it picked and the
expert's answer added back to that same row (`index_add_`); no sequence or batch structure is involved.
`moe_experts` below does this one expert at a time (the readable reference, and the CPU's path); on a GPU the
same sum runs as two grouped matmuls over all experts at once (`nanoref/ops/moe_grouped.py`), whose shapes do
not depend on the routing, so the decode CUDA graphs can record them.

Which layers are sparse follows HF's `Qwen3MoeDecoderLayer`: layer i is sparse when i is not in
`mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0` (`Qwen3MoeConfig.is_sparse`, in configs.py); the
other layers keep a dense MLP of `intermediate_size`. Each expert's MLP has `moe_intermediate_size`.

The expert weights are stacked into two 3-D parameters per layer, `experts.gate_up_proj` (E, 2 I, hidden)
and `experts.down_proj` (E, hidden, I), the layout a grouped matmul wants and the one transformers 5 uses
inside its models. Checkpoints on the hub (and what `save_pretrained` writes by default) store one
tensor per expert, `mlp.experts.{e}.gate_proj.weight` etc.; the loader fills the stacks from those, or
takes the stacked tensors whole (`save_pretrained(save_original_format=False)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from nanoref.layers.activation import silu_and_mul
from nanoref.layers.linear import Linear
from nanoref.models.configs import Qwen3MoeConfig
from nanoref.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP
from nanoref.ops.moe_grouped import grouped_path_serves, moe_experts_grouped
from nanoref.parallel.state import all_reduce, get_parallel_state
from nanoref.utils.seams import seam
from nanoref.utils.tracing import trace, tracing_enabled
from nanoref.utils.weak import WeakBoundMethod

# -- routing and the experts: small pure functions -------------------------------------------------


def route(
    hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick each token's experts. hidden (N, hidden), router_weight (E, hidden).

    Returns router_logits (N, E) in hidden's dtype, topk_weights (N, K) in hidden's dtype and topk_ids
    (N, K) int64, each row's experts in descending probability.
    """
    router_logits = F.linear(hidden, router_weight)  # (N, E)
    # softmax in float32 whatever the model's dtype (as HF does): in bf16, close experts' probabilities would
    # round to equal values, and both the top-k pick among them and the weights would depend on rounding
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (N, E)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # (N, K), (N, K)
    if norm_topk_prob:  # weights of the kept experts sum to 1; off, they keep their share of all E
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # (N, K)
    return router_logits, topk_weights.to(hidden.dtype), topk_ids


def moe_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum for every token, one expert at a time (the readable reference).

    hidden (N, hidden); topk_weights (N, K) in hidden's dtype; topk_ids (N, K) int64 in [0, E);
    w_gate_up (E, 2 I, hidden) = each expert's [gate | up] rows; w_down (E, hidden, I). Returns (N, hidden):
    row n = sum over k of topk_weights[n, k] * expert_{topk_ids[n, k]}(hidden[n]).
    """
    out = torch.zeros_like(hidden)  # (N, hidden): tokens add their experts' answers into their own row
    for expert in range(w_gate_up.shape[0]):
        # which tokens chose this expert, and in which of their K slots (a token picks an expert at most once)
        rows, slots = torch.where(topk_ids == expert)  # (M,), (M,): M tokens routed here
        if rows.numel() == 0:
            continue  # nobody chose it: no work, not even a zero-row matmul
        x = hidden.index_select(0, rows)  # (M, hidden): the routed tokens, gathered together
        gate_up = F.linear(x, w_gate_up[expert])  # (M, 2 I)
        y = F.linear(silu_and_mul(gate_up), w_down[expert])  # (M, I) -> (M, hidden)
        y = y * topk_weights[rows, slots].unsqueeze(-1)  # (M, hidden): scaled by the router's weight
        out.index_add_(0, rows, y)  # back to each token's own row; a token's K experts accumulate there
        if tracing_enabled():  # each expert's real share of the step (M differs per expert and per step)
            trace(f"moe.expert.{expert}", rows=rows, x=x, gate_up=gate_up, y=y)
    return out


# -- modules -------------------------------------------------------------------------------------


class Qwen3MoeExperts(nn.Module):
    """E SwiGLU MLPs stacked into two 3-D weights (no forward of its own: `moe_experts` runs them).

    Under tensor parallelism every rank holds all E experts, each with 1/N of its intermediate: rank r keeps
    gate and up rows [r I/N, (r+1) I/N) and the matching down_proj columns, so each expert's output on a rank
    is a partial sum, added up by the block's one all-reduce (as in a dense row-parallel MLP)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        parallel = get_parallel_state()
        self.tp_rank, self.tp_size = parallel.rank, parallel.world_size
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) must divide evenly over "
                f"tensor_parallel_size={self.tp_size}"
            )
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = intermediate_size // self.tp_size  # this rank's share
        rows = self.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, rows))
        self.gate_up_proj.weight_loader = WeakBoundMethod(self.weight_loader)  # (weakly: no layer <-> parameter cycle)
        self.down_proj.weight_loader = WeakBoundMethod(self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None] | None = None
    ) -> None:
        """shard_id None: the whole stack (E, ...). Else (expert, part): part 0/1 = gate/up rows of gate_up_proj,
        part None = that expert's down_proj. The checkpoint tensor is whole; this rank keeps its slice."""
        full, mine, start = self.full_intermediate_size, self.intermediate_size, self.tp_rank * self.intermediate_size
        num_experts, hidden = param.shape[0], self.down_proj.shape[1]
        is_gate_up = param is self.gate_up_proj
        if shard_id is None:
            expected = (num_experts, 2 * full, hidden) if is_gate_up else (num_experts, hidden, full)
        else:
            expected = ((full if shard_id[1] is not None else 2 * full), hidden) if is_gate_up else (hidden, full)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
        if not is_gate_up:  # down_proj (.., hidden, I): this rank's columns
            target = param.data if shard_id is None else param.data[shard_id[0]]
            target.copy_(loaded.narrow(-1, start, mine))
            return
        # gate_up_proj: gate rows first, then up (silu_and_mul's [gate | up]), each cut to this rank's rows
        target = param.data if shard_id is None else param.data[shard_id[0]]  # (E, 2 I/N, hidden) or (2 I/N, hidden)
        if shard_id is None:
            parts = loaded.split(full, dim=1)  # (E, I, hidden) twice
            for part, piece in enumerate(parts):
                target[:, part * mine : (part + 1) * mine].copy_(piece.narrow(1, start, mine))
        elif shard_id[1] is None:  # an expert's fused [gate | up] (2 I, hidden)
            for part, piece in enumerate(loaded.split(full, dim=0)):
                target[part * mine : (part + 1) * mine].copy_(piece.narrow(0, start, mine))
        else:
            part = shard_id[1]
            target[part * mine : (part + 1) * mine].copy_(loaded.narrow(0, start, mine))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router + experts: (N, hidden) -> (N, hidden), each token through its top-k experts."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)  # the router (HF's name: mlp.gate)
        self.experts = Qwen3MoeExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.parallel = get_parallel_state()  # the group of the all-reduce after the experts

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, hidden) -> router_logits (N, E), topk_weights (N, K), topk_ids (N, K)."""
        return seam("moe_route", route)(hidden, self.gate.weight, self.top_k, self.norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # On a GPU the grouped path (fixed shapes, no host sync: a CUDA graph can record it); elsewhere the loop
        grouped = grouped_path_serves(self.experts.gate_up_proj)
        if not grouped and hidden.is_cuda and torch.cuda.is_current_stream_capturing():  # else a cryptic error
            raise RuntimeError(
                "Qwen3-MoE's expert loop picks tokens with data-dependent shapes, which a CUDA graph cannot "
                "record; run it with enforce_eager=True"
            )
        router_logits, topk_weights, topk_ids = self.route(hidden)
        trace("moe.router", hidden=hidden, router_logits=router_logits, topk_weights=topk_weights, topk_ids=topk_ids)
        experts = moe_experts_grouped if grouped else moe_experts
        out = seam("moe_experts", experts)(
            hidden, topk_weights, topk_ids, self.experts.gate_up_proj, self.experts.down_proj
        )
        # tensor parallel: each rank's experts hold 1/N of the intermediate, so `out` is a partial sum
        out = all_reduce(out, self.parallel)
        trace("moe.experts", w_gate_up=self.experts.gate_up_proj, w_down=self.experts.down_proj, out=out)
        return out


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """The dense Qwen3 model, whose sparse layers get a `Qwen3MoeSparseMoeBlock` as their MLP."""

    config_class = Qwen3MoeConfig

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether decode may be recorded in CUDA graphs: where every sparse layer runs the grouped path (a GPU
        with a grouped matmul for the weights' dtype). The expert loop picks its tokens with data-dependent
        shapes (torch.where), which a graph cannot record."""
        return all(grouped_path_serves(block.experts.gate_up_proj) for block in self.sparse_blocks().values())

    def make_mlp(self, layer_index: int) -> nn.Module:
        if self.config.is_sparse(layer_index):
            return Qwen3MoeSparseMoeBlock(self.config)
        return Qwen3MLP(self.config)  # dense layers use intermediate_size, as in HF

    def sparse_blocks(self) -> dict[int, Qwen3MoeSparseMoeBlock]:
        """layer index -> its MoE block, for the sparse layers only."""
        return {
            index: layer.mlp
            for index, layer in enumerate(self.model.layers)
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)
        }

    def checkpoint_shards(self) -> dict[str, tuple[str, tuple[int, int | None]]]:
        """The hub's per-expert tensor names -> (stacked parameter, (expert, part)); see loader.checkpoint_names."""
        names = {}
        for index, block in self.sparse_blocks().items():
            prefix = f"model.layers.{index}.mlp.experts"
            for expert in range(block.experts.gate_up_proj.shape[0]):
                names[f"{prefix}.{expert}.gate_proj.weight"] = (f"{prefix}.gate_up_proj", (expert, 0))
                names[f"{prefix}.{expert}.up_proj.weight"] = (f"{prefix}.gate_up_proj", (expert, 1))
                names[f"{prefix}.{expert}.down_proj.weight"] = (f"{prefix}.down_proj", (expert, None))
        return names


@contextmanager
def count_expert_tokens(model: Qwen3MoeForCausalLM) -> Iterator[dict[int, torch.Tensor]]:
    """Count, per sparse layer, how many tokens each expert receives while the block runs.

        with count_expert_tokens(llm.model_runner.model) as counts:
            llm.generate(...)
        counts[0]   # (E,) int64: tokens routed to each expert of layer 0 (each token counts K times)

    It re-runs each sparse layer's router on that layer's input (one small matmul per layer and step) through a
    forward hook, so the model's own code does not change; hooks are removed on exit.
    """
    counts = {
        index: torch.zeros(block.gate.weight.shape[0], dtype=torch.int64)
        for index, block in model.sparse_blocks().items()
    }
    handles = []
    for index, block in model.sparse_blocks().items():

        def hook(block: Qwen3MoeSparseMoeBlock, args: tuple, index: int = index) -> None:
            _, _, topk_ids = block.route(args[0])
            counts[index] += torch.bincount(topk_ids.flatten(), minlength=counts[index].numel()).cpu()  # (E,)

        handles.append(block.register_forward_pre_hook(hook))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()
