"""Adapters in device slots, and the per-row slot index every adapted projection reads.

`LoRAManager` gives each adapted projection of the model (qkv, o, gate_up, down of every decoder layer) stacked
weights for `max_loras` slots, `lora_a (S, R, in)` and `lora_b (S, R, out)` per piece of a fused projection, and
adds `ops/lora.lora_delta` to the projection's output through a forward hook: the model's own code is untouched,
and base-model rows (slot -1) get W alone. Every token row's slot is read from `row_slots`, a persistent buffer (so
a CUDA graph replays with new values), which `set_row_slots` fills before a forward.

Adapters come in from disk once (checked, into a host cache of `max_cpu_loras`, least recently used out first)
and move into a device slot when a step needs them: a free slot, else the least recently used slot that this step
does not need; a step that needs more distinct adapters than `max_loras` is refused (`assign_slots`).

The engine drives it through `hooks.py` (`LLM(enable_lora=True)`): each step's slots and rows before every forward,
at most `max_loras` adapters per step (the scheduler's admission rule). `tests/test_lora.py` also drives it directly
(every row on one adapter) against HF + peft.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from nanoref.engine.kv_budget import cpu_memory_available
from nanoref.lora.adapters import LoRAAdapter, expected_shapes, load_adapter
from nanoref.lora.request import LoRARequest
from nanoref.ops.lora import lora_delta
from nanoref.utils.seams import seam

MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
PIECES = {"self_attn.qkv_proj": (0, 1, 2), "mlp.gate_up_proj": (0, 1)}  # fused modules' pieces, in output order


class LoRASlots:
    """One adapted projection's slots: per piece, A (S, R, in) and B (S, R, out), zero where no adapter is."""

    def __init__(self, module: nn.Module, sizes: list[tuple[int, int]], max_loras: int, max_rank: int) -> None:
        like = dict(dtype=module.weight.dtype, device=module.weight.device)
        self.lora_a = [torch.zeros(max_loras, max_rank, size_in, **like) for size_in, _ in sizes]
        self.lora_b = [torch.zeros(max_loras, max_rank, size_out, **like) for _, size_out in sizes]
        self.offsets = np.cumsum([0] + [size_out for _, size_out in sizes]).tolist()  # where each piece's rows start


def adapted_modules(layer: nn.Module) -> list[str]:
    """The projections of a decoder layer that take LoRA: all of MODULES, but no MLP in a Qwen3-MoE sparse layer
    (its experts are stacked 3-D weights, which peft's target_modules do not adapt either)."""
    return [name for name in MODULES if not name.startswith("mlp.") or hasattr(layer.mlp, name.removeprefix("mlp."))]


def check_slots_fit(model: nn.Module, sizes: dict, max_loras: int, max_lora_rank: int) -> int:
    """The bytes the slots of every adapted projection take -> that count; ValueError naming max_loras and
    max_lora_rank where, on a CPU, they are more than the memory available (torch.zeros would write pages the
    allocation only promised, and the kernel's OOM killer would end the process)."""
    weight = model.model.layers[0].get_submodule(MODULES[0]).weight
    per_slot = sum(
        size_in + size_out
        for layer in model.model.layers
        for name in adapted_modules(layer)
        for size_in, size_out in sizes[name]
    )
    needed = per_slot * max_loras * max_lora_rank * weight.element_size()
    available = cpu_memory_available(fallback=None) if weight.device.type == "cpu" else None
    if available is not None and needed > available:
        raise ValueError(slots_too_large(max_loras, max_lora_rank, needed, weight.device, available))
    return needed


def slots_too_large(max_loras: int, max_lora_rank: int, needed: int, device, available: int | None) -> str:
    why = "they could not be allocated" if available is None else f"{available / 2**30:.1f} GiB is available"
    return (
        f"max_lora_rank={max_lora_rank} with max_loras={max_loras} needs {needed / 2**30:.1f} GiB for the LoRA slots "
        f"on {device}, but {why}: lower max_lora_rank (the largest rank of the adapters served) or max_loras"
    )


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        hf_config,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_num_tokens: int,
    ) -> None:
        self.config = hf_config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        layers = model.model.layers
        device = next(model.parameters()).device
        self.dtype = layers[0].get_submodule(MODULES[0]).weight.dtype  # the slots' (an adapter must be finite in it)
        sizes = {
            name: [expected_shapes(hf_config, name, piece) for piece in PIECES.get(name, (None,))] for name in MODULES
        }
        slot_bytes = check_slots_fit(model, sizes, max_loras, max_lora_rank)
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        self.hooks = []
        for index, layer in enumerate(layers):
            for name in adapted_modules(layer):
                module = layer.get_submodule(name)
                try:
                    slots = self.slots[index, name] = LoRASlots(module, sizes[name], max_loras, max_lora_rank)
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
                    if isinstance(error, RuntimeError) and "alloc" not in str(error).lower():
                        raise
                    raise ValueError(slots_too_large(max_loras, max_lora_rank, slot_bytes, device, None)) from None
                self.hooks.append(module.register_forward_hook(self._hook(slots)))
        self.scalings = torch.zeros(max_loras, dtype=torch.float32, device=device)  # (S,)
        self.row_slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)  # (N_max,)
        # the next forward's rows are all base-model rows (set with them by the engine's step hook): an eager forward
        # skips the delta, whose every row would be zero
        self.base_only = False
        # what a CUDA graph being recorded holds: the delta (False: any row may have an adapter) or W alone (True: a
        # graph for steps of base-model rows, see hooks.GraphsByRowMix)
        self.record_base_only = False
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter (lora_int_id) in each slot
        self.slot_order: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # checked adapters, least recently used first
        self.requests: dict[int, LoRARequest] = {}
        # the adapters of requests not finished yet (hooks.py sets it): they never leave the host, which may then hold
        # more than max_cpu_loras. An accepted request runs the adapter that was checked when it was made: read again
        # from disk at its step, a folder deleted since would fail it there, and one rewritten since would serve other
        # weights (and reuse K/V that the old ones computed, under the same cache salt)
        self.in_flight: Callable[[], set[int]] = set

    # -- the forward --------------------------------------------------------------------------------
    def _hook(self, slots: LoRASlots):
        def add_delta(module: nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]  # (N, in)
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            if self.record_base_only if capturing else self.base_only:
                return out  # a step of base-model rows alone: W alone (a graph: what it was recorded for)
            rows = self.row_slots[: x.shape[0]]  # (N,)
            for piece, (a, b) in enumerate(zip(slots.lora_a, slots.lora_b)):
                start, end = slots.offsets[piece], slots.offsets[piece + 1]
                # (a seam: notebook 14's exercise runs here in place of ops/lora.py's)
                out[:, start:end] += seam("lora_delta", lora_delta)(x, a, b, rows, self.scalings)  # (N, out_piece)
            return out

        return add_delta

    def set_row_slots(self, row_slots: np.ndarray) -> None:
        """Every token row's slot for the next forward, (N,) with -1 for base-model rows."""
        n = len(row_slots)
        host = torch.from_numpy(np.asarray(row_slots, dtype=np.int64))
        if self.row_slots.is_cuda:  # from pinned memory: a pageable copy waits for the device (for the step in
            host = host.pin_memory()  # flight, in the overlapped loop: its overlap would be lost every step)
        self.row_slots[:n].copy_(host, non_blocking=True)
        self.row_slots[n:].fill_(-1)

    # -- adapters -----------------------------------------------------------------------------------
    def read_lora(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter, checked: the host cache's copy, else read from its folder (LoRAAdapterError,
        ValueError). The host cache is left as it is: `add_lora(request, adapter)` puts it there."""
        self._check_id(request)
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(
                request.lora_path, request.lora_name, request.lora_int_id, self.config, self.max_lora_rank, self.dtype
            )
        return adapter

    def add_lora(
        self, request: LoRARequest, keep: Iterable[int] = (), adapter: LoRAAdapter | None = None
    ) -> LoRAAdapter:
        """Put `request`'s adapter into the host cache (a no-op if it is there): `adapter` if given (`read_lora`'s),
        else read and checked here; errors leave nothing. Beyond max_cpu_loras the least recently used adapter
        leaves the host, never one in a slot, this one, those in `keep` (a step's others) or one that a request in
        flight needs (`in_flight`)."""
        self._check_id(request)
        if request.lora_int_id not in self.host:
            adapter = self.read_lora(request) if adapter is None else adapter
            self.host[request.lora_int_id] = adapter
            self.requests[request.lora_int_id] = request
        self.host.move_to_end(request.lora_int_id)
        self._trim_host({request.lora_int_id, *keep})
        return self.host[request.lora_int_id]

    def _check_id(self, request: LoRARequest) -> None:
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} already names {known.lora_name!r} ({known.lora_path})")

    def _trim_host(self, keep: set[int]) -> None:
        keep = keep | self.in_flight() if len(self.host) > self.max_cpu_loras else keep
        while len(self.host) > self.max_cpu_loras:  # the least recently used one that may leave
            victim = next((i for i in self.host if i not in self.slot_ids and i not in keep), None)
            if victim is None:
                return
            del self.host[victim], self.requests[victim]

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is cleared); False if it was not loaded."""
        if lora_int_id not in self.host:
            return False
        if lora_int_id in self.slot_ids:
            self._clear(self.slot_ids.index(lora_int_id))
        del self.host[lora_int_id], self.requests[lora_int_id]
        return True

    def assign_slots(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Slots for the adapters one step needs -> {lora_int_id: slot}, loading those not in a slot yet."""
        by_id = {r.lora_int_id: r for r in requests}
        if len(by_id) > self.max_loras:
            raise ValueError(f"one step needs {len(by_id)} adapters, but max_loras is {self.max_loras}")
        for request in by_id.values():
            self.add_lora(request, keep=by_id)
        assigned = {}
        for lora_id in by_id:
            if lora_id in self.slot_ids:
                slot = self.slot_ids.index(lora_id)
            else:
                slot = self._free_slot(set(by_id))
                self._load(slot, self.host[lora_id])
            self.slot_order.pop(slot, None)
            self.slot_order[slot] = None  # the most recently used
            assigned[lora_id] = slot
        self._trim_host(set(by_id))
        return assigned

    def _free_slot(self, keep: set[int]) -> int:
        if None in self.slot_ids:
            return self.slot_ids.index(None)
        return next(slot for slot in self.slot_order if self.slot_ids[slot] not in keep)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        self._clear(slot)
        for (layer, module, piece), (a, b) in adapter.weights.items():
            slots = self.slots[layer, module]
            index = 0 if piece is None else piece
            slots.lora_a[index][slot, : adapter.rank].copy_(a)  # (r, in)
            slots.lora_b[index][slot, : adapter.rank].copy_(b.T)  # (r, out)
        self.scalings[slot] = adapter.scaling
        self.slot_ids[slot] = adapter.int_id

    def _clear(self, slot: int) -> None:
        for slots in self.slots.values():
            for a, b in zip(slots.lora_a, slots.lora_b):
                a[slot].zero_()
                b[slot].zero_()
        self.scalings[slot] = 0.0
        self.slot_ids[slot] = None
        self.slot_order.pop(slot, None)
