"""Per-step metadata: the only place that knows which flat token belongs to which sequence.

The model sees flat tensors (`input_ids (N,)`, `hidden (N, hidden_size)`). Before each forward the
model runner fills a `Context` and publishes it with `set_context`; the attention layers and the LM
head read it with `get_context`. Keeping it out of the call signatures lets every other layer stay a
plain per-token function, as in Nano-vLLM.

Each thread has its own: two engines stepping in two threads at once (a server's and an offline one in the same
process) never read each other's metadata.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Context:
    is_prefill: bool = False
    # prefill (varlen): sequence boundaries in the flat query and key streams
    cu_seqlens_q: torch.Tensor | None = None  # (num_seqs + 1,) int32: [0, q1, q1+q2, ...]
    cu_seqlens_k: torch.Tensor | None = None  # (num_seqs + 1,) int32: keys include cached history
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # where each new token's K/V goes: block_id * block_size + offset, -1 = write nothing
    slot_mapping: torch.Tensor | None = None  # (N,) int64
    # decode: tokens of history per sequence (the new token included)
    context_lens: torch.Tensor | None = None  # (num_seqs,) int32
    # physical block ids per sequence, padded with -1; set in decode and in prefill with cached history
    block_tables: torch.Tensor | None = None  # (num_seqs, max_blocks) int32
    # decode: the backend's `scheduler_metadata` (Triton: the order its programs take the sequences), made from
    # context_lens by the first attention layer of the step and shared by the others (layers/attention.py)
    scheduler_metadata: torch.Tensor | None = None
    # decode: (num_seqs,) int32, per sequence the leading tokens it reads from the same cache blocks as the others
    # (a shared system prompt; 0: none), which attention then reads once for many sequences (cascade attention);
    # None: no such prefix this step
    shared_prefix_lens: torch.Tensor | None = None
    # prefill: the LM head makes logits for every token, not only each sequence's last (a speculative verify step
    # checks every proposed token: nanoref/speculative/)
    all_logits: bool = False
    # decode: query tokens per sequence, each sequence's new tokens one after the other in the flat batch (1; k + 1
    # in a speculative verify step, which checks the last token and k proposals against the paged history)
    decode_query_len: int = 1


class _PerThread(threading.local):
    context = Context()  # (a fresh thread starts with the empty one: `local` runs no __init__ for class attributes)


_CURRENT = _PerThread()


def get_context() -> Context:
    return _CURRENT.context


def set_context(context: Context) -> None:
    _CURRENT.context = context


def reset_context() -> None:
    _CURRENT.context = Context()


# each array starts on a 16-byte boundary of the shared buffer: Triton compiles a kernel variant per pointer
# alignment class (divisible by 16 or not), so views at offsets that change with the batch's sizes would compile new
# variants mid-run (a second or more each)
ALIGN_INT32 = 4


def upload_arrays(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """A step's int arrays as int32 device tensors of the same shapes: views into one buffer, each starting 16-byte
    aligned, copied in one go (on CUDA from fresh pinned memory, so the copy does not block)."""
    starts, end = [], 0
    for array in arrays.values():
        starts.append(end)
        end += -(-array.size // ALIGN_INT32) * ALIGN_INT32
    packed = np.empty(end, dtype=np.int32)  # (the gaps between arrays are never read)
    for start, array in zip(starts, arrays.values()):
        packed[start : start + array.size] = array.ravel()  # (int64 -> int32)
    host = torch.from_numpy(packed)
    flat = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    return {
        name: flat[start : start + array.size].view(array.shape) for (name, array), start in zip(arrays.items(), starts)
    }
