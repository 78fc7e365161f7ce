"""Checks for the notebooks' exercises: a learner's function alone against a reference, then inside the engine.

Each exercise is a function named after an exercise seam (`nanoref.utils.seams.SEAMS`). Its `check_<seam>`
first tests it on fresh random inputs against nanoref's own version or the naive oracle, with messages that say
what to fix, then runs the real engine with it in place (`seams.use`) and compares greedy generation token by
token with HF transformers (`check_generation`). The checks cannot be replaced from a notebook cell: see
`nanoref.exercises.integrity`.

One module per notebook, named after it: varlen_flattening (01), rmsnorm (02), triton_kv_store (03),
paged_decode_attention (04), scheduler (05), cuda_graphs (06), model_and_sampling (07), tensor_parallel (08), moe
(09), serving (11), speculative_decoding (12), structured_output (13), lora (14); common.py (the engine run every
check ends with), tensors.py (comparing a learner's tensors), integrity.py (sealing the checks).
"""

import sys

from nanoref.exercises.common import ExerciseFailure, check_generation, tiny_model
from nanoref.exercises.cuda_graphs import check_pad_decode_batch
from nanoref.exercises.integrity import seal
from nanoref.exercises.lora import check_lora_delta
from nanoref.exercises.model_and_sampling import (
    check_apply_rotary,
    check_apply_top_k_top_p,
    check_seeded_sampling,
    check_silu_and_mul,
)
from nanoref.exercises.moe import check_moe_experts, check_moe_route, tiny_moe_model
from nanoref.exercises.paged_decode_attention import check_merge_splits, check_paged_decode_attention
from nanoref.exercises.rmsnorm import check_add_rms_norm, check_rms_norm
from nanoref.exercises.scheduler import check_choose_preemption_victim, check_find_cached_prefix
from nanoref.exercises.serving import check_find_stop_string, check_stop_hold_back
from nanoref.exercises.speculative_decoding import check_accept_greedy, check_rejection_sample
from nanoref.exercises.structured_output import check_apply_token_bitmask
from nanoref.exercises.tensor_parallel import check_vocab_parallel_embed
from nanoref.exercises.triton_kv_store import check_store_kvcache_kernel
from nanoref.exercises.varlen_flattening import check_prefill_metadata
from nanoref.utils.seams import SEAMS, use

__all__ = [
    "SEAMS",
    "ExerciseFailure",
    "check_accept_greedy",
    "check_add_rms_norm",
    "check_apply_token_bitmask",
    "check_apply_rotary",
    "check_apply_top_k_top_p",
    "check_choose_preemption_victim",
    "check_find_cached_prefix",
    "check_find_stop_string",
    "check_generation",
    "check_lora_delta",
    "check_merge_splits",
    "check_moe_experts",
    "check_moe_route",
    "check_pad_decode_batch",
    "check_paged_decode_attention",
    "check_prefill_metadata",
    "check_rejection_sample",
    "check_rms_norm",
    "check_seeded_sampling",
    "check_silu_and_mul",
    "check_stop_hold_back",
    "check_store_kvcache_kernel",
    "check_vocab_parallel_embed",
    "tiny_model",
    "tiny_moe_model",
    "use",
]

# last, with every check imported: a learner's cell can no longer replace a check or a helper it calls
seal(sys.modules[__name__], ExerciseFailure)
